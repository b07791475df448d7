"""Following a model over a loopback swarm: gossip beside the DHT, and caching of found values on
the lookup path."""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
import trio

from petals_core._errors import ConfigError
from petals_core.dht import NodeID, ServerState, xor_distance
from petals_core.dht._node import DHTNode, open_dht_node
from petals_core.dht._records import Record, ServerInfo, encode_record
from petals_core.dht._serving import DHTService
from petals_core.transport import Identity, RemoteError, call_unary, open_node

from ._swarm import holds, nodes, wait_until
from .test_announce import server_info

DEADLINE_S = 60
PREFIX = "topic-model"
BLOCKS = 6
#: So long that, after the first read, only gossip can bring news within a test.
NEVER_S = 3600.0


def announced(node: DHTNode, start: int, end: int, **changes: Any) -> ServerInfo:
    return server_info(start, end, addresses=(str(node.listen_multiaddr),), **changes)


async def test_gossip_brings_a_new_server_to_a_client_long_before_the_next_dht_read() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(4) as (swarm, stack):
            s1, s2, s3 = swarm[1], swarm[2], swarm[3]
            expiration = time.time() + 600
            for server, span in [(s1, (0, 3)), (s2, (3, 6))]:
                topic = server.follow(PREFIX, BLOCKS, update_period_s=NEVER_S)
                await server.announce(PREFIX, announced(server, *span), expiration=expiration)
            client = await stack.enter_async_context(
                open_dht_node(
                    initial_peers=[str(swarm[0].listen_multiaddr)],
                    client_mode=True,
                    request_timeout_s=2,
                )
            )
            watched = client.follow(PREFIX, BLOCKS, update_period_s=NEVER_S, gossip_interval_s=0.2)
            first = await watched.wait_snapshot(lambda s: len(s.peer_ids) == 2)
            # The table fills as nodes answer; the read ends once all the nearest have.
            await wait_until(lambda: watched.refreshes == 1)
            assert watched.gossip.peers == {str(s1.peer_id), str(s2.peer_id)}

            # S3 reads the table (learning S1 and S2), then announces: pushed to them at once,
            # and pulled by the client's next digest.
            topic = s3.follow(PREFIX, BLOCKS, update_period_s=NEVER_S)
            await wait_until(lambda: topic.refreshes >= 1)
            info = announced(s3, 2, 6, throughput=99.0)
            await s3.announce(PREFIX, info, expiration=expiration)
            second = await watched.wait_snapshot(lambda s: str(s3.peer_id) in s.peer_ids)
            assert watched.refreshes == 1  # no DHT read since the first: gossip brought it
            assert second.version > first.version
            assert second.servers_for(5)[str(s3.peer_id)] == info
            assert str(s3.peer_id) not in second.servers_for(1)
            assert watched.gossip.statistics().records_new >= BLOCKS - 2

            # Going offline spreads the same way.
            offline = attrs.evolve(info, state=ServerState.OFFLINE)
            await s3.announce(PREFIX, offline, expiration=expiration + 1)
            await watched.wait_snapshot(lambda s: str(s3.peer_id) not in s.peer_ids)
            assert watched.refreshes == 1
            # The other servers heard it too, by push.
            for server in (s1, s2):
                table = server.follow(PREFIX, BLOCKS)
                await table.wait_snapshot(lambda s: str(s3.peer_id) not in s.peer_ids)


async def test_the_table_fills_from_the_first_answers_while_a_read_waits_on_a_slow_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A route can be planned as soon as one node has answered for each block: a node slow to
    answer holds up the end of the DHT read, not what the others' answers brought."""
    slow: set[int] = set()
    answer = trio.Event()
    find_value = DHTService._find_value

    async def slow_find_value(self: DHTService, request: dict[str, Any], call: Any) -> Any:
        if id(self) in slow:
            await answer.wait()
        return await find_value(self, request, call)

    monkeypatch.setattr(DHTService, "_find_value", slow_find_value)
    with trio.fail_after(DEADLINE_S):
        async with nodes(3) as (swarm, stack):
            server, laggard = swarm[1], swarm[2]
            info = announced(server, 0, BLOCKS)
            await server.announce(PREFIX, info, expiration=time.time() + 600)
            for block in range(BLOCKS):
                for holder in (swarm[0], laggard):
                    assert await holds(server, holder, f"{PREFIX}.{block}")
            slow.add(id(laggard._service))
            client = await stack.enter_async_context(
                open_dht_node(
                    initial_peers=[str(swarm[0].listen_multiaddr)],
                    client_mode=True,
                    request_timeout_s=DEADLINE_S,
                )
            )
            watched = client.follow(PREFIX, BLOCKS, update_period_s=NEVER_S)
            # (The answers for the blocks may come in more than one snapshot.)
            await watched.wait_snapshot(
                lambda s: all(str(server.peer_id) in s.servers_for(b) for b in range(BLOCKS))
            )
            assert watched.refreshes == 0  # the read still waits on the slow node
            answer.set()
            await wait_until(lambda: watched.refreshes == 1)


