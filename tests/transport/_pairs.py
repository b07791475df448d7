"""Two sans-IO endpoints in memory with a virtual clock, recording what their applications see."""

from __future__ import annotations

import hashlib
import random

from petals_core.testing import MemoryNetwork, Pipe
from petals_core.transport._config import TransportConfig
from petals_core.transport._endpoint import (
    ConnectionLost,
    ConnectionReady,
    Endpoint,
    StreamData,
    StreamReset,
)
from petals_core.transport._identity import Identity

CLIENT = ("127.0.0.1", 1000)
SERVER = ("127.0.0.1", 2000)
#: Hosts on other machines (documentation range, in memory only): connections between them search
#: datagram sizes up to ``TransportConfig.max_datagram_bytes``, not up to loopback's.
FAR_CLIENT = ("192.0.2.1", 1000)
FAR_SERVER = ("192.0.2.2", 2000)


class Recorder:
    """An endpoint plus what its application saw, consuming stream data as it arrives."""

    def __init__(self, config: TransportConfig, *, consume: bool = True) -> None:
        self.identity = Identity.generate()
        self.endpoint = Endpoint(self.identity, config)
        self.consume = consume
        self.ready: dict[int, ConnectionReady] = {}
        self.lost: dict[int, ConnectionLost] = {}
        self.received: dict[tuple[int, int], bytearray] = {}
        self.finished: set[tuple[int, int]] = set()
        self.resets: list[StreamReset] = []
        self.now = 0.0
        #: When each datagram this endpoint produced left.
        self.sent_at: list[float] = []
        #: How often the network ran this endpoint's timers (each time one was due).
        self.timer_runs = 0

    # Endpoint protocol for MemoryNetwork, collecting events as they appear.
    def receive_datagram(self, data: bytes, address: tuple[str, int], now: float) -> None:
        self.now = now
        self.endpoint.receive_datagram(data, address, now)
        self._events(now)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, tuple[str, int]]]:
        out = self.endpoint.datagrams_to_send(now)
        self.sent_at += [now] * len(out)
        self._events(now)
        return out

    def next_timer(self) -> float | None:
        return self.endpoint.next_timer()

    def handle_timers(self, now: float) -> None:
        self.now = now
        self.timer_runs += 1
        self.endpoint.handle_timers(now)
        self._events(now)

    def _events(self, now: float) -> None:
        for event in self.endpoint.events():
            if isinstance(event, ConnectionReady):
                self.ready[event.handle] = event
            elif isinstance(event, ConnectionLost):
                self.lost[event.handle] = event
            elif isinstance(event, StreamData):
                key = (event.handle, event.stream_id)
                self.endpoint.adopt_stream(event.handle, event.stream_id)
                self.received.setdefault(key, bytearray()).extend(event.data)
                if event.end_stream:
                    self.finished.add(key)
                if self.consume and event.data:
                    self.endpoint.consume(event.handle, event.stream_id, len(event.data), now)
            elif isinstance(event, StreamReset):
                self.resets.append(event)


def make_pair(
    config: TransportConfig | None = None,
    *,
    pipe: Pipe | None = None,
    seed: int = 0,
    far: bool = False,
    server_type: type[Recorder] = Recorder,
) -> tuple[MemoryNetwork, Recorder, Recorder]:
    """A client and a server in memory, on loopback or (``far``) on two other hosts."""
    config = config or TransportConfig(keepalive_interval_s=None)
    net = MemoryNetwork(random.Random(seed), default=pipe or Pipe())
    client, server = Recorder(config), server_type(config)
    net.attach(FAR_CLIENT if far else CLIENT, client)
    net.attach(FAR_SERVER if far else SERVER, server)
    return net, client, server


def handshake(
    net: MemoryNetwork, client: Recorder, server: Recorder, address: tuple[str, int] = SERVER
) -> int:
    handle = client.endpoint.connect(address, server.identity.peer_id, net.now)
    assert net.run_until(lambda: handle in client.ready and len(server.ready) == 1)
    return handle


def transfer(
    net: MemoryNetwork,
    client: Recorder,
    server: Recorder,
    handle: int,
    size: int,
    *,
    seed: int | None = None,
) -> float:
    """Send ``size`` random bytes (of ``seed``, by default ``size``) on a new stream and wait
    until the server has them all, intact; how long it took (virtual seconds)."""
    data = random.Random(size if seed is None else seed).randbytes(size)
    stream_id = client.endpoint.open_stream(handle)
    start = net.now
    client.endpoint.send_stream_data(handle, stream_id, data, net.now, end_stream=True)
    (server_handle,) = server.ready
    key = (server_handle, stream_id)
    assert net.run_until(lambda: key in server.finished, max_time_s=120)
    took = net.now - start
    assert hashlib.sha256(server.received[key]).digest() == hashlib.sha256(data).digest()
    return took
