"""A DHT node's upkeep over real QUIC on loopback: bucket refresh, expiry sweeps, the hand-off of
records to nodes that join and republishing after a holder leaves."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from petals_core._errors import ConfigError
from petals_core.dht import NodeID, xor_distance
from petals_core.dht._node import open_dht_node
from petals_core.transport import Identity

from ._swarm import FakeClock, holds, nodes, wait_rounds, wait_until

DEADLINE_S = 60


async def test_refresh_teaches_an_early_client_the_peers_that_joined_after_it() -> None:
    # Client-mode nodes are never queried, so only their own lookups teach them about peers: the
    # one that refreshes learns the nodes that joined after it, the one that does not stays put.
    with trio.fail_after(DEADLINE_S):
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(open_dht_node(request_timeout_s=2))
            entry = [str(first.listen_multiaddr)]
            refreshing = await stack.enter_async_context(
                open_dht_node(initial_peers=entry, client_mode=True, refresh_interval_s=0.2)
            )
            idle = await stack.enter_async_context(
                open_dht_node(initial_peers=entry, client_mode=True, refresh_interval_s=None)
            )
            assert len(refreshing.routing_table) == len(idle.routing_table) == 1
            later = [
                await stack.enter_async_context(
                    open_dht_node(initial_peers=entry, request_timeout_s=2)
                )
                for _ in range(4)
            ]
            await wait_rounds(lambda: refreshing.statistics().refresh_rounds, 3)
            for node in later:
                assert NodeID.from_peer_id(node.peer_id) in refreshing.routing_table
            assert len(idle.routing_table) == 1
            assert refreshing.statistics().refresh_rounds >= 3
            assert idle.statistics().refresh_rounds == 0


async def test_expired_records_are_swept_without_being_asked_for() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node(clock=clock, expire_interval_s=0.05) as dht:
            await dht.store("soon.gone", b"v", clock.now + 10)
            assert dht.statistics().records.keys == 1
            clock.now += 20
            await wait_rounds(lambda: dht.statistics().expire_rounds)
            assert dht.statistics().records.keys == 0
            assert dht.statistics().expire_rounds >= 1


async def test_maintenance_intervals_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="refresh_interval_s"):
        async with open_dht_node(refresh_interval_s=0):
            pytest.fail("should not start")


async def test_a_node_joining_nearer_a_key_is_handed_its_records() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(3, replicas=5) as (swarm, stack):
            assert await swarm[1].store("handed", b"value", time.time() + 600) == 2
            newcomer = await stack.enter_async_context(
                open_dht_node(initial_peers=[str(swarm[0].listen_multiaddr)], request_timeout_s=2)
            )
            # With fewer than `replicas` nodes, every node is among the nearest: each holder
            # hands the record over when the newcomer enters its table.
            await wait_until(lambda: holds(swarm[0], newcomer, "handed"))
            assert sum(node.statistics().records_handed_off for node in swarm) >= 1
            value = await newcomer.get("handed")
            assert value is not None and value.entries[None].value == b"value"


async def test_records_are_republished_to_the_new_nearest_node_after_a_holder_leaves() -> None:
    key = "republished"
    key_id = NodeID.from_key(key)
    identities = sorted(
        (Identity.generate() for _ in range(4)),
        key=lambda i: xor_distance(NodeID.from_peer_id(i.peer_id), key_id),
    )
    leaving, staying = identities[0], identities[1:]  # the nearest to the key leaves
    options: dict[str, Any] = {"request_timeout_s": 2, "replicas": 1, "republish_interval_s": 0.2}
    with trio.fail_after(DEADLINE_S):
        async with AsyncExitStack() as stack:
            owner = await stack.enter_async_context(open_dht_node(**options))
            entry = [str(owner.listen_multiaddr)]
            others = [
                await stack.enter_async_context(
                    open_dht_node(identity=identity, initial_peers=entry, **options)
                )
                for identity in staying
            ]
            runner_up = others[0]
            async with open_dht_node(identity=leaving, initial_peers=entry, **options) as nearest:
                await wait_rounds(lambda: owner.statistics().republish_rounds)
                assert await owner.store(key, b"v", time.time() + 600) == 1
                assert await holds(owner, nearest, key)
                assert not await holds(owner, runner_up, key)
            # The only remote holder left: the owner's republishing finds the next nearest.
            await wait_rounds(lambda: owner.statistics().republish_rounds, 2)
            assert await holds(owner, runner_up, key)
            value = await runner_up.get(key)
            assert value is not None and value.entries[None].value == b"v"
