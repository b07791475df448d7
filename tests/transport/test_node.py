"""The trio node on loopback: its statistics, and exchanges that never wait for a timer.

The timer tests run on a clock of their own: virtual time moves a microsecond each time something
reads it (work takes time, so the pacer's budget refills as it would), never with the real clock,
and jumps to the next timer only when nothing at all can happen for a whole real second (trio's
autojump).  However slow or busy the machine (short of stalling for a second with a datagram in
flight), a timer falls due only where the exchange waits for one, so counting timer wake-ups is
deterministic.
"""

from __future__ import annotations

import math
import random
import socket
import time
from functools import partial

import attrs
import pytest
import trio
import trio.testing

from petals_core import PeerUnreachable
from petals_core.testing import DelayRelay, Pipe
from petals_core.transport import (
    Handlers,
    Multiaddr,
    NodeStatistics,
    ServerCall,
    Stream,
    TransportConfig,
    call_unary,
    open_node,
    serve_rpc,
)

ROUNDS = 100
MESSAGE = bytes(range(64))


class TickingClock(trio.abc.Clock):
    """Virtual time that advances by ``tick_s`` at every reading, and jumps to the next deadline
    when the run loop found nothing to do for ``idle_s`` of real time (as trio's autojump does)."""

    def __init__(self, *, tick_s: float = 1e-6, idle_s: float = 1.0) -> None:
        self.tick_s = tick_s
        self.idle_s = idle_s
        # Well past 0, where aioquic's pacer starts counting its budget from.
        self._now = 100.0
        self._idle: tuple[float, float] | None = None

    def start_clock(self) -> None:
        self._idle = None

    def current_time(self) -> float:
        if self._idle is not None:
            deadline, since = self._idle
            self._idle = None
            if time.perf_counter() - since >= self.idle_s:
                self._now = max(self._now, deadline)
        self._now += self.tick_s
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        if deadline <= self._now:
            return 0.0
        if math.isfinite(deadline):
            self._idle = (deadline, time.perf_counter())
        return self.idle_s


@pytest.fixture
def ticking_clock() -> TickingClock:
    return TickingClock()


def _delta(after: NodeStatistics, before: NodeStatistics) -> dict[str, int]:
    return {
        name: value - getattr(before, name)
        for name, value in attrs.asdict(after).items()
        if type(value) is int
    }


async def _echo(stream: Stream) -> None:
    async with stream:
        while data := await stream.receive_some():
            await stream.send_all(data)
        await stream.send_eof()


async def _exchange(stream: Stream) -> None:
    await stream.send_all(MESSAGE)
    got = b""
    while len(got) < len(MESSAGE):
        got += await stream.receive_some()
    assert got == MESSAGE


async def test_round_trips_on_a_reused_stream_wait_for_no_timer(
    ticking_clock: TickingClock,
) -> None:
    async with open_node() as server, open_node() as client, trio.open_nursery() as nursery:
        server.set_stream_handler(lambda stream: nursery.start_soon(_echo, stream))
        connection = await client.connect(server.listen_multiaddr)
        stream = await connection.open_stream()
        for _ in range(10):
            await _exchange(stream)
        before = client.statistics(), server.statistics()
        for _ in range(ROUNDS):
            await _exchange(stream)
        after = client.statistics(), server.statistics()
        for node_after, node_before in zip(after, before, strict=True):
            delta = _delta(node_after, node_before)
            assert delta["timer_wakeups"] == 0
            # One datagram each way per round trip: each carries the ACK of the one before.
            assert delta["datagrams_sent"] == ROUNDS
            assert delta["datagrams_received"] == ROUNDS
            assert delta["pump_wakeups"] == ROUNDS
        await stream.aclose()
        nursery.cancel_scope.cancel()


async def test_unary_calls_wait_for_no_timer(ticking_clock: TickingClock) -> None:
    handlers = Handlers()

    @handlers.unary("ping")
    async def ping(request: dict[str, bytes], call: ServerCall) -> dict[str, bytes]:
        return request

    async with open_node() as server, open_node() as client, trio.open_nursery() as nursery:
        await nursery.start(serve_rpc, server, handlers)
        connection = await client.connect(server.listen_multiaddr)
        for _ in range(10):
            await call_unary(connection, "ping", {"p": MESSAGE})
        before = client.statistics(), server.statistics()
        for _ in range(ROUNDS):
            assert await call_unary(connection, "ping", {"p": MESSAGE}) == {"p": MESSAGE}
        after = client.statistics(), server.statistics()
        client_delta, server_delta = (
            _delta(node_after, node_before)
            for node_after, node_before in zip(after, before, strict=True)
        )
        assert client_delta["timer_wakeups"] == server_delta["timer_wakeups"] == 0
        # The call and its reply each leave in one datagram.
        assert client_delta["datagrams_sent"] == ROUNDS
        assert ROUNDS <= server_delta["datagrams_sent"] <= ROUNDS + ROUNDS // 10
        nursery.cancel_scope.cancel()


async def test_a_quiet_connection_wakes_its_pump_by_timer(ticking_clock: TickingClock) -> None:
    # No path probing either: the keep-alive is all there is to do.
    config = TransportConfig(keepalive_interval_s=5.0, path_mtu_discovery=False)
    async with open_node(config=config) as server, open_node(config=config) as client:
        await client.connect(server.listen_multiaddr)
        before = client.statistics()
        # Nothing to do but the keep-alive: the clock jumps to it.
        with trio.move_on_after(6.0):
            await trio.sleep_forever()
        delta = _delta(client.statistics(), before)
        assert delta["timer_wakeups"] >= 1
        assert delta["datagrams_sent"] >= 1


