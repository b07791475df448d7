"""The sans-IO endpoint, pair against pair in memory, with a virtual clock."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from aioquic.buffer import Buffer
from aioquic.quic.packet import QuicPacketType, pull_quic_header

from petals_core._errors import ConnectionClosed, ConnectTimeout, IdentityMismatch
from petals_core.testing import MemoryNetwork, Pipe
from petals_core.transport._config import TransportConfig
from petals_core.transport._endpoint import Endpoint
from petals_core.transport._identity import Identity
from petals_core.transport._quic import LONE_ACK_DELAY_S
from petals_core.transport._relay_wire import virtual_address

from ._pairs import CLIENT, FAR_CLIENT, FAR_SERVER, SERVER, Recorder, handshake, make_pair


def test_handshake_authenticates_both_ends() -> None:
    net, client, server = make_pair()
    handle = handshake(net, client, server)
    assert client.ready[handle].peer_id == server.identity.peer_id
    (server_side,) = server.ready.values()
    assert server_side.peer_id == client.identity.peer_id
    assert not server_side.is_client


def test_wrong_peer_id_is_refused() -> None:
    net, client, server = make_pair()
    impostor = Identity.generate().peer_id
    handle = client.endpoint.connect(SERVER, impostor, net.now)
    assert net.run_until(lambda: handle in client.lost)
    assert isinstance(client.lost[handle].error, IdentityMismatch)
    assert handle not in client.ready
    # The server sees the connection end too, and never serves it.
    assert net.run_until(lambda: len(server.lost) == 1 or not server.ready)


def test_connect_times_out_without_answer() -> None:
    config = TransportConfig(connect_timeout_s=3.0, keepalive_interval_s=None)
    net, client, server = make_pair(config)
    net.detach(SERVER)
    handle = client.endpoint.connect(SERVER, server.identity.peer_id, net.now)
    assert net.run_until(lambda: handle in client.lost, max_time_s=30)
    assert isinstance(client.lost[handle].error, ConnectTimeout)
    assert 3.0 <= net.now < 4.0


def _payload(index: int, size: int) -> bytes:
    return random.Random(index).randbytes(size)


def _send_streams(net: MemoryNetwork, client: Recorder, server: Recorder, count: int, size: int):
    handle = handshake(net, client, server)
    expected = {}
    for index in range(count):
        stream_id = client.endpoint.open_stream(handle)
        data = _payload(index, size + index)
        client.endpoint.send_stream_data(handle, stream_id, data, net.now, end_stream=True)
        expected[stream_id] = hashlib.sha256(data).hexdigest()
    (server_handle,) = server.ready
    done = lambda: all((server_handle, sid) in server.finished for sid in expected)  # noqa: E731
    assert net.run_until(done, max_time_s=120)
    for stream_id, digest in expected.items():
        got = bytes(server.received[(server_handle, stream_id)])
        assert hashlib.sha256(got).hexdigest() == digest


def test_many_streams() -> None:
    net, client, server = make_pair()
    _send_streams(net, client, server, count=40, size=20_000)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_loss_and_reordering(seed: int) -> None:
    pipe = Pipe(latency_s=0.002, loss=0.05, jitter_s=0.003)
    net, client, server = make_pair(pipe=pipe, seed=seed)
    _send_streams(net, client, server, count=8, size=100_000)
    assert net.dropped > 0


def test_dropping_chosen_datagrams_during_handshake() -> None:
    # Lose the first two datagrams (the client's Initial and its retransmission's first try).
    pipe = Pipe(drop=lambda index, data: index in (0, 2))
    net, client, server = make_pair(pipe=pipe)
    handshake(net, client, server)


@attrs.frozen
class Delivered:
    """Data sent on a fresh stream of a settled connection, just arrived at the server."""

    net: MemoryNetwork
    client: Recorder
    server: Recorder
    handle: int
    server_handle: int
    stream_id: int
    #: Datagrams the server had sent before the data arrived.
    server_sent: int
    arrived_at: float


def deliver(data: bytes) -> Delivered:
    net, client, server = make_pair()
    handle = handshake(net, client, server)
    while net.step(until=net.now + 0.2):  # the handshake's last packets and ACKs settle
        pass
    (server_handle,) = server.ready
    stream_id = client.endpoint.open_stream(handle)
    client.endpoint.send_stream_data(handle, stream_id, data, net.now)
    sent = len(server.sent_at)
    assert net.run_until(lambda: bool(server.received.get((server_handle, stream_id))))
    return Delivered(net, client, server, handle, server_handle, stream_id, sent, net.now)


def test_a_lone_request_is_acknowledged_by_its_answer() -> None:
    d = deliver(b"request")
    # The answer takes 5 ms to compute: no ACK-only packet leaves meanwhile ...
    while d.net.step(until=d.net.now + 0.005):
        pass
    assert len(d.server.sent_at) == d.server_sent
    # ... and the answer carries the ACK: one datagram in all.
    d.server.endpoint.send_stream_data(d.server_handle, d.stream_id, b"answer", d.net.now)
    answered = lambda: bytes(d.client.received.get((d.handle, d.stream_id), b"")) == b"answer"  # noqa: E731
    assert d.net.run_until(answered)
    while d.net.step(until=d.net.now + 0.2):
        pass
    assert len(d.server.sent_at) == d.server_sent + 1


def _ends_with(recorder: Recorder, key: tuple[int, int], data: bytes) -> Callable[[], bool]:
    return lambda: bytes(recorder.received.get(key, b"")).endswith(data)


@pytest.mark.parametrize("think_s", [0.0, 0.004, 0.010])
@pytest.mark.parametrize("new_stream_per_call", [False, True])
def test_request_response_exchanges_need_no_timer(
    think_s: float, new_stream_per_call: bool
) -> None:
    # Each side thinks up to 10 ms before it speaks (the server before its answer, the client
    # before its next request).  In steady state every packet carries the ACK of the one before:
    # no timer falls due on either side, and one datagram goes each way per exchange.
    d = deliver(b"settle")
    while d.net.step(until=d.net.now + 0.2):
        pass
    net, client, server = d.net, d.client, d.server
    rounds = 20
    timer_runs = client.timer_runs, server.timer_runs
    sent = len(client.sent_at), len(server.sent_at)
    stream_id = d.stream_id
    for index in range(rounds):
        request, answer = b"request %d" % index, b"answer %d" % index
        if new_stream_per_call:
            stream_id = client.endpoint.open_stream(d.handle)
        client.endpoint.send_stream_data(
            d.handle, stream_id, request, net.now, end_stream=new_stream_per_call
        )
        key = (d.server_handle, stream_id)
        assert net.run_until(_ends_with(server, key, request))
        while net.step(until=net.now + think_s):
            pass
        server.endpoint.send_stream_data(
            d.server_handle, stream_id, answer, net.now, end_stream=new_stream_per_call
        )
        if new_stream_per_call:
            server.endpoint.release_stream(d.server_handle, stream_id, net.now)
        key = (d.handle, stream_id)
        assert net.run_until(_ends_with(client, key, answer))
        if new_stream_per_call:
            assert key in client.finished
            client.endpoint.release_stream(d.handle, stream_id, net.now)
        while net.step(until=net.now + think_s):
            pass
    assert (client.timer_runs, server.timer_runs) == timer_runs
    assert len(client.sent_at) - sent[0] == rounds
    assert len(server.sent_at) - sent[1] == rounds


def test_a_lone_packet_without_answer_is_still_acknowledged() -> None:
    d = deliver(b"no answer")
    assert d.net.run_until(lambda: len(d.server.sent_at) > d.server_sent, max_time_s=1.0)
    # Within the lone-packet delay, well under the 25 ms max_ack_delay advertised.
    delay = d.server.sent_at[d.server_sent] - d.arrived_at
    assert LONE_ACK_DELAY_S - 0.001 <= delay <= LONE_ACK_DELAY_S + 0.002
    # The client saw it: nothing of its is left unacknowledged.
    assert d.net.run_until(lambda: d.client.endpoint.send_buffered(d.handle) == 0, max_time_s=1.0)


def test_several_packets_are_acknowledged_within_a_millisecond() -> None:
    d = deliver(_payload(7, 100_000))  # several datagrams, even of loopback size
    assert d.net.run_until(lambda: len(d.server.sent_at) > d.server_sent, max_time_s=1.0)
    assert d.server.sent_at[d.server_sent] - d.arrived_at <= 0.0015


def test_a_trickle_of_unanswered_requests_is_acknowledged_after_the_next_one() -> None:
    # A pipeline's next hop: requests arrive every few ms and are answered elsewhere.  The ACK
    # goes about a millisecond after the second request, not in the moment it arrives.
    d = deliver(b"first")
    while d.net.step(until=d.net.now + 0.010):
        pass
    assert len(d.server.sent_at) == d.server_sent  # the lone first one still waits
    d.client.endpoint.send_stream_data(d.handle, d.stream_id, b"second", d.net.now)
    key = (d.server_handle, d.stream_id)
    assert d.net.run_until(lambda: bytes(d.server.received[key]) == b"firstsecond")
    arrived = d.net.now
    assert len(d.server.sent_at) == d.server_sent
    assert d.net.run_until(lambda: len(d.server.sent_at) > d.server_sent, max_time_s=1.0)
    assert 0.0005 <= d.server.sent_at[d.server_sent] - arrived <= 0.0025
    assert d.net.run_until(lambda: d.client.endpoint.send_buffered(d.handle) == 0, max_time_s=1.0)


@pytest.mark.parametrize("asked", [0, 1])
def test_data_leaves_before_another_connections_lone_ack(asked: int) -> None:
    # The client owes two servers a lone ACK each when it sends a request to one of them: the
    # request's datagram comes first, whichever server it goes to.
    net, client, server = make_pair()
    other = Recorder(TransportConfig(keepalive_interval_s=None))
    net.attach(("127.0.0.1", 3000), other)
    handles = [handshake(net, client, server)]
    handles.append(client.endpoint.connect(("127.0.0.1", 3000), other.identity.peer_id, net.now))
    assert net.run_until(lambda: handles[1] in client.ready and len(other.ready) == 1)
    while net.step(until=net.now + 0.2):
        pass
    for peer, handle in zip((server, other), handles, strict=True):
        (peer_handle,) = peer.ready
        stream_id = peer.endpoint.open_stream(peer_handle)
        peer.endpoint.send_stream_data(peer_handle, stream_id, b"news", net.now)
        key = (handle, stream_id)
        assert net.run_until(lambda key=key: bytes(client.received.get(key, b"")) == b"news")
    # Nothing left yet: the ACKs wait for data to ride along with.  When they fall due, the
    # client also has a request for one of the servers.
    sent = len(client.sent_at)
    later = net.now + LONE_ACK_DELAY_S
    request = client.endpoint.open_stream(handles[asked])
    client.endpoint.send_stream_data(handles[asked], request, b"request", later)
    client.endpoint.handle_timers(later)
    out = client.endpoint.datagrams_to_send(later)
    assert len(client.sent_at) == sent
    addresses = [address for _, address in out]
    assert sorted(addresses) == [SERVER, ("127.0.0.1", 3000)]
    assert addresses[0] == (SERVER, ("127.0.0.1", 3000))[asked]


def test_receive_credit_follows_the_application() -> None:
    config = TransportConfig(
        keepalive_interval_s=None,
        stream_window_bytes=256 << 10,
        connection_window_bytes=1 << 20,
    )
    net, client, server = make_pair(config)
    server.consume = False
    handle = handshake(net, client, server)
    stream_id = client.endpoint.open_stream(handle)
    client.endpoint.send_stream_data(handle, stream_id, bytes(4 << 20), net.now)
    net.run_until(lambda: False, max_time_s=5)
    (server_handle,) = server.ready
    received = len(server.received[(server_handle, stream_id)])
    # The peer may only send what the application has room for, however long we wait.
    assert 0 < received <= config.stream_window_bytes
    assert client.endpoint.send_buffered(handle) >= (4 << 20) - received
    # Consuming releases more.
    server.endpoint.consume(server_handle, stream_id, received, net.now)
    server.consume = True
    net.run_until(lambda: len(server.received[(server_handle, stream_id)]) == 4 << 20)


def test_idle_timeout_and_keepalive() -> None:
    quiet = TransportConfig(idle_timeout_s=5.0, keepalive_interval_s=None)
    net, client, server = make_pair(quiet)
    handle = handshake(net, client, server)
    assert net.run_until(lambda: handle in client.lost, max_time_s=30)
    assert 5.0 <= net.now < 20.0
    error = client.lost[handle].error
    assert type(error) is ConnectionClosed and "idle" in str(error)

    chatty = attrs.evolve(quiet, keepalive_interval_s=1.0)
    net, client, server = make_pair(chatty)
    handle = handshake(net, client, server)
    net.run_until(lambda: handle in client.lost, max_time_s=30)
    assert handle not in client.lost and net.now >= 30


def test_reset_reaches_the_peer() -> None:
    net, client, server = make_pair()
    handle = handshake(net, client, server)
    stream_id = client.endpoint.open_stream(handle)
    client.endpoint.send_stream_data(handle, stream_id, b"hello", net.now)
    assert net.run_until(lambda: any(k[1] == stream_id for k in server.received))
    client.endpoint.reset_stream(handle, stream_id, 0x10, net.now)
    assert net.run_until(lambda: server.resets)
    assert server.resets[0].stream_id == stream_id and server.resets[0].error_code == 0x10


def test_close_is_seen_by_both() -> None:
    net, client, server = make_pair()
    handle = handshake(net, client, server)
    client.endpoint.close(handle, net.now, reason="bye")
    assert net.run_until(lambda: handle in client.lost and len(server.lost) == 1)
    # Both forget the connection after draining.
    assert net.run_until(
        lambda: client.endpoint.connection_count() == 0 and server.endpoint.connection_count() == 0
    )


def test_resets_under_loss_return_their_credit() -> None:
    """Bytes a peer counted against the window but never delivered (lost in flight, then the
    stream was reset) must not shrink the connection's window for good."""
    config = TransportConfig(
        keepalive_interval_s=None,
        stream_window_bytes=256 << 10,
        connection_window_bytes=1 << 20,
    )
    net, client, server = make_pair(config)
    handle = handshake(net, client, server)
    (server_handle,) = server.ready
    net.set_pipe(CLIENT, SERVER, Pipe(latency_s=0.005, loss=0.2))
    for _ in range(60):
        stream_id = client.endpoint.open_stream(handle)
        client.endpoint.send_stream_data(handle, stream_id, bytes(60_000), net.now)
        net.run_until(lambda: False, max_time_s=0.003)
        client.endpoint.reset_stream(handle, stream_id, 0x10, net.now)
        reset = lambda sid=stream_id: any(r.stream_id == sid for r in server.resets)  # noqa: E731
        net.run_until(reset, max_time_s=2)
        server.endpoint.release_stream(server_handle, stream_id, net.now)
        net.run_until(lambda: False, max_time_s=1)
    # On a clean link a 2 MiB upload (twice the connection window) must get through.
    net.set_pipe(CLIENT, SERVER, Pipe(latency_s=0.005))
    stream_id = client.endpoint.open_stream(handle)
    client.endpoint.send_stream_data(handle, stream_id, bytes(2 << 20), net.now, end_stream=True)
    assert net.run_until(lambda: (server_handle, stream_id) in server.finished, max_time_s=60)
    assert len(server.received[(server_handle, stream_id)]) == 2 << 20


