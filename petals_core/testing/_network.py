"""An in-memory datagram network with a virtual clock, for sans-IO endpoints.

Endpoints are attached at addresses; :meth:`MemoryNetwork.run_until` moves datagrams between them
after each link's latency, dropping and reordering some according to each :class:`Pipe`, and fires
their timers as virtual time passes.  Everything is deterministic for a given ``random.Random``.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from typing import Protocol

import attrs

Address = tuple[str, int]


class DatagramEndpoint(Protocol):
    def receive_datagram(self, data: bytes, address: Address, now: float) -> None: ...

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]: ...

    def next_timer(self) -> float | None: ...

    def handle_timers(self, now: float) -> None: ...


@attrs.frozen(kw_only=True)
class Pipe:
    """How a link behaves: one-way latency, loss probability, and reordering jitter."""

    latency_s: float = 0.0005
    loss: float = 0.0
    jitter_s: float = 0.0
    #: Predicate over (datagram index on this network, payload) to drop specific datagrams.
    drop: Callable[[int, bytes], bool] | None = None
    #: Datagrams with a larger payload are dropped, as a path with a smaller MTU drops
    #: "don't fragment" packets; None: any size passes.
    max_payload: int | None = None


class MemoryNetwork:
    """Datagrams and time for a set of endpoints, in one thread, with no sockets."""

    def __init__(self, rng: random.Random | None = None, *, default: Pipe | None = None) -> None:
        self.rng = rng if rng is not None else random.Random(0)
        self.default = default if default is not None else Pipe()
        self.now = 0.0
        self._endpoints: dict[Address, DatagramEndpoint] = {}
        self._pipes: dict[tuple[Address, Address], Pipe] = {}
        self._in_flight: list[tuple[float, int, Address, Address, bytes]] = []
        self._order = itertools.count()
        self.sent = 0
        self.dropped = 0

    def attach(self, address: Address, endpoint: DatagramEndpoint) -> None:
        self._endpoints[address] = endpoint

    def detach(self, address: Address) -> None:
        """The endpoint vanishes: datagrams to it are lost from now on."""
        self._endpoints.pop(address, None)

    def set_pipe(self, source: Address, destination: Address, pipe: Pipe) -> None:
        self._pipes[(source, destination)] = pipe

    def _collect(self) -> None:
        for source, endpoint in list(self._endpoints.items()):
            for data, destination in endpoint.datagrams_to_send(self.now):
                index = self.sent
                self.sent += 1
                pipe = self._pipes.get((source, destination), self.default)
                if (
                    (pipe.drop is not None and pipe.drop(index, data))
                    or (pipe.max_payload is not None and len(data) > pipe.max_payload)
                    or (pipe.loss and self.rng.random() < pipe.loss)
                ):
                    self.dropped += 1
                    continue
                delay = pipe.latency_s + (self.rng.random() * pipe.jitter_s if pipe.jitter_s else 0)
                heapq.heappush(
                    self._in_flight,
                    (self.now + delay, next(self._order), source, destination, data),
                )

    def step(self, *, until: float | None = None) -> bool:
        """Advance to the next delivery or timer and process it; False when nothing is pending
        (or, with ``until``, nothing before that time: then the clock stops at ``until``)."""
        self._collect()
        next_delivery = self._in_flight[0][0] if self._in_flight else None
        timers = [t for e in self._endpoints.values() if (t := e.next_timer()) is not None]
        next_timer = min(timers) if timers else None
        # Timers fire a microsecond late, as a real clock would: aioquic computes a loss deadline
        # as ``sent + delay`` and then checks ``sent <= now - delay``, which float rounding can
        # keep false at exactly ``now == deadline``.
        if next_timer is not None:
            next_timer += 1e-6
        candidates = [t for t in (next_delivery, next_timer) if t is not None]
        if not candidates or (until is not None and min(candidates) > until):
            if until is not None:
                self.now = max(self.now, until)
            return False
        self.now = max(self.now, min(candidates))
        while self._in_flight and self._in_flight[0][0] <= self.now:
            _, _, source, destination, data = heapq.heappop(self._in_flight)
            endpoint = self._endpoints.get(destination)
            if endpoint is not None:
                endpoint.receive_datagram(data, source, self.now)
        for endpoint in list(self._endpoints.values()):
            timer = endpoint.next_timer()
            if timer is not None and timer <= self.now:
                endpoint.handle_timers(self.now)
        self._collect()
        return True

    def run_until(
        self, condition: Callable[[], bool], *, max_time_s: float = 60.0, max_steps: int = 200_000
    ) -> bool:
        """Step until ``condition()`` holds (True), or virtual time passes ``max_time_s``, or
        ``max_steps`` steps were taken, or nothing is left to do (then whatever it says)."""
        deadline = self.now + max_time_s
        for _ in range(max_steps):
            if condition():
                return True
            if not self.step(until=deadline):
                break
        return condition()