async def test_statistics_count_calls_datagrams_and_bytes() -> None:
    with trio.fail_after(60):
        for offload in (False, True):
            config = TransportConfig(udp_offload=offload)
            async with (
                open_node(config=config) as server,
                open_node(config=config) as client,
                trio.open_nursery() as nursery,
            ):
                server.set_stream_handler(lambda stream: nursery.start_soon(_echo, stream))
                connection = await client.connect(server.listen_multiaddr)
                stream = await connection.open_stream()
                payload = bytes(range(256)) * 4096
                await stream.send_all(payload, eof=True)
                echoed = b""
                while data := await stream.receive_some():
                    echoed += data
                assert echoed == payload
                _check_consistent(client.statistics(), offload=offload)
                _check_consistent(server.statistics(), offload=offload)
                assert client.statistics().bytes_sent > len(payload)
                await stream.aclose()
                nursery.cancel_scope.cancel()


def _check_consistent(statistics: NodeStatistics, *, offload: bool) -> None:
    assert statistics.connections == 1
    assert 0 < statistics.send_calls <= statistics.datagrams_sent
    assert 0 < statistics.receive_calls <= statistics.datagrams_received
    assert statistics.bytes_sent >= statistics.datagrams_sent
    assert statistics.bytes_received >= statistics.datagrams_received
    assert 0 <= statistics.timer_wakeups <= statistics.pump_wakeups
    # Each wake-up's reading ends with a receive that finds the socket empty (or its batch full).
    assert statistics.empty_receives <= statistics.pump_wakeups
    if not offload:
        assert not statistics.segmentation_offload
        assert not statistics.receive_offload
        assert statistics.send_calls == statistics.datagrams_sent
        assert statistics.receive_calls == statistics.datagrams_received


async def test_dns_multiaddrs_are_resolved_when_dialled() -> None:
    async with open_node() as server, open_node() as client:
        listen = server.listen_multiaddr
        by_name = Multiaddr("localhost", listen.port, listen.peer_id, dns="dns4")
        with trio.fail_after(30):
            connection = await client.connect(str(by_name))
        assert connection.peer_id == server.peer_id
        unknown = Multiaddr("no-such-host.invalid", listen.port, dns="dns4")
        with pytest.raises(PeerUnreachable, match=r"cannot resolve 'no-such-host\.invalid'"):
            with trio.fail_after(30):
                await client.connect(unknown)


async def test_data_queued_by_tasks_woken_together_leaves_in_one_packet() -> None:
    """Eight tasks woken by the same event each send a small message on a stream of their own:
    the flush waits for all of them, so the messages share one datagram."""
    streams_count = 8
    with trio.fail_after(60):
        config = TransportConfig(udp_offload=False)
        async with (
            open_node(config=config) as server,
            open_node(config=config) as client,
            trio.open_nursery() as nursery,
        ):
            received = 0
            got_all = trio.Event()
            expected = streams_count * len(MESSAGE)

            async def sink(stream: Stream) -> None:
                nonlocal received
                while data := await stream.receive_some():
                    received += len(data)
                    if received == expected:
                        got_all.set()

            server.set_stream_handler(lambda stream: nursery.start_soon(sink, stream))
            connection = await client.connect(server.listen_multiaddr)
            streams = [await connection.open_stream() for _ in range(streams_count)]
            for stream in streams:  # every stream open on both sides
                await stream.send_all(MESSAGE)
            await got_all.wait()
            await trio.testing.wait_all_tasks_blocked()
            received, got_all = 0, trio.Event()
            go = trio.Event()

            async def send_when_told(stream: Stream) -> None:
                await go.wait()
                await stream.send_all(MESSAGE)

            before = client.statistics().datagrams_sent
            async with trio.open_nursery() as senders:
                for stream in streams:
                    senders.start_soon(send_when_told, stream)
                await trio.testing.wait_all_tasks_blocked()
                go.set()
            await got_all.wait()
            assert client.statistics().datagrams_sent - before == 1
            nursery.cancel_scope.cancel()


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_lossy_path_gets_repairs_and_lost_datagrams_are_rebuilt() -> None:
    """Two nodes through a relay that loses 0.5% of the datagrams each way at random (below the
    2% that counts as congestion, where repairs stop), 1452-byte datagrams at most, as a real
    path: once each side has seen a loss, its datagrams carry repairs, and the other side
    rebuilds lost ones from them."""
    server_port = _free_udp_port()
    with DelayRelay([server_port], seed=3) as relay, trio.fail_after(60):
        relay.set_link(Pipe(latency_s=0.002, loss=0.005, max_payload=1452))
        async with (
            open_node(port=server_port) as server,
            open_node() as client,
            trio.open_nursery() as nursery,
        ):
            server.set_stream_handler(lambda stream: nursery.start_soon(_echo, stream))
            listen = server.listen_multiaddr
            through = Multiaddr(relay.host, relay.ports[0], listen.peer_id)
            connection = await client.connect(str(through))
            payload = random.Random(0).randbytes(4 << 20)
            stream = await connection.open_stream()
            async with trio.open_nursery() as echo:
                echo.start_soon(partial(stream.send_all, payload, eof=True))
                echoed = bytearray()
                while data := await stream.receive_some():
                    echoed += data
            assert echoed == payload
            for sender, receiver in ((client, server), (server, client)):
                assert sender.statistics().repairs_sent > 0
                assert receiver.statistics().datagrams_rebuilt > 0
            nursery.cancel_scope.cancel()
        assert relay.stats().dropped > 0
