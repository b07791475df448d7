"""``dht.dial_back``: a peer dials the caller's announced address back, on a fresh connection."""

from __future__ import annotations

import pytest
import trio

from petals_core import RemoteError
from petals_core.dht import Reachability, ReachabilityReport, check_reachability
from petals_core.dht._node import open_dht_node
from petals_core.dht._reachability import _nat_kind
from petals_core.transport import (
    Handlers,
    Identity,
    Multiaddr,
    ServerCall,
    call_unary,
    open_node,
    serve_rpc,
)

DEADLINE_S = 60


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


async def test_a_peer_that_lies_about_where_it_sees_us_is_found_out() -> None:
    """A peer says it sees us at an address that is not ours, and that it can dial us anywhere:
    the honest peer is asked first to dial back, and the forged address is not called
    reachable."""
    forged = Multiaddr("198.51.100.99", 4242)
    liar_handlers = Handlers()

    @liar_handlers.unary("dht.ping")
    async def ping(request: dict, call: ServerCall) -> dict:
        return {"peer_id": "whatever", "observed": str(forged)}

    @liar_handlers.unary("dht.dial_back")
    async def dial_back(request: dict, call: ServerCall) -> dict:
        return {"reachable": True}

    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", request_timeout_s=2) as honest,
            open_node() as liar,
            open_dht_node(host="127.0.0.1") as checking,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, liar, liar_handlers)
            mine = checking.listen_multiaddr.with_peer_id(None)
            via = [str(honest.listen_multiaddr), str(liar.listen_multiaddr)]
            report = await check_reachability(checking.node, [mine], via, timeout_s=2)
            assert report.reachability is Reachability.PUBLIC
            assert report.reachable == (mine,) and report.via == via[0]
            # What the liar said is on record, and confirmed by nobody.
            assert (str(liar.listen_multiaddr), forged) in report.observed
            assert forged not in report.reachable
            nursery.cancel_scope.cancel()
