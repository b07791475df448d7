"""``dht.dial_back``: a peer dials the caller's announced address back, on a fresh connection."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import trio

from petals_core import RemoteError
from petals_core.dht import check_reachability
from petals_core.dht._node import open_dht_node
from petals_core.transport import Identity, Multiaddr, call_unary

DEADLINE_S = 60


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback UDP port that receives and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


async def test_a_peer_dials_announced_addresses_back(silent_port: int) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", request_timeout_s=2) as helper,
            open_dht_node(
                host="127.0.0.1", initial_peers=[str(helper.listen_multiaddr)]
            ) as joining,
        ):
            mine = joining.listen_multiaddr
            wrong = Multiaddr("127.0.0.1", silent_port)
            results = await check_reachability(
                joining.node, [mine, wrong], [str(helper.listen_multiaddr)], timeout_s=2
            )
            assert [(r.address, r.error is None) for r in results] == [(mine, True), (wrong, False)]
            assert all(r.via == str(helper.listen_multiaddr) for r in results)
            assert "no answer within 2 s" in str(results[1].error)
            # Only the caller's own addresses are dialled.
            connection = await joining.node.connect(helper.listen_multiaddr)
            other = mine.with_peer_id(Identity.generate().peer_id)
            with pytest.raises(RemoteError, match="names a PeerID other than the caller's"):
                await call_unary(connection, "dht.dial_back", {"address": str(other)})
            with pytest.raises(RemoteError, match="carries 'address'"):
                await call_unary(connection, "dht.dial_back", {})


async def test_no_peer_answering_checks_nothing(silent_port: int) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node(host="127.0.0.1") as alone:
            via = [str(Multiaddr("127.0.0.1", silent_port)), "not a multiaddr"]
            assert (
                await check_reachability(alone.node, [alone.listen_multiaddr], via, timeout_s=1)
                == []
            )