async def test_a_refresh_on_demand_reads_what_gossip_has_not_brought() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(3) as (swarm, _):
            follower, announcer = swarm[1], swarm[2]
            topic = follower.follow(PREFIX, BLOCKS, update_period_s=NEVER_S)
            await wait_until(lambda: topic.refreshes >= 1)
            # Announced in the DHT by a node that follows nothing: no gossip about it.
            await announcer.announce(
                PREFIX, announced(announcer, 0, 3), expiration=time.time() + 600
            )
            peer = str(announcer.peer_id)
            assert topic.address_of(peer) is None
            await topic.refresh(min_interval_s=60.0)
            assert topic.address_of(peer) == announcer.listen_multiaddr
            assert topic.refreshes == 2
            # Asked again at once: skipped; concurrent callers share one read.
            await topic.refresh(min_interval_s=60.0)
            assert topic.refreshes == 2
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(topic.refresh)
            assert topic.refreshes == 3


async def test_bad_gossip_is_refused_and_the_node_keeps_gossiping() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(1) as (swarm, _), open_node() as raw:
            server = swarm[0]
            topic = server.follow(PREFIX, BLOCKS, update_period_s=NEVER_S)
            connection = await raw.connect(server.listen_multiaddr)
            for request in [
                {"client": True, "prefix": "other-model", "kind": "digest", "entries": []},
                {"client": True, "prefix": PREFIX, "kind": "shout"},
                {"client": True, "prefix": PREFIX, "kind": "digest", "entries": [["k", None]]},
                {"client": True, "prefix": PREFIX, "kind": "digest", "entries": [[1, 2, 3]]},
                {"client": True, "prefix": PREFIX, "kind": "push", "ttl": -1, "records": []},
                {"client": True, "prefix": PREFIX, "kind": "push", "ttl": 1, "records": "x"},
                {"client": True, "prefix": PREFIX, "kind": "push", "ttl": 1, "records": [{}]},
            ]:
                with pytest.raises(RemoteError):
                    await call_unary(connection, "dht.gossip", request)
            # A forged announcement (signed by another key, filed under the server's PeerID)
            # is counted as refused and never shows.
            forger = Identity.generate()
            genuine = Record.signed(
                forger, f"{PREFIX}.0", server_info(0, 1).to_bytes(), time.time() + 60
            )
            forged = attrs.evolve(genuine, subkey=str(server.peer_id))
            reply = await call_unary(
                connection,
                "dht.gossip",
                {
                    "client": True,
                    "prefix": PREFIX,
                    "kind": "push",
                    "ttl": 0,
                    "records": [encode_record(forged)],
                },
            )
            assert reply == {"pushes": [], "wants": []}
            assert topic.gossip.statistics().refusals == 1
            assert topic.snapshot().peer_ids == frozenset()
            # A well-formed digest still gets an answer.
            reply = await call_unary(
                connection,
                "dht.gossip",
                {"client": True, "prefix": PREFIX, "kind": "digest", "entries": []},
            )
            assert reply == {"pushes": [], "wants": []}


async def test_following_checks_its_arguments() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(1) as (swarm, _):
            node = swarm[0]
            topic = node.follow(PREFIX, BLOCKS)
            assert node.follow(PREFIX, BLOCKS) is topic
            with pytest.raises(ConfigError, match="followed with 6 blocks"):
                node.follow(PREFIX, 7)
            with pytest.raises(ConfigError, match="num_blocks"):
                node.follow("other", 0)
            with pytest.raises(ConfigError, match="gossip_interval_s"):
                node.follow("other", 2, gossip_interval_s=0)


async def test_a_found_value_is_cached_at_the_nearest_node_that_lacked_it() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(6, replicas=1) as (swarm, stack):
            client = await stack.enter_async_context(
                open_dht_node(
                    initial_peers=[str(swarm[0].listen_multiaddr)],
                    client_mode=True,
                    request_timeout_s=2,
                    replicas=1,
                )
            )
            key = "cached"
            by_distance = sorted(
                swarm,
                key=lambda n: xor_distance(NodeID.from_peer_id(n.peer_id), NodeID.from_key(key)),
            )
            # A client stores nothing itself: only the single nearest node holds it.
            assert await client.store(key, b"v", time.time() + 600) == 1
            held = [await holds(client, node, key) for node in by_distance]
            assert held == [True] + [False] * 5
            # A get that asks everyone (latest=True) hears "not here" from the others, and the
            # nearest of them gets a copy.
            value = await client.get(key, latest=True)
            assert value is not None and value.entries[None].value == b"v"
            assert client.statistics().records_cached == 1
            await wait_until(lambda: holds(client, by_distance[1], key))
            assert [await holds(client, node, key) for node in by_distance] == [True, True] + [
                False
            ] * 4


async def test_a_node_on_every_interface_is_reached_by_the_address_it_called_from() -> None:
    with trio.fail_after(DEADLINE_S):
        async with nodes(1) as (swarm, _):
            entry = swarm[0]
            async with open_dht_node(
                host="0.0.0.0", initial_peers=[str(entry.listen_multiaddr)], request_timeout_s=2
            ) as wild:
                contact = entry.routing_table.get(NodeID.from_peer_id(wild.peer_id))
                assert contact is not None
                assert contact.address.startswith("/ip4/127.0.0.1/udp/")
                assert contact.address.endswith(f"/p2p/{wild.peer_id}")
                assert await entry.store("k", b"v", time.time() + 60) == 1
