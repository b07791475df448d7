"""Hole punching: a peer reached through a relay opens its NAT towards us, and we dial it directly.

1. The dialer reaches the peer through a relay, which told the dialer its public address (the
   ``observed`` of its ``relay.connect`` reply).
2. Over that connection (end to end: the peer's key is proved) the dialer calls ``nat.punch``
   with that address.
3. The peer sends hole-punching probes there (see ``_relay_wire``) for about a second and
   answers at once.  Its NAT now takes datagrams from the dialer's address as replies.  A peer
   that knows it is behind a symmetric NAT answers that it cannot punch: the port its probes
   leave from is not the one the relay saw, and the dialer's datagrams would find no hole.
4. The dialer dials the peer's direct addresses.  Its own NAT opens towards them as its first
   datagram leaves, and the peer's NAT lets that datagram in.

A peer punches only for a call that came through a relay, towards at most
``_MAX_ADDRESSES`` addresses, ``len(_PROBES_AT_S)`` small probes each.  A dialer that failed to
punch to a peer does not try again for ``_FAILURE_MEMORY_S``: it uses the relay at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import trio

from .._errors import CallEnded, CodecError, ConfigError, TransportError
from ._multiaddr import Multiaddr
from ._rpc import Handlers, ServerCall, open_call

if TYPE_CHECKING:
    from ._connection import Connection
    from ._node import Node

__all__ = ["NAT_PUNCH", "PunchService", "punch_hole"]

logger = logging.getLogger(__name__)

NAT_PUNCH = "nat.punch"
_MAX_ADDRESSES: Final = 4
#: When the peer sends its probes, in seconds after the request.
_PROBES_AT_S: Final = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8)
_FAILURE_MEMORY_S: Final = 600.0
_MAX_FAILURES_KEPT: Final = 1024


@attrs.define(eq=False)
class PunchService:
    """The ``nat.punch`` handler of a node; ``can_punch()`` says whether holes can be punched
    to it (False behind a symmetric NAT)."""

    node: Node
    can_punch: Callable[[], bool] = lambda: True

    def handlers(self) -> Handlers:
        handlers = Handlers()
        handlers.add_stream(NAT_PUNCH, self._punch)
        return handlers

    async def _punch(self, call: ServerCall) -> None:
        if call.connection.relay is None:
            raise CodecError("nat.punch is asked through a relay")
        try:
            request = await call.receive()
        except CallEnded:
            raise CodecError("nat.punch takes {'addresses': [multiaddr, ...]}") from None
        targets = _targets_untrusted(request)
        if not self.can_punch():
            await call.send({"punching": False, "reason": "this peer is behind a symmetric NAT"})
            return
        began = trio.current_time()
        for at in _PROBES_AT_S:
            await trio.sleep_until(began + at)
            self.node.send_punches(targets)
            if at == 0.0:
                await call.send({"punching": True})


def _targets_untrusted(request: object) -> list[tuple[str, int]]:
    addresses = request.get("addresses") if isinstance(request, dict) else None
    if not isinstance(addresses, list) or not 0 < len(addresses) <= _MAX_ADDRESSES:
        raise CodecError(f"'addresses' is a list of 1 to {_MAX_ADDRESSES} multiaddrs")
    targets = []
    for text in addresses:
        try:
            address = Multiaddr.parse(text) if isinstance(text, str) else None
        except ConfigError as exc:
            raise CodecError(f"invalid address {text!r}: {exc}") from None
        if address is None or address.is_relayed or address.dns is not None:
            raise CodecError(f"only IP addresses are punched to, not {text!r}")
        if address.is_loopback:
            raise CodecError(f"no hole to punch to a loopback address ({text})")
        targets.append(address.socket_address)
    return targets


async def punch_hole(
    node: Node, relayed: Connection, direct: Sequence[Multiaddr]
) -> Connection | None:
    """A direct connection to the peer of ``relayed`` at one of its ``direct`` addresses, made
    through a hole punched as the module says, within ``hole_punch_timeout_s``; None if none
    opened (``relayed`` is then left as it is, and the next tries to this peer wait a while)."""
    observed = relayed._observed
    timeout_s = node.config.hole_punch_timeout_s
    peer = relayed.peer_id
    failures = node._punch_failures
    now = trio.current_time()
    if observed is None or timeout_s is None or now < failures.get(peer, -math.inf):
        return None
    connection = None
    with trio.move_on_after(timeout_s):
        try:
            async with open_call(relayed, NAT_PUNCH) as call:
                await call.send({"addresses": [str(observed)]})
                reply = await call.receive()
                if reply.get("punching") is True:
                    connection = await node._connect_first(direct)
                else:
                    logger.debug("%s does not punch: %s", peer, reply.get("reason"))
        except TransportError as exc:
            logger.debug("punching a hole to %s failed: %r", peer, exc)
    if connection is None:
        logger.debug("no hole punched to %s within %g s", peer, timeout_s)
    else:
        logger.debug("punched a hole to %s: %s", peer, connection.address)
        failures.pop(peer, None)
        await relayed.aclose()
        return connection
    if len(failures) >= _MAX_FAILURES_KEPT:
        for key in [k for k, until in failures.items() if until <= now] or list(failures)[:1]:
            del failures[key]
    failures[peer] = now + _FAILURE_MEMORY_S
    return None
