"""DHT nodes over real QUIC on loopback: a small swarm storing, finding and forgetting records."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from petals_core._errors import ConfigError, PeerUnreachable
from petals_core.dht import Contact, NodeID
from petals_core.dht._node import DHTNode, open_dht_node
from petals_core.transport import (
    Handlers,
    Identity,
    Multiaddr,
    RelayService,
    RemoteError,
    ServerCall,
    TransportConfig,
    call_unary,
    hold_reservation,
    open_node,
    serve_rpc,
)

from ._swarm import FakeClock, swarm as shared_swarm

DEADLINE_S = 60
SWARM = 10


@asynccontextmanager
async def swarm(clock: FakeClock, n: int = SWARM) -> AsyncIterator[list[DHTNode]]:
    async with shared_swarm(clock, n) as (nodes, _):
        yield nodes


async def test_store_on_one_node_get_from_another() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with swarm(clock) as nodes:
            assert all(len(node.routing_table) >= 1 for node in nodes)
            accepted = await nodes[3].store("model.block.7", b"hello", clock.now + 60)
            assert accepted >= 1
            found = await nodes[8].get("model.block.7")
            assert found is not None
            assert found.entries[None].value == b"hello"
            assert await nodes[5].get("no.such.key") is None

            # A dictionary of subkeys signed by two identities, stored through different nodes.
            assert await nodes[1].store("servers", b"from-1", clock.now + 60, signed=True)
            assert await nodes[2].store("servers", b"from-2", clock.now + 60, signed=True)
            merged = await nodes[9].get("servers", latest=True)
            assert merged is not None and merged.is_dictionary
            assert {entry.value for entry in merged.entries.values()} == {b"from-1", b"from-2"}
            assert set(merged.entries) == {str(nodes[1].peer_id), str(nodes[2].peer_id)}
            for record in merged.records("servers"):
                assert record.verify()

            # Records expire: advance the shared wall clock past their expiration.
            clock.now += 120
            assert await nodes[8].get("model.block.7") is None
            assert await nodes[9].get("servers", latest=True) is None
            assert nodes[0].statistics().requests_served > 0


async def test_client_mode_node_uses_the_dht_but_enters_no_table() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with (
            swarm(clock, n=5) as nodes,
            open_dht_node(
                initial_peers=[str(nodes[0].listen_multiaddr)], client_mode=True, clock=clock
            ) as client,
        ):
            assert await client.store("k", b"v", clock.now + 60) >= 1
            found = await client.get("k")
            assert found is not None and found.entries[None].value == b"v"
            assert await nodes[4].get("k") == found
            client_id = NodeID.from_peer_id(client.peer_id)
            for node in nodes:
                assert client_id not in node.routing_table
            assert client.statistics().requests_served == 0


async def test_bootstrap_from_a_dead_address_names_it() -> None:
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        dead = Multiaddr.from_socket_address(*silent.getsockname(), Identity.generate().peer_id)
        with trio.fail_after(DEADLINE_S), pytest.raises(PeerUnreachable, match=str(dead.port)):
            async with open_dht_node(
                initial_peers=[str(dead)],
                request_timeout_s=1,
                transport_config=TransportConfig(connect_timeout_s=0.5),
            ):
                pytest.fail("bootstrap should have failed")
    finally:
        silent.close()


async def test_stopped_node_is_dropped_after_failing_to_answer() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with swarm(clock, n=5) as nodes:
            async with open_dht_node(
                initial_peers=[str(nodes[0].listen_multiaddr)], clock=clock, request_timeout_s=2
            ) as leaving:
                gone = NodeID.from_peer_id(leaving.peer_id)
            # Its own-ID lookup on joining reached every node, so they all know it.
            assert gone in nodes[4].routing_table
            await nodes[4].get("anything", latest=True)
            assert gone not in nodes[4].routing_table
            assert nodes[4].statistics().requests_failed >= 1


async def test_malformed_requests_are_refused_and_the_node_keeps_serving() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node() as dht, open_node() as raw:
            connection = await raw.connect(dht.listen_multiaddr)
            for method, request in [
                ("dht.find_node", {"client": True, "target": b"short"}),
                ("dht.find_value", {"client": True, "key": 7}),
                ("dht.store", {"client": True, "records": [{"key": "k"}]}),
                ("dht.store", {"client": True, "records": "nope"}),
                ("dht.ping", {"address": "/dns/not_a_name/udp/1/quic-v1"}),
                ("dht.ping", {"address": "/ip4/1.2.3.4/tcp/1"}),
                ("dht.ping", {}),
            ]:
                with pytest.raises(RemoteError):
                    await call_unary(connection, method, request)
            reply = await call_unary(connection, "dht.ping", {"client": True})
            # The reply says where the caller's datagrams come from.
            observed = str(raw.listen_multiaddr.with_peer_id(None))
            assert reply == {"peer_id": str(dht.peer_id), "observed": observed}
            assert len(dht.routing_table) == 0


async def test_a_caller_naming_another_host_is_served_but_not_noted() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node() as dht, open_node() as raw:
            connection = await raw.connect(dht.listen_multiaddr)
            elsewhere = f"/ip4/127.0.0.2/udp/{raw.listen_multiaddr.port}/quic-v1"
            reply = await call_unary(connection, "dht.ping", {"address": elsewhere})
            assert reply["peer_id"] == str(dht.peer_id)
            assert len(dht.routing_table) == 0
            assert dht.statistics().callers_not_noted == 1
            # Named where it calls from, it is noted.
            here = str(raw.listen_multiaddr.with_peer_id(None))
            await call_unary(connection, "dht.ping", {"address": here})
            assert dht.routing_table.get(NodeID.from_peer_id(raw.peer_id)) is not None
            assert dht.statistics().callers_not_noted == 1


async def test_a_contact_is_noted_as_the_host_that_answered_reaches_it() -> None:
    """A node named by a DNS name is noted at the address that answered; one named (as a third
    party may) at another host than where a live connection to it reaches is not noted."""
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node() as first, open_dht_node() as second:
            other = NodeID.from_peer_id(second.peer_id)
            await first.node.connect(second.listen_multiaddr)
            port, peer = second.listen_multiaddr.port, second.peer_id
            elsewhere = Contact.from_peer_id(
                peer, f"/ip4/127.0.0.2/udp/{port}/quic-v1/p2p/{peer}", last_seen=0.0
            )
            assert await first._request(elsewhere, "dht.ping", {}) is not None
            assert first.routing_table.get(other) is None
            named = Contact.from_peer_id(
                peer, f"/dns4/localhost/udp/{port}/quic-v1/p2p/{peer}", last_seen=0.0
            )
            assert await first._request(named, "dht.ping", {}) is not None
            noted = first.routing_table.get(other)
            assert noted is not None and noted.address == str(second.listen_multiaddr)


async def test_a_node_reached_through_a_relay_is_noted_only_at_that_relayed_address() -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_node() as relay,
            open_dht_node() as first,
            open_dht_node() as second,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, relay, RelayService.on(relay).handlers())
            reservation = await nursery.start(hold_reservation, second.node, relay.listen_multiaddr)
            await first.node.connect(reservation.address)
            other, peer = NodeID.from_peer_id(second.peer_id), second.peer_id
            port = second.listen_multiaddr.port
            elsewhere = Contact.from_peer_id(
                peer, f"/ip4/127.0.0.2/udp/{port}/quic-v1/p2p/{peer}", last_seen=0.0
            )
            assert await first._request(elsewhere, "dht.ping", {}) is not None
            assert first.routing_table.get(other) is None
            relayed = Contact.from_peer_id(peer, str(reservation.address), last_seen=0.0)
            assert await first._request(relayed, "dht.ping", {}) is not None
            noted = first.routing_table.get(other)
            assert noted is not None and noted.address == str(reservation.address)
            nursery.cancel_scope.cancel()


async def test_a_node_behind_port_forwarding_is_known_by_the_address_it_announces() -> None:
    """Others put the ``announce`` address in their tables, not where the node listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as forwarded:
        forwarded.bind(("127.0.0.1", 0))  # a port only the router would own
        outside = Multiaddr("127.0.0.1", forwarded.getsockname()[1])
        with trio.fail_after(DEADLINE_S):
            async with (
                open_dht_node() as first,
                open_dht_node(
                    initial_peers=[str(first.listen_multiaddr)], announce=outside
                ) as behind,
            ):
                assert behind.announce_multiaddr == outside
                assert first.announce_multiaddr == first.listen_multiaddr
                contact = first.routing_table.get(NodeID.from_peer_id(behind.peer_id))
                assert contact is not None
                assert Multiaddr.parse(contact.address).port == outside.port


