"""Whether a node can be reached at the addresses it announces: another node dials them back.

A node behind NAT or a firewall announces addresses nobody can dial; it cannot tell from the
inside.  ``dht.dial_back`` asks a peer to open a fresh connection to an address of the caller's
and to check that the caller answers there (the handshake proves the caller's key).  A peer
dials only addresses of the caller itself, once per call, within its request timeout.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from .._errors import ConfigError, TransportError
from ..transport import Multiaddr, Node, ServerCall, call_unary
from ._messages import caller_address_untrusted

__all__ = ["DIAL_BACK", "DialBack", "Reachability", "check_reachability"]

logger = logging.getLogger(__name__)

#: The RPC a DHT node serves for others' reachability checks.
DIAL_BACK = "dht.dial_back"


@attrs.frozen
class DialBack:
    """The ``dht.dial_back`` handler of a node: it dials with ``node`` within ``timeout_s``."""

    node: Node
    timeout_s: float

    async def __call__(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        address = caller_address_untrusted(request, call.peer_id, "")
        with trio.move_on_after(self.timeout_s):
            try:
                # Without a PeerID the node dials anew instead of reusing the caller's connection.
                connection = await self.node.connect(address.with_peer_id(None))
            except TransportError as exc:
                return {"reachable": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                if connection.peer_id != call.peer_id:
                    return {"reachable": False, "error": "another peer answers there"}
                return {"reachable": True}
            finally:
                with trio.CancelScope(shield=True):
                    await connection.aclose()
        return {"reachable": False, "error": f"no answer within {self.timeout_s:g} s"}


@attrs.frozen
class Reachability:
    """What a peer found dialling ``address`` back: ``error`` is None if it reached us."""

    address: Multiaddr
    via: str
    error: str | None


async def check_reachability(
    node: Node, addresses: list[Multiaddr], via: list[str], *, timeout_s: float
) -> list[Reachability]:
    """Ask the first of ``via`` (multiaddrs of peers) that answers to dial each of
    ``addresses`` back; empty if none answers.  Loopback addresses are checked only by a
    loopback peer, and others only by others (a peer elsewhere cannot reach our loopback)."""
    for peer in via:
        try:
            peer_address = Multiaddr.parse(peer)
        except ConfigError:
            continue
        wanted = [a for a in addresses if a.is_loopback == peer_address.is_loopback]
        if not wanted:
            continue
        results: list[Reachability] = []
        with trio.move_on_after(2 * timeout_s * len(wanted)):
            try:
                connection = await node.connect(peer_address)
                for address in wanted:
                    reply = await call_unary(connection, DIAL_BACK, {"address": str(address)})
                    error = None if reply.get("reachable") is True else str(reply.get("error"))
                    results.append(Reachability(address, peer, error))
                return results
            except TransportError as exc:
                logger.debug("reachability check through %s failed: %r", peer, exc)
    return []
