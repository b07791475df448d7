"""Loopback DHT swarms for the node tests: a hand-driven wall clock and nodes joined through one."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

from petals_core.dht import DHTNode, open_dht_node


class FakeClock:
    """Wall time that tests advance by hand, so that records expire without waiting."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def swarm(
    clock: FakeClock, n: int, *, with_client: bool = False
) -> AsyncIterator[tuple[list[DHTNode], DHTNode | None]]:
    """``n`` serving nodes (and a client-mode node if asked), all joined through the first."""
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(open_dht_node(clock=clock, request_timeout_s=2))
        entry = [str(first.listen_multiaddr)]
        nodes = [first]
        for _ in range(n - 1):
            nodes.append(
                await stack.enter_async_context(
                    open_dht_node(initial_peers=entry, clock=clock, request_timeout_s=2)
                )
            )
        client = None
        if with_client:
            client = await stack.enter_async_context(
                open_dht_node(
                    initial_peers=entry, client_mode=True, clock=clock, request_timeout_s=2
                )
            )
        yield nodes, client