async def test_a_key_with_more_entries_than_a_store_request_carries_is_found_whole() -> None:
    # 100 servers on one block: more than one STORE carries, all in one FIND_VALUE reply.
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        # The client holds nothing itself: what it finds came in a reply.
        async with shared_swarm(clock, 3, with_client=True) as (nodes, client):
            assert client is not None
            for index in range(100):
                value = f"server-{index}".encode()
                assert await nodes[index % 3].store(
                    "model.block.0", value, clock.now + 60, subkey=f"peer-{index}"
                )
            found = await client.get("model.block.0")
            assert found is not None and found.is_dictionary
            assert len(found.entries) == 100
            assert {entry.value for entry in found.entries.values()} == {
                f"server-{index}".encode() for index in range(100)
            }


async def test_unfollow_stops_a_topic_and_following_again_starts_afresh() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with swarm(clock, n=2) as nodes:
            topic = nodes[0].follow("model", 4)
            await topic.refresh()
            nodes[0].unfollow("model")
            nodes[0].unfollow("model")  # not followed: nothing to do
            nodes[0].unfollow("never-followed")
            again = nodes[0].follow("model", 6)  # another count is no conflict now
            assert again is not topic and again.num_blocks == 6
            assert nodes[0].follow("model", 6) is again


async def test_a_lookup_through_a_peer_that_never_answers_it_ends_at_the_lookup_deadline() -> None:
    """A peer that answers pings but holds every lookup query open (its requests time out only
    after ten minutes here) costs a lookup its ``lookup_timeout_s``, not the request timeout."""
    held = trio.Event()
    handlers = Handlers()

    @handlers.unary("dht.ping")
    async def ping(request: dict, call: ServerCall) -> dict:
        return {"peer_id": str(call.connection.peer_id)}

    async def hold(request: dict, call: ServerCall) -> dict:
        held.set()
        await trio.Event().wait()  # never answers
        raise AssertionError("unreachable")

    handlers.add_unary("dht.find_node", hold)
    handlers.add_unary("dht.find_value", hold)
    with trio.fail_after(DEADLINE_S):
        async with open_node() as staller, trio.open_nursery() as nursery:
            await nursery.start(serve_rpc, staller, handlers)
            async with open_dht_node(
                initial_peers=[str(staller.listen_multiaddr)],
                client_mode=True,
                request_timeout_s=600,
                lookup_timeout_s=5,
            ) as dht:
                started = trio.current_time()
                assert await dht.get("model.block.0") is None
                assert held.is_set()
                assert trio.current_time() - started < DEADLINE_S / 2
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
async def test_a_lookup_timeout_that_is_not_positive_is_refused(seconds: float) -> None:
    with pytest.raises(ConfigError, match="lookup_timeout_s"):
        async with open_dht_node(lookup_timeout_s=seconds):
            pytest.fail("the node should not have opened")
