"""Server announcements over a loopback swarm: announce, read back, go offline, forge, expire."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from petals_core.dht._node import DHTNode
from petals_core.dht._records import Record, ServerInfo, ServerState, encode_record
from petals_core.transport import Identity, call_unary, open_node

from ._swarm import FakeClock, swarm as shared_swarm

DEADLINE_S = 60
PREFIX = "test-model"


@asynccontextmanager
async def swarm(clock: FakeClock, n: int = 6) -> AsyncIterator[tuple[list[DHTNode], DHTNode]]:
    """``n`` serving nodes and a client-mode node, all joined through the first."""
    async with shared_swarm(clock, n, with_client=True) as (nodes, client):
        assert client is not None
        yield nodes, client


def server_info(start: int, end: int, **changes: Any) -> ServerInfo:
    info = ServerInfo(
        state=ServerState.ONLINE,
        throughput=12.5,
        start_block=start,
        end_block=end,
        version="1.2.3",
        torch_dtype="bfloat16",
        quant_type="nf4",
        public_name=f"server-{start}-{end}",
        inference_rps=3.0,
        forward_rps=40.0,
        adapters=("lora-a",),
        cache_tokens_left=8192,
        next_pings={str(Identity.generate().peer_id): 0.015},
    )
    return attrs.evolve(info, **changes)


async def test_announcements_are_read_back_per_block_and_go_offline_and_expire() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with swarm(clock) as (nodes, client):
            a, b = nodes[1], nodes[2]
            info_a, info_b = server_info(0, 4), server_info(2, 6, throughput=7.0)
            assert await a.announce(PREFIX, info_a, expiration=clock.now + 60) == 4
            assert await b.announce(PREFIX, info_b, expiration=clock.now + 30) == 4

            first = await client.get_servers(PREFIX, range(6))
            expected = {0: {a}, 1: {a}, 2: {a, b}, 3: {a, b}, 4: {b}, 5: {b}}
            for block, servers in expected.items():
                assert set(first.servers_for(block)) == {str(node.peer_id) for node in servers}
            assert first.servers_for(0)[str(a.peer_id)] == info_a
            assert first.servers_for(5)[str(b.peer_id)] == info_b
            assert first.prefix == PREFIX

            # A newer announcement (it expires later) saying OFFLINE takes A out.
            offline = attrs.evolve(info_a, state=ServerState.OFFLINE)
            assert await a.announce(PREFIX, offline, expiration=clock.now + 90) == 4
            second = await client.get_servers(PREFIX, range(6))
            assert second.version > first.version
            assert str(a.peer_id) not in second.peer_ids
            assert set(second.servers_for(2)) == {str(b.peer_id)}
            assert second.servers_for(0) == {}

            # B's announcements expire.
            clock.now += 45
            third = await nodes[4].get_servers(PREFIX, range(6))
            assert third.peer_ids == frozenset()


async def test_forged_announcements_are_refused_everywhere() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with swarm(clock) as (nodes, client), open_node() as raw:
            a, forger = nodes[1], nodes[2]
            genuine = server_info(0, 2)
            assert await a.announce(PREFIX, genuine, expiration=clock.now + 60) == 2
            forged_value = server_info(0, 2, public_name="forged").to_bytes()
            key = f"{PREFIX}.0"

            # Unsigned, under A's PeerID, through the node API.
            accepted = await forger.store(key, forged_value, clock.now + 120, subkey=str(a.peer_id))
            assert accepted == 0

            # Signed by another identity but filed under A's PeerID, pushed to every node.
            signed_by_other = Record.signed(Identity.generate(), key, forged_value, clock.now + 120)
            forged = attrs.evolve(signed_by_other, subkey=str(a.peer_id))
            for node in nodes:
                connection = await raw.connect(node.listen_multiaddr)
                reply = await call_unary(
                    connection, "dht.store", {"client": True, "records": [encode_record(forged)]}
                )
                assert reply["results"][0].startswith("wrong signer")

            snapshot = await client.get_servers(PREFIX, [0, 1])
            assert snapshot.servers_for(0) == {str(a.peer_id): genuine}
            assert snapshot.servers_for(1) == {str(a.peer_id): genuine}