def test_junk_initials_hold_no_connection() -> None:
    net, client, server = make_pair()
    rng = random.Random(3)
    for index in range(50):
        # A long-header Initial of QUIC v1 with random connection IDs and an undecryptable body.
        header = bytes([0xC0]) + (1).to_bytes(4, "big") + bytes([8]) + rng.randbytes(8)
        header += bytes([8]) + rng.randbytes(8) + bytes([0]) + (0x4000 | 1150).to_bytes(2, "big")
        datagram = header + rng.randbytes(1200 - len(header))
        server.endpoint.receive_datagram(datagram, ("127.0.0.1", 3000 + index), 0.0)
    assert server.endpoint.connection_count() == 0
    assert server.endpoint.datagrams_to_send(0.0) == []
    # A real client still gets in.
    handshake(net, client, server)


def _open_call(net: MemoryNetwork, client: Recorder, server: Recorder, handle: int) -> int:
    stream_id = client.endpoint.open_stream(handle)
    client.endpoint.send_stream_data(handle, stream_id, b"request", net.now)
    assert net.run_until(lambda: any(key[1] == stream_id for key in server.received))
    return stream_id


def test_a_vanished_peer_is_given_up_on_within_about_a_second_while_a_call_is_open() -> None:
    net, client, server = make_pair()
    handle = handshake(net, client, server)
    _open_call(net, client, server, handle)
    gone_at = net.now
    net.detach(SERVER)  # killed: no answer, not even an ICMP error
    assert net.run_until(lambda: handle in client.lost, max_time_s=30)
    error = client.lost[handle].error
    assert type(error) is ConnectionClosed and "stopped answering" in str(error)
    assert net.now - gone_at < 1.5


