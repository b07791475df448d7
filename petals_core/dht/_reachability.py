"""Whether a node can be reached, and what stands in the way: peers tell, a node cannot tell alone.

Two questions go to peers:

- *Where do you see me?*  Every ``dht.ping`` reply carries ``observed``: the address the
  caller's datagrams came from.  Behind a NAT that is the NAT's public mapping.  Seen from two
  peers, the mapping either stays the same towards both (a *cone* NAT: a hole punched towards
  one peer is one every peer can use) or changes with the destination (a *symmetric* NAT: only a
  relay helps).
- *Can you reach me there?*  ``dht.dial_back`` asks a peer to dial an address of the caller's
  from a fresh socket, with the caller's PeerID expected.  A fresh socket matters: a NAT lets
  in replies from where the caller sent to, so a dial from the socket the caller just talked
  to would pass where a stranger's would not.  A peer dials back only the IP address the
  request came from (nobody can aim it at a third host), at most ``_DIAL_BACK_AT_ONCE`` at a
  time and ``_DIAL_BACK_PER_HOST`` for one host, within its request timeout; when all are
  taken it answers "busy", and the caller asks another peer.

:func:`check_reachability` asks both and sums up: ``public`` (a peer reached us; a peer the
caller does not trust must be confirmed by another), ``cone`` or ``symmetric`` (no peer could,
and the mappings peers saw say which NAT: a mapping two peers saw alike outvotes a third), or
``unknown`` (no peer answered, or none tried to dial back).  With only one peer's view, a NAT
counts as cone: hole punching is then tried, and falls back to a relay when it fails.  Where
several peers saw us from one scope, only a mapping two of them agree on is offered for hole
punching.
"""

from __future__ import annotations

import collections
import enum
import ipaddress
import logging
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final

import attrs
import trio

from .._errors import CodecError, ConfigError, TransportError
from ..transport import (
    Connection,
    Multiaddr,
    Node,
    PeerID,
    ServerCall,
    call_unary,
    open_node,
)
from ._messages import caller_address_untrusted

__all__ = [
    "DIAL_BACK",
    "DialBack",
    "Reachability",
    "ReachabilityReport",
    "check_reachability",
]

logger = logging.getLogger(__name__)

#: The RPC a DHT node serves for others' reachability checks.
DIAL_BACK = "dht.dial_back"
#: Dial-backs a node runs at once for others (each holds a socket for up to its timeout), and
#: for one host (a check asks for each of its addresses at once).
_DIAL_BACK_AT_ONCE: Final = 16
_DIAL_BACK_PER_HOST: Final = 4
#: Peers asked where they see us.
_OBSERVERS: Final = 3


class Reachability(enum.Enum):
    """How others can reach a node."""

    #: Peers dial it directly.
    PUBLIC = "public"
    #: Behind a NAT that keeps one mapping towards every peer: hole punching can work.
    CONE = "cone"
    #: Behind a NAT that maps each destination anew: only a relay reaches it.
    SYMMETRIC = "symmetric"
    #: No peer answered the check.
    UNKNOWN = "unknown"


