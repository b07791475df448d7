"""Hole punching: a peer reached through a relay opens its NAT towards us, and we dial it directly.

1. The dialer reaches the peer through a relay.  The relay tells the peer, on its reservation
   call, who opened that circuit and from which public address (see ``_relay``).
2. Over the relayed connection (end to end: both keys are proved) the dialer calls
   ``nat.punch``.
3. The peer sends hole-punching probes (see ``_relay_wire``) to the dialer's address as the
   relay saw it, for about a second, and answers at once.  Its NAT now takes datagrams from
   there as replies.  A peer that knows it is behind a symmetric NAT answers that it cannot
   punch: the port its probes leave from is not the one the relay saw, and the dialer's
   datagrams would find no hole.
4. The dialer dials the peer's direct addresses.  Its own NAT opens towards them as its first
   datagram leaves, and the peer's NAT lets that datagram in.

A peer punches only for a call that came through a relay, once per circuit, and only to the
address the relay saw the caller at (a unicast address, not loopback), ``len(_PROBES_AT_S)``
small probes: a caller cannot aim them anywhere else.  The relay is a stranger too: it could
name any address, but gets those few probes per circuit it opened, each circuit costing it a
QUIC handshake.  Behind a relay that does not say who opens circuits (an older one), a peer
does not punch.  The dialer still names the address the relay told it, for older peers, which
punch to the address named.  A dialer that failed to punch to a peer does not try again for
``_FAILURE_MEMORY_S``: it uses the relay at once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import trio

from .._errors import CallEnded, CodecError, TransportError
from .._ip import ip_of
from ._rpc import Handlers, ServerCall, open_call

if TYPE_CHECKING:
    from ._connection import Connection
    from ._multiaddr import Multiaddr
    from ._node import Node

__all__ = ["NAT_PUNCH", "PunchService", "punch_hole"]

logger = logging.getLogger(__name__)

NAT_PUNCH = "nat.punch"
#: When the peer sends its probes, in seconds after the request.
_PROBES_AT_S: Final = (0.0, 0.05, 0.1, 0.2, 0.4, 0.8)
#: How long a peer waits for its relay to name the dialer of a circuit (the relay sends that
#: before the dialer learns of the circuit, so it is there already unless a datagram was lost);
#: well within the dialer's ``hole_punch_timeout_s``.
_DIALER_WAIT_S: Final = 1.0
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
        connection = call.connection
        if connection.relay is None:
            raise CodecError("nat.punch is asked through a relay")
        try:
            await call.receive()
        except CallEnded:
            raise CodecError("nat.punch takes one message") from None
        if not self.can_punch():
            await _refuse(call, "this peer is behind a symmetric NAT")
            return
        dialers = self.node.circuit_dialers
        if not dialers.told(connection.address):
            await _refuse(call, "this peer's relay does not say who opens circuits")
            return
        dialer = await dialers.claim(connection.address, _DIALER_WAIT_S)
        if dialer is None:
            await _refuse(call, "the relay named no dialer for this circuit, or it had its punch")
            return
        peer_id, target = dialer
        if peer_id != call.peer_id:
            await _refuse(call, "the relay named another peer as this circuit's dialer")
            return
        refusal = _unpunchable(target[0])
        if refusal is not None:
            await _refuse(call, refusal)
            return
        began = trio.current_time()
        for at in _PROBES_AT_S:
            await trio.sleep_until(began + at)
            self.node.send_punches([target])
            if at == 0.0:
                await call.send({"punching": True})


def _unpunchable(host: str) -> str | None:
    """Why no probe goes to ``host`` (loopback, multicast, ...); None if it may."""
    ip = ip_of(host)
    kinds = {
        "loopback": ip.is_loopback,
        "multicast": ip.is_multicast,
        "unspecified": ip.is_unspecified,
        "link-local": ip.is_link_local,
        "reserved": ip.is_reserved,
    }
    kind = next((kind for kind, matches in kinds.items() if matches), None)
    return None if kind is None else f"no hole to punch to a {kind} address ({host})"


async def _refuse(call: ServerCall, reason: str) -> None:
    await call.send({"punching": False, "reason": reason})


async def punch_hole(
    node: Node, relayed: Connection, direct: Sequence[Multiaddr]
) -> Connection | None:
    """A direct connection to the peer of ``relayed`` at one of its ``direct`` addresses, made
    through a hole punched as the module says, within ``hole_punch_timeout_s``; None if none
    opened (``relayed`` is then left as it is, and the next tries to this peer wait a while).
    Once the direct connection opens, the node hands it out in place of ``relayed``, which
    closes when the calls under way on it (other tasks') have ended."""
    timeout_s = node.config.hole_punch_timeout_s
    peer = relayed.peer_id
    failures = node._punch_failures
    now = trio.current_time()
    observed = relayed._observed
    if timeout_s is None or now < failures.get(peer, -math.inf):
        return None
    connection = None
    with trio.move_on_after(timeout_s):
        try:
            async with open_call(relayed, NAT_PUNCH) as call:
                await call.send({} if observed is None else {"addresses": [str(observed)]})
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
        relayed._retire()
        return connection
    if len(failures) >= _MAX_FAILURES_KEPT:
        for key in [k for k, until in failures.items() if until <= now] or list(failures)[:1]:
            del failures[key]
    failures[peer] = now + _FAILURE_MEMORY_S
    return None