def test_silence_without_open_calls_waits_for_the_idle_timeout() -> None:
    net, client, server = make_pair(TransportConfig(keepalive_interval_s=None, idle_timeout_s=20))
    handle = handshake(net, client, server)
    net.detach(SERVER)
    net.run_until(lambda: handle in client.lost, max_time_s=10)
    assert handle not in client.lost
    assert net.run_until(lambda: handle in client.lost, max_time_s=30)
    assert "idle" in str(client.lost[handle].error)


@pytest.mark.parametrize("silence", [0.5, None])
def test_a_peer_that_is_alive_but_slow_to_answer_is_kept(silence: float | None) -> None:
    """The peer's application says nothing for a minute, but its QUIC stack acknowledges the
    PINGs: the call stays open (how long an answer may take is the caller's business)."""
    config = TransportConfig(keepalive_interval_s=None, peer_silence_s=silence)
    net, client, server = make_pair(config, pipe=Pipe(latency_s=0.05, loss=0.02))
    handle = handshake(net, client, server)
    _open_call(net, client, server, handle)
    net.run_until(lambda: handle in client.lost or bool(server.lost), max_time_s=50)
    assert handle not in client.lost and not server.lost


def test_without_peer_silence_a_vanished_peer_waits_for_the_idle_timeout() -> None:
    config = TransportConfig(keepalive_interval_s=None, peer_silence_s=None, idle_timeout_s=20)
    net, client, server = make_pair(config)
    handle = handshake(net, client, server)
    _open_call(net, client, server, handle)
    net.detach(SERVER)
    net.run_until(lambda: handle in client.lost, max_time_s=10)
    assert handle not in client.lost