@attrs.define(eq=False)
class DialBack:
    """The ``dht.dial_back`` handler of a node: it dials from a fresh socket within
    ``timeout_s``."""

    node: Node
    timeout_s: float
    _limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(_DIAL_BACK_AT_ONCE)
    )
    #: Dial-backs running per host: at most :data:`_DIAL_BACK_PER_HOST`, so that one host
    #: cannot take them all.
    _hosts: collections.Counter[str] = attrs.field(factory=collections.Counter)

    async def __call__(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        address = caller_address_untrusted(request, call.peer_id, "")
        if call.connection.relay is not None:
            raise CodecError("a dial-back is asked directly, not through a relay")
        if address.is_relayed or address.dns is not None:
            raise CodecError("only an IP address is dialled back")
        remote_host = call.connection.current_address[0]
        if address.host != remote_host:
            raise CodecError(
                f"only the address the request came from ({remote_host}) is dialled back, "
                f"not {address.host}"
            )
        if self._hosts[remote_host] >= _DIAL_BACK_PER_HOST or (
            self._limiter.borrowed_tokens >= self._limiter.total_tokens
        ):
            return {"busy": True, "error": "busy with other dial-backs; ask again later"}
        self._hosts[remote_host] += 1
        try:
            async with self._limiter:
                return await self._dial(address, call.peer_id)
        finally:
            self._hosts[remote_host] -= 1
            if not self._hosts[remote_host]:
                del self._hosts[remote_host]

    async def _dial(self, address: Multiaddr, peer_id: PeerID) -> dict[str, Any]:
        with trio.move_on_after(self.timeout_s):
            try:
                host = _fresh_host(address)
                async with open_node(host=host, config=self.node.config) as fresh:
                    connection = await fresh.connect(address.with_peer_id(peer_id))
                    await connection.aclose()
                    return {"reachable": True}
            except TransportError as exc:
                return {"reachable": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"reachable": False, "error": f"no answer within {self.timeout_s:g} s"}


def _fresh_host(address: Multiaddr) -> str:
    if address.is_loopback:
        return "::1" if address.family == 6 else "127.0.0.1"
    return "::" if address.family == 6 else "0.0.0.0"


@attrs.frozen(kw_only=True)
class ReachabilityReport:
    """What peers found: ``reachable`` (addresses a peer dialled back), ``unreachable``
    (address and why), ``observed`` (our address as each peer saw it, by the peer's address)."""

    reachability: Reachability
    reachable: tuple[Multiaddr, ...] = ()
    unreachable: tuple[tuple[Multiaddr, str], ...] = ()
    observed: tuple[tuple[str, Multiaddr], ...] = ()
    #: The peer that dialled back, if any answered.
    via: str | None = None

    @property
    def public_addresses(self) -> list[Multiaddr]:
        """The addresses peers saw us at that are not loopback: where several peers saw us in
        one scope (over the Internet, on a LAN; by address family), those two of them agree
        on; else the one peer's.  One peer alone could name any address, and have peers punch
        holes towards a host of its choice."""
        seen = [address for _, address in self.observed if not address.is_loopback]
        agreed = [
            address
            for address in seen
            if seen.count(address) > 1
            or sum(_scope(other) == _scope(address) for other in seen) == 1
        ]
        return _unique(agreed)


async def observe(node: Node, peer: Multiaddr, *, timeout_s: float) -> Multiaddr | None:
    """Our address as ``peer`` sees it (from its ``dht.ping`` reply); None if it does not say."""
    with trio.move_on_after(timeout_s):
        try:
            connection = await node.connect(peer)
            reply = await call_unary(connection, "dht.ping", {"client": True})
        except TransportError as exc:
            logger.debug("asking %s where it sees us failed: %r", peer, exc)
            return None
        text = reply.get("observed")
        try:
            return Multiaddr.parse(text) if isinstance(text, str) else None
        except ConfigError:
            return None
    return None


async def check_reachability(
    node: Node,
    addresses: Sequence[Multiaddr],
    via: Sequence[str],
    *,
    timeout_s: float,
    trusted: Collection[str] | None = None,
) -> ReachabilityReport:
    """Ask peers (``via``, multiaddrs) where they see us and whether they can dial us back at
    ``addresses`` and at what they saw; see the module.  Loopback addresses are checked only by
    a loopback peer, and others only by others (a peer elsewhere cannot reach our loopback).

    The first peer that answers the dial-backs decides, but a peer not in ``trusted`` (default:
    every peer is) decides that we are public only if another peer finds us reachable too: a
    stranger saying so falsely would have us drop our relays and be reached by nobody."""
    peers = direct_peers(via)
    vouching = {p.with_peer_id(None) for p in (peers if trusted is None else direct_peers(trusted))}
    observed: list[tuple[str, Multiaddr]] = []

    async def ask(peer: Multiaddr) -> None:
        seen = await observe(node, peer, timeout_s=timeout_s)
        if seen is not None:
            observed.append((str(peer), seen))

    async with trio.open_nursery() as nursery:
        for peer in peers[:_OBSERVERS]:
            nursery.start_soon(ask, peer)
    if not observed:
        return ReachabilityReport(reachability=Reachability.UNKNOWN)
    answered = [p for p in peers if any(str(p) == seen_by for seen_by, _ in observed)]
    unconfirmed: ReachabilityReport | None = None
    judged = False  # whether any peer tried to dial us back
    # Ask in the order given (initial peers first), not in the order they answered.
    for peer in answered:
        # Every address any peer saw is checked by one peer: a peer that lies about where it
        # sees us is found out by another's dial-back.
        candidates = [a.with_peer_id(None) for a in addresses]
        candidates += [seen for _, seen in observed]
        wanted = _unique(a for a in candidates if a.is_loopback == peer.is_loopback)
        if not wanted:
            continue
        found = await _dial_backs(node, peer, wanted, timeout_s=timeout_s)
        if found is None:
            continue
        judged = True
        reachable, unreachable = found
        report = ReachabilityReport(
            reachability=Reachability.PUBLIC if reachable else _nat_kind(observed),
            reachable=tuple(reachable),
            unreachable=tuple(unreachable),
            observed=tuple(observed),
            via=str(peer),
        )
        if unconfirmed is not None:
            return report  # a stranger found us reachable: this peer confirms it, or not
        if reachable and peer.with_peer_id(None) not in vouching:
            unconfirmed = report
            continue
        return report
    if unconfirmed is not None:
        logger.info(
            "only %s, a peer this node does not know, could dial it back: taken as not "
            "reachable until another peer confirms",
            unconfirmed.via,
        )
    elif not judged:
        # Peers said where they see us, but none tried to dial us back (busy, or gone): that
        # tells nothing of whether we are behind a NAT.
        return ReachabilityReport(reachability=Reachability.UNKNOWN, observed=tuple(observed))
    return ReachabilityReport(reachability=_nat_kind(observed), observed=tuple(observed))


async def _dial_backs(
    node: Node, peer: Multiaddr, wanted: list[Multiaddr], *, timeout_s: float
) -> tuple[list[Multiaddr], list[tuple[Multiaddr, str]]] | None:
    """``peer``'s dial-backs to each of ``wanted``, all at once: those it reached, and those it
    did not with why (in ``wanted``'s order); None if ``peer`` itself failed us."""
    reachable: list[Multiaddr] = []
    unreachable: list[tuple[Multiaddr, str]] = []
    busy = False

    async def dial_back(connection: Connection, address: Multiaddr) -> None:
        nonlocal busy
        try:
            reply = await call_unary(connection, DIAL_BACK, {"address": str(address)})
        except TransportError as exc:
            unreachable.append((address, str(exc)))
            return
        if reply.get("busy") is True:
            busy = True  # it did not try: that tells nothing of us
        elif reply.get("reachable") is True:
            reachable.append(address)
        else:
            unreachable.append((address, str(reply.get("error"))))

    try:
        with trio.fail_after(2 * timeout_s):
            connection = await node.connect(peer)
            async with trio.open_nursery() as nursery:
                for address in wanted:
                    nursery.start_soon(dial_back, connection, address)
    except (TransportError, trio.TooSlowError) as exc:
        logger.debug("dial-back through %s failed: %r", peer, exc)
        return None
    if busy:
        logger.debug("%s is busy with other dial-backs", peer)
        return None
    reachable.sort(key=wanted.index)
    unreachable.sort(key=lambda item: wanted.index(item[0]))
    return reachable, unreachable


def direct_peers(via: Iterable[str]) -> list[Multiaddr]:
    """The multiaddrs in ``via`` that parse and are not relayed, each once, in order."""
    peers: list[Multiaddr] = []
    for text in via:
        try:
            peer = Multiaddr.parse(text)
        except ConfigError:
            continue
        if not peer.is_relayed and peer not in peers:
            peers.append(peer)
    return peers


def _nat_kind(observed: Sequence[tuple[str, Multiaddr]]) -> Reachability:
    """Cone or symmetric, from where peers saw us: a mapping that differs between peers on the
    same public address is symmetric, unless two peers saw the same one (then the one that
    differs is a peer's mistake or lie, and hole punching is worth trying)."""
    by_host: dict[str, list[int]] = {}
    for _, address in observed:
        if not address.is_loopback:
            by_host.setdefault(address.host, []).append(address.port)
    for ports in by_host.values():
        if len(set(ports)) > 1 and all(ports.count(port) == 1 for port in ports):
            return Reachability.SYMMETRIC
    return Reachability.CONE


#: Networks that are one site's own (RFC 1918, unique-local, link-local): seen from there, a
#: node's address is not what the Internet sees.
_LOCAL_NETWORKS: Final = tuple(
    ipaddress.ip_network(network)
    for network in (
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "169.254.0.0/16",
        "fc00::/7",
        "fe80::/10",
    )
)


def _scope(address: Multiaddr) -> tuple[int | None, bool]:
    """Where an observer saw us from: the address family, and whether on a local network."""
    if address.dns is not None:
        return address.family, False
    ip = ipaddress.ip_address(address.host)
    return address.family, any(ip in network for network in _LOCAL_NETWORKS)


def _unique(addresses: Any) -> list[Multiaddr]:
    unique: list[Multiaddr] = []
    for address in addresses:
        if address not in unique:
            unique.append(address)
    return unique
