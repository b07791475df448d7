"""Loopback DHT swarms for the node tests: a hand-driven wall clock and nodes joined through one."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from petals_core.dht import SPEED_TEST, DHTNode, open_dht_node
from petals_core.dht._speed_test import _SPEED_TESTS_AT_ONCE
from petals_core.transport import Connection, Multiaddr, open_call


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


@asynccontextmanager
async def holding_speed_tests(address: Multiaddr) -> AsyncIterator[None]:
    """Uploads to the node at ``address`` that start and send nothing, holding every one of its
    speed test slots until the block ends."""
    async with (
        open_dht_node(host="127.0.0.1", client_mode=True) as caller,
        trio.open_nursery() as nursery,
    ):
        connection = await caller.node.connect(address)
        for _ in range(_SPEED_TESTS_AT_ONCE):
            await nursery.start(_hold_upload, connection)
        yield
        nursery.cancel_scope.cancel()


async def _hold_upload(connection: Connection, task_status: trio.TaskStatus[None]) -> None:
    async with open_call(connection, SPEED_TEST) as call:
        await call.send({"upload": 10})
        assert await call.receive() == {"ready": True}
        task_status.started()
        await trio.sleep_forever()