@attrs.frozen
class Dialled:
    """Clients at several addresses that each dialled one server, once all of them got in or
    gave up."""

    net: MemoryNetwork
    server: Recorder
    clients: list[Recorder]
    handles: list[int]

    @property
    def got_in(self) -> list[bool]:
        return [h in c.ready for c, h in zip(self.clients, self.handles, strict=True)]


def _dial_from(addresses: list[tuple[str, int]], **settings: Any) -> Dialled:
    config = TransportConfig(keepalive_interval_s=None, connect_timeout_s=2.0, **settings)
    net = MemoryNetwork(random.Random(0), default=Pipe())
    server = Recorder(config)
    net.attach(FAR_SERVER, server)
    clients = [Recorder(config) for _ in addresses]
    for client, address in zip(clients, addresses, strict=True):
        net.attach(address, client)
    handles = [
        client.endpoint.connect(FAR_SERVER, server.identity.peer_id, net.now) for client in clients
    ]
    assert net.run_until(
        lambda: all(h in c.ready or h in c.lost for c, h in zip(clients, handles, strict=True)),
        max_time_s=30,
    )
    return Dialled(net, server, clients, handles)


def test_one_host_takes_only_its_share_of_connections() -> None:
    """Handshakes from one host beyond ``max_connections_per_host`` are ignored (an IPv6 host is
    its /64), other hosts still get in, and a closed connection frees its host's slot."""
    addresses = [("2001:db8:1:2::1", 1000), ("2001:db8:1:2::2", 1000), ("2001:db8:1:2::3", 1000)]
    dialled = _dial_from([*addresses, ("198.51.100.7", 1000)], max_connections_per_host=2)
    net, server, clients, handles = dialled.net, dialled.server, dialled.clients, dialled.handles
    assert dialled.got_in == [True, True, False, True]
    assert isinstance(clients[2].lost[handles[2]].error, ConnectTimeout)
    assert server.endpoint.connection_count() == 3
    # The first connection of that /64 ends: another from it gets in.
    clients[0].endpoint.close(handles[0], net.now)
    assert net.run_until(lambda: server.endpoint.connection_count() == 2, max_time_s=30)
    again = clients[2].endpoint.connect(FAR_SERVER, server.identity.peer_id, net.now)
    assert net.run_until(lambda: again in clients[2].ready, max_time_s=30)


