"""``dht.dial_back``: a peer dials the caller's announced address back, on a fresh connection."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from petals_core import RemoteError
from petals_core.dht import Reachability, ReachabilityReport, check_reachability
from petals_core.dht._node import DHTNode, open_dht_node
from petals_core.dht._reachability import _nat_kind
from petals_core.transport import (
    Handlers,
    Identity,
    Multiaddr,
    Node,
    ServerCall,
    call_unary,
    open_node,
    serve_rpc,
)

DEADLINE_S = 60
#: Where a lying peer says it sees us.
FORGED = Multiaddr("198.51.100.99", 4242)


async def test_a_peer_dials_announced_addresses_back(silent_port: int) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", request_timeout_s=2) as helper,
            open_dht_node(
                host="127.0.0.1", initial_peers=[str(helper.listen_multiaddr)]
            ) as joining,
        ):
            mine = joining.listen_multiaddr.with_peer_id(None)
            wrong = Multiaddr("127.0.0.1", silent_port)
            report = await check_reachability(
                joining.node, [mine, wrong], [str(helper.listen_multiaddr)], timeout_s=2
            )
            assert report.reachability is Reachability.PUBLIC
            assert report.reachable == (mine,)
            ((address, error),) = report.unreachable
            assert address == wrong and "no answer within 2 s" in error
            assert report.via == str(helper.listen_multiaddr)
            # The helper said where it sees us: our own address, on loopback.
            assert report.observed == ((str(helper.listen_multiaddr), mine),)
            assert report.public_addresses == []
            # Only the caller's own addresses are dialled, at the host its request came from.
            connection = await joining.node.connect(helper.listen_multiaddr)
            other = mine.with_peer_id(Identity.generate().peer_id)
            with pytest.raises(RemoteError, match="names a PeerID other than the caller's"):
                await call_unary(connection, "dht.dial_back", {"address": str(other)})
            with pytest.raises(RemoteError, match="carries 'address'"):
                await call_unary(connection, "dht.dial_back", {})
            elsewhere = str(Multiaddr("198.51.100.7", 4001))
            with pytest.raises(RemoteError, match=r"only the address the request came from"):
                await call_unary(connection, "dht.dial_back", {"address": elsewhere})
            relayed = str(helper.listen_multiaddr.relayed(joining.peer_id))
            with pytest.raises(RemoteError, match="only an IP address is dialled back"):
                await call_unary(connection, "dht.dial_back", {"address": relayed})


async def test_no_peer_answering_checks_nothing(silent_port: int) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node(host="127.0.0.1") as alone:
            via = [str(Multiaddr("127.0.0.1", silent_port)), "not a multiaddr"]
            report = await check_reachability(
                alone.node, [alone.listen_multiaddr], via, timeout_s=1
            )
            assert report == ReachabilityReport(reachability=Reachability.UNKNOWN)


def test_where_peers_see_us_tells_the_kind_of_nat() -> None:
    one = Multiaddr("198.51.100.20", 4000)
    same = [("a", one), ("b", one)]
    assert _nat_kind(same) is Reachability.CONE
    assert _nat_kind([("a", one), ("b", Multiaddr("198.51.100.20", 4711))]) is (
        Reachability.SYMMETRIC
    )
    # Two public addresses (two uplinks) with one port each: not symmetric.
    assert _nat_kind([("a", one), ("b", Multiaddr("192.0.2.9", 4711))]) is Reachability.CONE
    assert _nat_kind([("a", one)]) is Reachability.CONE
    # Two peers agree, a third names another port (a mistake, or a lie to keep us from
    # punching holes): cone.
    other = Multiaddr("198.51.100.20", 4711)
    assert _nat_kind([*same, ("c", other)]) is Reachability.CONE
    assert _nat_kind([("a", one), ("b", other), ("c", Multiaddr("198.51.100.20", 5000))]) is (
        Reachability.SYMMETRIC
    )


def test_an_address_one_peer_alone_names_is_not_announced() -> None:
    """Where several peers said where they see us, only an address two of them agree on is
    announced for hole punching: one peer alone could have peers aim at a host of its choice."""
    mine, forged = Multiaddr("198.51.100.20", 4000), Multiaddr("192.0.2.99", 4242)

    def report(*observed: tuple[str, Multiaddr]) -> ReachabilityReport:
        return ReachabilityReport(reachability=Reachability.CONE, observed=observed)

    assert report(("a", mine)).public_addresses == [mine]
    assert report(("a", mine), ("b", forged)).public_addresses == []
    assert report(("a", mine), ("b", forged), ("c", mine)).public_addresses == [mine]
    # Peers on loopback or on our LAN see us from elsewhere: the one Internet view stands.
    lan, local = Multiaddr("192.168.1.5", 4000), Multiaddr("127.0.0.1", 4000)
    assert report(("a", local), ("b", mine)).public_addresses == [mine]
    assert report(("a", lan), ("b", mine)).public_addresses == [lan, mine]
    assert report(("a", lan), ("b", mine), ("c", forged)).public_addresses == [lan]


async def test_a_peer_that_lies_about_where_it_sees_us_is_found_out() -> None:
    """A peer says it sees us at an address that is not ours, and that it can dial us anywhere:
    the honest peer is asked first to dial back, and the forged address is not called
    reachable."""
    with trio.fail_after(DEADLINE_S):
        async with _beside_a_helper(_lying_helper()) as (liar, honest, checking):
            mine = checking.listen_multiaddr.with_peer_id(None)
            via = [str(honest.listen_multiaddr), str(liar.listen_multiaddr)]
            report = await check_reachability(checking.node, [mine], via, timeout_s=2)
            assert report.reachability is Reachability.PUBLIC
            assert report.reachable == (mine,) and report.via == via[0]
            # What the liar said is on record, and confirmed by nobody.
            assert (str(liar.listen_multiaddr), FORGED) in report.observed
            assert FORGED not in report.reachable


def _lying_helper(*, busy: bool = False) -> Handlers:
    """A peer that says it sees us at :data:`FORGED`, and answers every dial-back with
    "reachable" (or "busy") without trying."""
    handlers = Handlers()

    @handlers.unary("dht.ping")
    async def ping(request: dict, call: ServerCall) -> dict:
        return {"peer_id": str(call.peer_id), "observed": str(FORGED)}

    @handlers.unary("dht.dial_back")
    async def dial_back(request: dict, call: ServerCall) -> dict:
        return {"busy": True} if busy else {"reachable": True}

    return handlers


@asynccontextmanager
async def _beside_a_helper(
    handlers: Handlers,
) -> AsyncIterator[tuple[Node, DHTNode, DHTNode]]:
    """A peer serving ``handlers``, an honest DHT node, and the node whose reach is checked."""
    async with (
        open_node() as helper,
        open_dht_node(host="127.0.0.1", request_timeout_s=2) as honest,
        open_dht_node(host="127.0.0.1") as checking,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_rpc, helper, handlers)
        yield helper, honest, checking
        nursery.cancel_scope.cancel()


async def test_a_stranger_alone_cannot_make_us_public(silent_port: int) -> None:
    """A peer that is not one of ours says it dialled us back where nobody can: without another
    peer confirming, we are not public (we would drop our relays and be reached by nobody).
    One of ours that does reach us confirms it; one of ours is believed alone."""
    with trio.fail_after(DEADLINE_S):
        async with _beside_a_helper(_lying_helper()) as (stranger, honest, checking):
            unreachable = [Multiaddr("127.0.0.1", silent_port)]
            mine = [checking.listen_multiaddr.with_peer_id(None)]
            liar, ours = str(stranger.listen_multiaddr), str(honest.listen_multiaddr)

            alone = await check_reachability(
                checking.node, unreachable, [liar], timeout_s=2, trusted=[ours]
            )
            assert alone.reachability is Reachability.CONE and not alone.reachable
            confirmed = await check_reachability(
                checking.node, mine, [liar, ours], timeout_s=2, trusted=[ours]
            )
            assert confirmed.reachability is Reachability.PUBLIC and confirmed.via == ours
            believed = await check_reachability(
                checking.node, unreachable, [liar], timeout_s=2, trusted=[liar]
            )
            assert believed.reachability is Reachability.PUBLIC


async def test_a_peer_too_busy_to_dial_back_tells_nothing() -> None:
    """A peer whose dial-backs are all taken (by someone holding them, say) answers "busy":
    the next peer is asked, and we are not taken to be behind a NAT, even where no other
    peer answers."""
    with trio.fail_after(DEADLINE_S):
        async with _beside_a_helper(_lying_helper(busy=True)) as (busy, honest, checking):
            mine = checking.listen_multiaddr.with_peer_id(None)
            via = [str(busy.listen_multiaddr), str(honest.listen_multiaddr)]
            report = await check_reachability(checking.node, [mine], via, timeout_s=2)
            assert report.reachability is Reachability.PUBLIC and report.via == via[1]
            # Busy and nobody else: that tells nothing either way.
            alone = await check_reachability(checking.node, [mine], via[:1], timeout_s=2)
            assert alone.reachability is Reachability.UNKNOWN
