"""Repair datagrams: the codec on its own (any one lost datagram of a run comes back, bit for bit;
hostile repairs rebuild nothing and raise nothing), and two endpoints on a lossy path in memory,
where a lost datagram no longer costs its transfer a round trip."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import pytest
from hypothesis import given, strategies as st

from petals_core.testing import MemoryNetwork, Pipe
from petals_core.transport import TransportConfig
from petals_core.transport._repair import (
    MIN_PROTECTED_BYTES,
    REPAIR,
    WHOLE_REPAIR_BYTES,
    RepairDecoder,
    RepairEncoder,
)

from ._pairs import FAR_CLIENT, FAR_SERVER, Recorder, handshake, make_pair, transfer

CID = 8
TO = ("192.0.2.2", 2000)


def _datagram(rng: random.Random, size: int) -> bytes:
    """A 1-RTT QUIC datagram as far as repairs care: the fixed bit set, the long-header bit not,
    a connection id, random bytes."""
    return bytes([0x40 | rng.randrange(0x40)]) + b"C" * CID + rng.randbytes(size - 1 - CID)


def _run(seed: int, sizes: list[int]) -> list[bytes]:
    rng = random.Random(seed)
    return [_datagram(rng, size) for size in sizes]


def _repairs(out: list[tuple[bytes, object]]) -> list[bytes]:
    return [data for data, _ in out if data[0] == REPAIR]


def _decode(received: list[bytes], pieces: list[bytes]) -> tuple[RepairDecoder, bytes | None]:
    decoder = RepairDecoder(window=64, cid_bytes=CID)
    for data in received:
        decoder.record(data)
    rebuilt = None
    for piece in pieces:
        got = decoder.receive(piece)
        rebuilt = got if got is not None else rebuilt
    return decoder, rebuilt


@given(
    sizes=st.lists(st.integers(min_value=40, max_value=16384), min_size=1, max_size=16),
    lost=st.integers(min_value=0, max_value=15),
    seed=st.integers(min_value=0, max_value=1000),
)
def test_any_one_lost_datagram_of_a_run_is_rebuilt_exactly(
    sizes: list[int], lost: int, seed: int
) -> None:
    run = _run(seed, sizes)
    lost %= len(run)
    encoder = RepairEncoder(group=16, cid_bytes=CID)
    out = encoder.interleave([(data, TO) for data in run], limit=16384, last=True)
    # The datagrams leave as they were, in order, the repair after them.
    assert [data for data, _ in out if data[0] != REPAIR] == run
    pieces = _repairs(out)
    if max(sizes) < MIN_PROTECTED_BYTES:
        assert not pieces  # acknowledgements and the like are not worth a repair
        return
    assert out[-len(pieces) :] == [(piece, TO) for piece in pieces]
    # No piece needs more of the path than the run did, or than every QUIC path carries.
    assert all(len(piece) <= max(max(sizes), WHOLE_REPAIR_BYTES) for piece in pieces)
    decoder, rebuilt = _decode(run[:lost] + run[lost + 1 :], pieces)
    assert rebuilt == run[lost]
    assert decoder.rebuilt == 1 and decoder.malformed == 0


def test_runs_are_cut_at_the_group_size_and_at_a_change_of_address() -> None:
    run = _run(1, [1452] * 40)
    other = ("198.51.100.9", 4000)
    batch = [(data, TO) for data in run[:35]] + [(data, other) for data in run[35:]]
    out = RepairEncoder(group=16, cid_bytes=CID).interleave(batch, limit=1452, last=True)
    # Repairs follow datagrams 16, 32 and 35 (to TO), and 40 (to the other address); each is
    # two halves (1452 bytes do not fit a 1,200-byte repair).
    positions = [i for i, (data, _) in enumerate(out) if data[0] == REPAIR]
    assert len(positions) == 8
    cuts = [i - sum(p < i for p in positions) for i in positions[::2]]
    assert cuts == [16, 32, 35, 40]
    assert [out[i][1] for i in positions] == [TO] * 6 + [other] * 2


def test_a_run_goes_on_across_calls_until_the_last_datagrams_for_now() -> None:
    run = _run(12, [1452] * 20)
    encoder = RepairEncoder(group=16, cid_bytes=CID)
    out = []
    for start in range(0, 20, 3):  # a paced sender hands over three at a time
        out += encoder.interleave(
            [(data, TO) for data in run[start : start + 3]], limit=1452, last=start + 3 >= 20
        )
    positions = [i for i, (data, _) in enumerate(out) if data[0] == REPAIR]
    assert positions == [16, 17, 22, 23]  # after the 16th datagram, and after the last
    assert [data for data, _ in out if data[0] != REPAIR] == run
    for lost in (3, 17):
        received = run[:lost] + run[lost + 1 :]
        _, rebuilt = _decode(received, [out[i][0] for i in positions])
        assert rebuilt == run[lost]


def test_long_headers_and_path_probes_pass_unprotected() -> None:
    rng = random.Random(2)
    handshake = bytes([0xC0]) + rng.randbytes(1199)
    probe = _datagram(rng, 1400)
    data = _datagram(rng, 1200)
    out = RepairEncoder(group=16, cid_bytes=CID).interleave(
        [(handshake, TO), (probe, TO), (data, TO)], limit=1300, last=True
    )
    assert [d for d, _ in out[:3]] == [handshake, probe, data]
    # The repair covers the one datagram it may: losing it, the receiver rebuilds it.
    _, rebuilt = _decode([handshake, probe], _repairs(out))
    assert rebuilt == data


def test_two_losses_in_a_run_are_left_to_quic() -> None:
    run = _run(3, [1000] * 8)
    pieces = _repairs(
        RepairEncoder(group=16, cid_bytes=CID).interleave([(d, TO) for d in run], 1452, last=True)
    )
    decoder, rebuilt = _decode(run[2:], pieces)
    assert rebuilt is None and decoder.useless == 1
    decoder, rebuilt = _decode(run, pieces)  # nothing lost: nothing to rebuild
    assert rebuilt is None and decoder.useless == 1 and decoder.rebuilt == 0


def test_a_datagram_pushed_out_of_the_window_is_missing() -> None:
    run = _run(4, [1000] * 4)
    pieces = _repairs(
        RepairEncoder(group=16, cid_bytes=CID).interleave([(d, TO) for d in run], 1452, last=True)
    )
    decoder = RepairDecoder(window=8, cid_bytes=CID)
    for data in run[1:] + _run(5, [500] * 8):  # eight later datagrams push the run out
        decoder.record(data)
    assert decoder.receive(pieces[0]) is None and decoder.useless == 1


def _tampered(piece: bytes, at: int) -> bytes:
    return piece[:at] + bytes([piece[at] ^ 0x5A]) + piece[at + 1 :]


def test_hostile_repairs_rebuild_nothing_and_raise_nothing() -> None:
    run = _run(6, [1452] * 6)
    pieces = _repairs(
        RepairEncoder(group=16, cid_bytes=CID).interleave([(d, TO) for d in run], 1452, last=True)
    )
    assert len(pieces) == 2
    received = run[1:]
    header = 1 + CID
    cases = {
        "truncated": [pieces[0][: header + 3], pieces[1]],
        "a byte short": [pieces[0][:-1], pieces[1]],
        "halves of two repairs": [pieces[0], _tampered(pieces[1], header + 7)],
        "three of two": [_tampered(pieces[0], header + 2), pieces[1]],
        "an empty run": [pieces[0][: header + 3] + b"\0" + pieces[0][header + 4 :]],
        "a longer run than it carries ids for": [
            pieces[0][: header + 3] + b"\x40" + pieces[0][header + 4 :],
            pieces[1],
        ],
    }
    for name, sent in cases.items():
        decoder, rebuilt = _decode(received, sent)
        assert rebuilt is None, name
        assert decoder.rebuilt == 0, name
    # A flipped bit in the XOR's tail rebuilds a datagram whose id does not match.
    decoder, rebuilt = _decode(received, [pieces[0], _tampered(pieces[1], len(pieces[1]) - 2)])
    assert rebuilt is None and decoder.malformed == 1
    # One elsewhere cannot be told here: the rebuilt datagram is wrong, and QUIC's
    # authentication drops it (as the endpoint test below shows of forged repairs).
    _, rebuilt = _decode(received, [pieces[0], _tampered(pieces[1], len(pieces[1]) - 9)])
    assert rebuilt is not None and rebuilt != run[0]


def test_only_a_datagram_of_the_repairs_own_connection_is_rebuilt() -> None:
    rng = random.Random(13)
    kept = _datagram(rng, 600)
    for lost in (
        bytes([REPAIR]) + b"C" * CID + rng.randbytes(500),  # a repair inside a repair
        bytes([0x41]) + b"D" * CID + rng.randbytes(500),  # another connection's datagram
    ):
        # Built as a forger would: the encoder itself covers 1-RTT datagrams only.
        (forged,) = RepairEncoder(group=16, cid_bytes=CID)._repair([kept, lost])
        decoder, rebuilt = _decode([kept], [forged])
        assert rebuilt is None and decoder.malformed == 1


def test_the_decoder_keeps_what_the_peers_runs_need_and_no_more() -> None:
    decoder = RepairDecoder(window=4, cid_bytes=CID, max_bytes=1452)
    run = _run(14, [1452] * 40)
    for data in run:
        decoder.record(data)
    encoder = RepairEncoder(group=40, cid_bytes=CID)
    pieces = _repairs(encoder.interleave([(d, TO) for d in run], 1452, last=True))
    assert decoder.receive(pieces[0]) is None and decoder.receive(pieces[1]) is None
    assert decoder.useless == 1  # four kept: the run was lost to it
    assert decoder.window == 160  # four of the peer's runs from now on
    for data in run[1:]:
        decoder.record(data)
    again = _repairs(encoder.interleave([(d, TO) for d in run], 1452, last=True))
    assert decoder.receive(again[0]) is None and decoder.receive(again[1]) == run[0]
    # A repair for datagrams larger than the path carries is refused before any work.
    big = _run(15, [4000])
    halves = RepairEncoder(group=16, cid_bytes=CID)._repair(big)
    assert decoder.receive(halves[0]) is None and decoder.malformed == 1


@given(st.binary(max_size=3000))
def test_any_bytes_as_a_repair_raise_nothing(junk: bytes) -> None:
    decoder = RepairDecoder(window=16, cid_bytes=CID)
    for data in _run(7, [600] * 4):
        decoder.record(data)
    decoder.receive(bytes([REPAIR]) + junk)


def test_a_decoder_without_repairs_goes_idle() -> None:
    decoder = RepairDecoder(window=4, cid_bytes=CID)
    for data in _run(8, [300] * 32):
        decoder.record(data)
    assert not decoder.idle
    decoder.record(_run(9, [300])[0])
    assert decoder.idle


def test_the_group_size_is_checked() -> None:
    with pytest.raises(ValueError, match="1 to 64"):
        RepairEncoder(group=65, cid_bytes=CID)


# -- two endpoints on a lossy path --------------------------------------------------------------

RTT = 0.1
SIZE = 300_000


def _connected(
    repair_group: int = 16, server_type: type[Recorder] = Recorder
) -> tuple[MemoryNetwork, Recorder, Recorder, int]:
    """Two endpoints on hosts ``RTT`` apart, connected."""
    config = TransportConfig(keepalive_interval_s=None, repair_group=repair_group)
    pipe = Pipe(latency_s=RTT / 2)
    net, client, server = make_pair(config, pipe=pipe, far=True, server_type=server_type)
    return net, client, server, handshake(net, client, server, FAR_SERVER)


def _transfer(
    net: MemoryNetwork, client: Recorder, server: Recorder, handle: int, seed: int
) -> float:
    took = transfer(net, client, server, handle, SIZE, seed=seed)
    assert not net.run_until(lambda: False, max_time_s=1)  # the last ACKs arrive
    return took


def _lossy_transfers(repair_group: int) -> tuple[list[float], Recorder, Recorder]:
    """Three transfers on a connection whose datagram size search is over; the client's 50th
    full-size datagram of each transfer is lost.  How long each took."""
    net, client, server, handle = _connected(repair_group)
    assert net.run_until(
        lambda: all(
            r.endpoint.path_info(h).datagram_search_done  # type: ignore[union-attr]
            for r, h in ((client, handle), (server, next(iter(server.ready))))
        )
    )
    counted = [0]

    def drop(index: int, data: bytes) -> bool:
        if len(data) < 1400 or data[0] == REPAIR:
            return False
        counted[0] += 1
        return counted[0] == 50

    net.set_pipe(FAR_CLIENT, FAR_SERVER, Pipe(latency_s=RTT / 2, drop=drop))
    took = []
    for seed in range(3):
        counted[0] = 0
        took.append(_transfer(net, client, server, handle, seed))
    return took, client, server


def test_on_a_lossy_path_a_lost_datagram_is_rebuilt_without_a_round_trip() -> None:
    plain, _, _ = _lossy_transfers(repair_group=0)
    repaired, client, server = _lossy_transfers(repair_group=16)
    # The first loss tells the sender that the path loses datagrams: from then on its runs
    # carry repairs, and the receiver rebuilds the later losses.
    assert client.endpoint.repairs_sent > 0
    assert server.endpoint.datagrams_rebuilt == 2
    assert server.endpoint.repairs_sent == 0  # the server's path lost nothing
    # Without repairs every transfer waits a round trip for the lost datagram; with them only
    # the first does.
    assert repaired[0] == pytest.approx(plain[0], abs=0.005)
    for with_repair, without in zip(repaired[1:], plain[1:], strict=True):
        assert with_repair < without - RTT / 2


def test_a_lossless_path_carries_no_repairs() -> None:
    net, client, server, handle = _connected()
    _transfer(net, client, server, handle, seed=0)
    assert client.endpoint.repairs_sent == server.endpoint.repairs_sent == 0


class _Forged(Recorder):
    """A server whose peer's every 1-RTT datagram comes with a forged repair: one that rebuilds
    that datagram with a flipped byte, one of junk, or one that takes a datagram for lost that
    is about to arrive."""

    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config)
        self.seen: list[bytes] = []
        self.rng = random.Random(10)

    def receive_datagram(self, data: bytes, address: tuple[str, int], now: float) -> None:
        if data[0] & 0xC0 == 0x40 and len(data) >= 400:
            self.seen.append(data)
            run = self.seen[-3:]
            encoder = RepairEncoder(group=16, cid_bytes=CID)
            *pieces, last = _repairs(
                encoder.interleave([(d, address) for d in run], 1452, last=True)
            )
            kind = len(self.seen) % 3
            if kind == 0:
                last = _tampered(last, len(last) - 9)
            elif kind == 1:
                last = last[: 1 + CID] + self.rng.randbytes(300)
            for piece in (*pieces, last):
                super().receive_datagram(piece, address, now)
        super().receive_datagram(data, address, now)


def test_forged_repairs_cost_a_connection_nothing() -> None:
    net, client, server, handle = _connected(server_type=_Forged)
    _transfer(net, client, server, handle, seed=11)
    assert not client.lost and not server.lost
    # A third of the forgeries rebuilt a wrong datagram, and a third one that was about to
    # arrive: QUIC dropped the first (unauthentic) and the copies of the second.
    assert isinstance(server, _Forged)
    assert len(server.seen) > 100 and server.endpoint.datagrams_rebuilt > len(server.seen) / 2


def _capture(net: MemoryNetwork, drop: Callable[[int, bytes], bool] | None = None) -> list[bytes]:
    """What the client sends the server from now on (the datagrams ``drop`` picks are lost)."""
    sent: list[bytes] = []

    def take(index: int, data: bytes) -> bool:
        sent.append(data)
        return drop is not None and drop(index, data)

    net.set_pipe(FAR_CLIENT, FAR_SERVER, Pipe(latency_s=RTT / 2, drop=take))
    return sent


def test_a_repair_nested_in_repairs_is_refused_at_once() -> None:
    """A forged repair whose "lost datagram" is another repair, hundreds deep: refused at the
    first level (a repair rebuilds only a 1-RTT datagram), with no recursion."""
    net, client, server, handle = _connected()
    sent = _capture(net)
    _transfer(net, client, server, handle, seed=2)
    cid = next(data for data in sent if data[0] & 0xC0 == 0x40)[1 : 1 + CID]
    tail = b"XXXX"

    def wrap(inner: bytes, serial: int) -> bytes:
        header = struct.pack("!HBBHH", serial, 1, 1, len(inner), len(inner))
        return bytes([REPAIR]) + cid + header + tail + inner

    data = bytes([0x40]) + cid + bytes(20) + tail
    for level in range(600):
        data = wrap(data, level)
    first = wrap(bytes([0x40]) + cid + b"y" * 30 + tail, 9999)  # the decoder starts here
    server.endpoint.receive_datagram(first, FAR_CLIENT, net.now)
    server.endpoint.receive_datagram(data, FAR_CLIENT, net.now)
    assert server.endpoint.datagrams_rebuilt == 0
    _transfer(net, client, server, handle, seed=3)  # and the connection serves on


class _NotReading(Recorder):
    def __init__(self, config: TransportConfig) -> None:
        super().__init__(config, consume=False)


def test_a_run_held_back_by_flow_control_gets_its_repair_at_once() -> None:
    net, client, server, handle = _connected(server_type=_NotReading)
    big = [0]

    def drop_the_fifth(index: int, data: bytes) -> bool:
        big[0] += len(data) >= 1000 and data[0] != REPAIR
        return big[0] == 5 and len(data) >= 1000 and data[0] != REPAIR

    sent = _capture(net, drop_the_fifth)
    _transfer(net, client, server, handle, seed=4)  # a loss: the path is losing
    del sent[:]
    stream_id = client.endpoint.open_stream(handle)
    window = client.endpoint.config.stream_window_bytes
    client.endpoint.send_stream_data(handle, stream_id, bytes(window + 100_000), net.now)
    assert not net.run_until(lambda: False, max_time_s=5)
    # The server reads nothing: what its window let through went out, and every run of it got
    # its repair then, though more data waits to be sent.
    data = [d for d in sent if d[0] & 0xC0 == 0x40 and len(d) >= 1000]
    covered = {
        piece[at : at + 4]
        for piece in sent
        if piece[0] == REPAIR
        for at in range(1 + CID + 8, 1 + CID + 8 + 4 * piece[1 + CID + 3], 4)
    }
    assert len(data) > 2000
    assert [d for d in data if d[-4:] not in covered] == []
    # What the peer's window holds back is not "more to come" for the run (it may wait forever).
    quic = client.endpoint._live(handle).quic
    assert quic.send_buffered() == 100_000 and not quic.sending()