def test_one_ipv6_site_takes_only_its_share_through_many_64s() -> None:
    """Handshakes from one IPv6 /48 beyond ``max_connections_per_site`` are ignored, each from
    a /64 of its own; another site still gets in."""
    addresses = [(f"2001:db8:1:{subnet}::1", 1000) for subnet in range(1, 5)]
    dialled = _dial_from(
        [*addresses, ("2001:db8:2:1::1", 1000)],
        max_connections_per_host=2,
        max_connections_per_site=3,
    )
    assert dialled.got_in == [True, True, True, False, True]
    assert dialled.server.endpoint.connection_count() == 4


def test_a_connection_cannot_move_into_or_out_of_a_relay() -> None:
    """A datagram of a direct connection arriving through a relay (or one of a relayed
    connection arriving directly) is dropped: the connection stays where it is, and nothing is
    sent to the new address.  (Such a move would take a connection past the per-host bounds.)"""
    net, client, server = make_pair(far=True)
    handle = handshake(net, client, server, FAR_SERVER)
    (server_handle,) = server.ready
    stream_id = client.endpoint.open_stream(handle)
    client.endpoint.send_stream_data(handle, stream_id, b"x", net.now, end_stream=True)
    (datagram, _), *_ = client.endpoint.datagrams_to_send(net.now)
    relayed = virtual_address(("203.0.113.9", 4000), 7)
    server.endpoint.receive_datagram(datagram, relayed, net.now)
    assert server.endpoint.peer_address(server_handle) == FAR_CLIENT
    assert all(to != relayed for _, to in server.endpoint.datagrams_to_send(net.now))


