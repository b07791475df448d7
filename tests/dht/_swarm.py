"""Loopback DHT swarms for the node tests: a hand-driven wall clock, nodes joined through one, and
waits for what other tasks and nodes do (rounds of a node's maintenance among them)."""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

from petals_core.dht import SPEED_TEST, DHTNode, open_dht_node
from petals_core.dht._speed_test import _SPEED_TESTS_AT_ONCE
from petals_core.transport import Connection, Multiaddr, call_unary, open_call


class FakeClock:
    """Wall time that tests advance by hand, so that records expire without waiting."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def wait_until(predicate: Callable[[], Any]) -> None:
    """Check ``predicate`` (maybe async: a question to another node) until it holds; callers
    bound this with a trio deadline.  What it waits for happens in other tasks or on other
    nodes, with no event to wait on here."""
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        await trio.sleep(0.01)


async def wait_rounds(count: Callable[[], int], n: int = 1) -> None:
    """Wait until ``count`` (a round counter of a node's statistics, e.g.
    ``lambda: node.statistics().refresh_rounds``) has grown by ``n``; callers bound this with a
    trio deadline."""
    target = count() + n
    await wait_until(lambda: count() >= target)


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
async def nodes(n: int, **options: Any) -> AsyncIterator[tuple[list[DHTNode], AsyncExitStack]]:
    """``n`` serving nodes on the real clock, joined through the first."""
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(open_dht_node(request_timeout_s=2, **options))
        found = [first]
        for _ in range(n - 1):
            found.append(
                await stack.enter_async_context(
                    open_dht_node(
                        initial_peers=[str(first.listen_multiaddr)], request_timeout_s=2, **options
                    )
                )
            )
        yield found, stack


async def holds(asker: DHTNode, holder: DHTNode, key: str) -> bool:
    """Whether ``holder`` has ``key`` in its own store (asked over the wire)."""
    connection = await asker.node.connect(holder.listen_multiaddr)
    reply = await call_unary(connection, "dht.find_value", {"client": True, "key": key})
    return bool(reply["records"])


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