def _tap(seen: list[bytes]) -> Callable[[int, bytes], bool]:
    """A ``Pipe.drop`` that drops nothing and keeps every datagram in ``seen``."""
    return lambda _, data: bool(seen.append(data))  # type: ignore[func-returns-value]


def _is_retry(datagram: bytes) -> bool:
    if not datagram[0] & 0x80:
        return False
    header = pull_quic_header(Buffer(data=datagram), host_cid_length=8)
    return header.packet_type == QuicPacketType.RETRY


def test_forged_handshakes_hold_only_their_share_and_real_clients_prove_their_address() -> None:
    """Initials from forged source addresses (a real ClientHello each, every one from another
    host) fill ``max_unproven_handshakes`` slots and no more: each further one gets a Retry, a
    datagram far smaller than the Initial, and holds nothing.  The token a Retry carries does
    not work from another address; a real client answers its Retry with the token and gets in.
    Once the forged handshakes time out, clients get in without a Retry again."""
    config = TransportConfig(
        keepalive_interval_s=None, max_unproven_handshakes=2, connect_timeout_s=5.0
    )
    seen: list[bytes] = []
    net = MemoryNetwork(random.Random(0), default=Pipe(drop=_tap(seen)))
    server = Recorder(config)
    net.attach(FAR_SERVER, server)

    def first_answer(client: Endpoint, address: tuple[str, int]) -> tuple[bytes, list[bytes]]:
        """``client``'s Initial, sent from ``address``, and the server's answers to it."""
        client.connect(FAR_SERVER, server.identity.peer_id, net.now)
        ((initial, _),) = client.datagrams_to_send(net.now)
        server.endpoint.receive_datagram(initial, address, net.now)
        sent = server.endpoint.datagrams_to_send(net.now)
        return initial, [data for data, to in sent if to == address]

    forger = Endpoint(Identity.generate(), config)
    for index in range(6):
        initial, answers = first_answer(forger, (f"203.0.113.{index + 1}", 4000))
        if index < 2:
            assert answers and not any(map(_is_retry, answers))
        else:
            ((retry,),) = [answers]
            assert _is_retry(retry) and len(retry) < len(initial) / 4
    assert server.endpoint.connection_count() == 2

    stolen = Endpoint(Identity.generate(), config)
    _, (retry,) = first_answer(stolen, ("198.51.100.8", 1000))
    stolen.receive_datagram(retry, FAR_SERVER, net.now)
    with_token = stolen.datagrams_to_send(net.now)
    assert with_token
    for data, _ in with_token:
        server.endpoint.receive_datagram(data, ("198.51.100.9", 1000), net.now)
    assert server.endpoint.connection_count() == 2
    ((refusal, to),) = server.endpoint.datagrams_to_send(net.now)
    assert to == ("198.51.100.9", 1000) and len(refusal) < len(initial) / 4
    assert not _is_retry(refusal)

    client = Recorder(config)
    net.attach(FAR_CLIENT, client)
    handle = client.endpoint.connect(FAR_SERVER, server.identity.peer_id, net.now)
    assert net.run_until(lambda: handle in client.ready and len(server.ready) == 1)
    assert sum(map(_is_retry, seen)) == 1
    assert server.endpoint.connection_count() == 3

    assert net.run_until(lambda: server.endpoint.connection_count() == 1, max_time_s=30)
    seen.clear()
    late = Recorder(config)
    net.attach(("198.51.100.10", 1000), late)
    again = late.endpoint.connect(FAR_SERVER, server.identity.peer_id, net.now)
    assert net.run_until(lambda: again in late.ready)
    assert not any(map(_is_retry, seen))


def test_loopback_handshakes_are_never_asked_to_prove_their_address() -> None:
    """With every handshake asked to prove its address (``max_unproven_handshakes=0``), a
    loopback client gets in without a Retry, and one on another host after one."""
    config = TransportConfig(keepalive_interval_s=None, max_unproven_handshakes=0)
    for far in (False, True):
        seen: list[bytes] = []
        net, client, server = make_pair(config, pipe=Pipe(drop=_tap(seen)), far=far)
        handshake(net, client, server, FAR_SERVER if far else SERVER)
        assert sum(map(_is_retry, seen)) == (1 if far else 0)


def test_a_token_sealed_before_a_restart_is_refused_at_once() -> None:
    """A client whose Retry token the node cannot validate (it restarted in between, with a new
    key) is told so at once (INVALID_TOKEN), instead of waiting out its connect timeout; its
    next dial gets in."""
    config = TransportConfig(
        keepalive_interval_s=None, max_unproven_handshakes=0, connect_timeout_s=5.0
    )
    net = MemoryNetwork(random.Random(0), default=Pipe())
    client, server = Recorder(config), Recorder(config)
    net.attach(FAR_CLIENT, client)
    handle = client.endpoint.connect(FAR_SERVER, server.identity.peer_id, net.now)
    ((initial, _),) = client.endpoint.datagrams_to_send(net.now)
    before = Endpoint(server.identity, config)  # the node before it restarted
    before.receive_datagram(initial, FAR_CLIENT, net.now)
    ((retry, _),) = before.datagrams_to_send(net.now)
    assert _is_retry(retry)
    client.receive_datagram(retry, FAR_SERVER, net.now)
    net.attach(FAR_SERVER, server)
    assert net.run_until(lambda: handle in client.lost, max_time_s=30)
    assert net.now < 1.0
    error = client.lost[handle].error
    assert isinstance(error, ConnectionClosed) and "token" in str(error)
    again = client.endpoint.connect(FAR_SERVER, server.identity.peer_id, net.now)
    assert net.run_until(lambda: again in client.ready, max_time_s=30)


def test_closes_for_tokens_that_do_not_validate_are_at_most_64_a_second() -> None:
    """Each close for a token that does not validate costs the node some work (Initial keys, a
    sealed packet): a flood of such Initials gets 64 a second, the rest are ignored."""
    config = TransportConfig(keepalive_interval_s=None, max_unproven_handshakes=0)
    server = Endpoint(Identity.generate(), config)
    client = Endpoint(Identity.generate(), config)
    client.connect(FAR_SERVER, server.identity.peer_id, 0.0)
    ((initial, _),) = client.datagrams_to_send(0.0)
    server.receive_datagram(initial, FAR_CLIENT, 0.0)
    ((retry, _),) = server.datagrams_to_send(0.0)
    client.receive_datagram(retry, FAR_SERVER, 0.0)
    ((with_token, _),) = client.datagrams_to_send(0.0)

    def refusals(now: float) -> int:
        for index in range(100):  # the token is FAR_CLIENT's: from elsewhere it does not validate
            server.receive_datagram(with_token, (f"198.51.100.{index + 1}", 1000), now)
        return len(server.datagrams_to_send(now))

    assert refusals(0.5) == 64
    assert refusals(0.9) == 0
    assert refusals(1.0) == 64
    assert server.connection_count() == 0
