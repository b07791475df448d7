"""A server's reach: whether peers can dial it, and, when they cannot, the relays that carry it.

At start and every ``recheck_interval_s`` after (at once when a relay sees it at a public address
no peer saw before: the network changed), the server asks peers where they see it and to dial it
back (:func:`~petals_core.dht.check_reachability`).  What it does with the answer:

- *public*: it announces first the addresses that were dialled back (a router's forwarded port
  is found this way, without ``--announce_host``), and relays for servers that cannot be dialled
  (unless ``--no_relay``);
- *behind a NAT* (cone or symmetric): it stays out of others' DHT routing tables and, unless
  ``--no_auto_relay``, holds reservations with ``relays_wanted`` relays (its initial peers, then
  servers that announce that they relay).  It announces their relayed addresses first, then its
  public mapping (for hole punching from behind a cone NAT) and its own addresses (for peers on
  its LAN).  A relay that is lost is replaced at once by another (the lost one is asked again
  only after the other candidates);
- *unknown* (no peer answered, or none in time: peers gone, or an uplink too busy to carry a
  dial-back): at the first check, it announces where it listens.  Later, the last answer stands
  until a check gives another: a server behind a NAT keeps its relays and their addresses (its
  clients' sessions go through them) until a check finds it public.  Either way it asks again
  sooner.

Every change calls ``on_change`` (the server announces anew).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import trio

from ..dht import DHTNode, Reachability, ReachabilityReport, check_reachability
from ..transport import (
    Multiaddr,
    PeerID,
    RelayRefused,
    Reservation,
    TransportError,
    hold_reservation,
)

__all__ = ["Reach"]

logger = logging.getLogger("petals_core.server")

#: How long a relay that failed, or whose reservation ended soon, is not asked again (the
#: default of ``Reach.relay_retry_s``).
_RELAY_RETRY_S: Final = 30.0
#: How soon a server that no peer could tell whether it is reachable asks again.
_UNKNOWN_RECHECK_S: Final = 30.0
#: How often a server that found no relay to use looks again.
_RELAY_SEARCH_S: Final = 5.0


@attrs.define(eq=False)
class _Held:
    """The ``task_status`` of one reservation: it records the reservation once held."""

    reach: Reach
    relay: Multiaddr

    def started(self, value: Reservation | None = None) -> None:
        assert value is not None and self.relay.peer_id is not None
        reach = self.reach
        reach.reservations[self.relay.peer_id] = value
        logger.info("reachable through relay %s at %s", self.relay, value.address)
        report = reach.report
        seen = value.observed
        if (
            report is not None
            and seen is not None
            and not seen.is_loopback
            and seen.host not in {address.host for _, address in report.observed}
        ):
            # The relay sees us at a public address no peer saw at the last check: the network
            # changed (another uplink, a new lease).  Check again now.
            logger.info("a relay sees this server at %s: checking reachability again", seen)
            reach.recheck_soon()
        reach._changed()


@attrs.define(eq=False, kw_only=True)
class Reach:
    """See the module.  ``listen()`` gives where the server listens (its dialable addresses),
    ``peers()`` whom to ask, ``relay_candidates()`` the relays it may use (direct addresses with
    PeerIDs)."""

    dht: DHTNode
    listen: Callable[[], list[Multiaddr]]
    peers: Callable[[], list[str]]
    relay_candidates: Callable[[], list[Multiaddr]]
    on_change: Callable[[], None]
    #: Peers whose word alone says we are public (the initial peers); others' must agree.
    trusted: Sequence[str] | None = None
    #: Hold relay reservations when peers cannot dial us (``--use_auto_relay``).
    auto_relay: bool = True
    #: Relay for others when we are public (``--use_relay``).
    relay: bool = True
    timeout_s: float = 10.0
    recheck_interval_s: float = 600.0
    relays_wanted: int = 2
    #: A relay that failed, or held a reservation that ended, within this long is not asked
    #: again for as long (unless no other is left); one dropped within this long comes after
    #: the other candidates.  A failure to reach a relay counts against the address dialled;
    #: a refusal against the relay at every address it is known at.
    relay_retry_s: float = _RELAY_RETRY_S
    report: ReachabilityReport | None = None
    reservations: dict[PeerID, Reservation] = attrs.Factory(dict)
    _retry_after: dict[Multiaddr, float] = attrs.Factory(dict)
    _refused_until: dict[PeerID, float] = attrs.Factory(dict)
    _dropped_at: dict[Multiaddr, float] = attrs.Factory(dict)
    #: The relays (by PeerID: one relay may be known at several addresses) that a reservation
    #: is being asked of or held with.
    _in_use: set[PeerID] = attrs.Factory(set)
    _state_changed: trio.Event = attrs.Factory(trio.Event)
    _recheck: trio.Event = attrs.Factory(trio.Event)
    _checked: trio.Event = attrs.Factory(trio.Event)
    #: What the last check found (unknown included), for the log.
    _found: Reachability | None = None

    @property
    def reachability(self) -> Reachability:
        return Reachability.UNKNOWN if self.report is None else self.report.reachability

    @property
    def relays_for_others(self) -> bool:
        return self.relay and self.reachability is Reachability.PUBLIC

    def addresses(self) -> list[Multiaddr]:
        """What to announce, best first (see the module)."""
        peer_id = self.dht.peer_id
        listen = [address.with_peer_id(peer_id) for address in self.listen()]
        report = self.report
        if report is None or report.reachability is Reachability.UNKNOWN:
            return listen
        if report.reachability is Reachability.PUBLIC:
            first = [address.with_peer_id(peer_id) for address in report.reachable]
        else:
            first = [reservation.address for reservation in self.reservations.values()]
            first += [a.with_peer_id(peer_id) for a in report.public_addresses]
        return _unique(first + listen)

    async def run(self) -> None:
        """Check now and every ``recheck_interval_s`` (sooner when a relay sees us somewhere
        new); hold relays while they are needed."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._relays_forever)
            while True:
                self._recheck = trio.Event()
                report = await self.check()
                interval = self.recheck_interval_s
                if report.reachability is Reachability.UNKNOWN:
                    interval = min(interval, _UNKNOWN_RECHECK_S)  # peers may answer soon
                with trio.move_on_after(interval):
                    await self._recheck.wait()

    def recheck_soon(self) -> None:
        """Check again now, not at the next interval."""
        self._recheck.set()

    async def check(self) -> ReachabilityReport:
        """Ask peers now; log what they found, and act on it.  Returns what they found, which
        is not what the server goes by when it is unknown and an earlier check told more."""
        listen = [address.with_peer_id(None) for address in self.listen()]
        report = await check_reachability(
            self.dht.node, listen, self.peers(), timeout_s=self.timeout_s, trusted=self.trusted
        )
        _log(report, self, port=listen[0].port)
        self._found = report.reachability
        if (
            report.reachability is Reachability.UNKNOWN
            and self.reachability is not Reachability.UNKNOWN
        ):
            # Nobody answered in time: that says nothing of how peers reach us.  The last answer
            # stands; dropping relays now would cut every session that goes through them.
            return report
        self.report = report
        kind = report.reachability
        public = [a for a in report.reachable if not a.is_loopback]
        self.dht.set_reach(
            dialable=kind in (Reachability.PUBLIC, Reachability.UNKNOWN),
            announce=public[0] if public and public[0] not in listen else None,
        )
        if self.dht.relay is not None:
            self.dht.relay.accepting = self.relays_for_others
        self.dht.punch.can_punch = lambda: self.reachability is not Reachability.SYMMETRIC
        self._checked.set()
        self._changed()
        return report

    async def wait_checked(self) -> ReachabilityReport:
        """The first check's report, once there is one."""
        await self._checked.wait()
        assert self.report is not None
        return self.report

    def _changed(self) -> None:
        self._state_changed.set()
        self._state_changed = trio.Event()
        self.on_change()

    def _needs_relays(self) -> bool:
        return self.auto_relay and self.reachability in (Reachability.CONE, Reachability.SYMMETRIC)

    async def _relays_forever(self) -> None:
        while True:
            while not self._needs_relays():
                await self._state_changed.wait()
            async with trio.open_nursery() as nursery:
                for _ in range(self.relays_wanted):
                    nursery.start_soon(self._hold_one)
                while self._needs_relays():
                    await self._state_changed.wait()
                nursery.cancel_scope.cancel()

    async def _hold_one(self) -> None:
        """Keep one reservation, with whichever relay can give one."""
        while True:
            relay = self._pick_relay()
            if relay is None:
                await trio.sleep(_RELAY_SEARCH_S)
                continue
            retry_at = self._may_ask_at(relay)
            if retry_at > trio.current_time():
                # Every candidate failed lately: look again when the one that failed longest
                # ago may be asked (a relay that refuses at once must not be asked in a loop).
                await trio.sleep_until(retry_at)
                continue
            assert relay.peer_id is not None
            self._in_use.add(relay.peer_id)
            began = trio.current_time()
            refused = False
            try:
                await hold_reservation(self.dht.node, relay, task_status=_Held(self, relay))
            except TransportError as exc:
                logger.warning("relay %s: %s; turning to another", relay, exc)
                refused = isinstance(exc, RelayRefused)
            finally:
                self._in_use.discard(relay.peer_id)
                if self.reservations.pop(relay.peer_id, None) is not None:
                    self._changed()
            # Not reached when cancelled: a reservation given up on purpose costs nothing.
            self._retry_later(relay, began, refused=refused)

    def _retry_later(self, relay: Multiaddr, began: float, *, refused: bool = False) -> None:
        """``relay`` failed, or its reservation ended: another relay first.  One that failed or
        ended within ``relay_retry_s`` is asked again after as long; one that held us longer may
        be asked at once, after the candidates not dropped lately (it has most likely just gone
        away: asking it first would wait out a connect timeout before turning to another).  A
        relay that ``refused`` is not asked at any of its addresses for ``relay_retry_s``."""
        now = trio.current_time()
        self._dropped_at[relay] = now
        soon = now - began < self.relay_retry_s
        self._retry_after[relay] = now + self.relay_retry_s if soon else now
        if refused:
            assert relay.peer_id is not None
            self._refused_until[relay.peer_id] = now + self.relay_retry_s

    def _pick_relay(self) -> Multiaddr | None:
        """A candidate not in use (at any of its addresses) and not us: the first, in the
        order given, that may be asked now and was not dropped lately; else the first that may
        be asked now; else the one that may be asked soonest (see :meth:`_retry_later`)."""
        now = trio.current_time()
        free = [
            candidate
            for candidate in _unique(self.relay_candidates())
            if candidate.peer_id not in (None, self.dht.peer_id)
            and not candidate.is_relayed
            and candidate.peer_id not in self._in_use
        ]
        if not free:
            return None
        ready = [c for c in free if self._may_ask_at(c) <= now]
        if ready:
            lately = now - self.relay_retry_s
            # (min keeps the order given among equals.)
            return min(ready, key=lambda c: self._dropped_at.get(c, -math.inf) > lately)
        return min(free, key=self._may_ask_at)

    def _may_ask_at(self, relay: Multiaddr) -> float:
        assert relay.peer_id is not None
        return max(
            self._retry_after.get(relay, -math.inf),
            self._refused_until.get(relay.peer_id, -math.inf),
        )


def _log(report: ReachabilityReport, reach: Reach, *, port: int) -> None:
    """Log what a check found, unless it changes nothing: the same answer as the one that
    stands, or no answer again."""
    kind = report.reachability
    if kind is (reach._found if kind is Reachability.UNKNOWN else reach.reachability):
        logger.debug("reachability unchanged: %s", kind.value)
        return
    auto_relay = reach.auto_relay
    if kind is Reachability.UNKNOWN:
        if reach.reachability is Reachability.UNKNOWN:
            logger.info("reachability not checked: no peer answered")
        else:
            logger.info(
                "reachability not checked again: no peer answered; it stays %s until one does",
                reach.reachability.value,
            )
    elif kind is Reachability.PUBLIC:
        for address in report.reachable:
            logger.info("reachable at %s (dialled back by %s)", address, report.via)
        for address, error in report.unreachable:
            logger.info("not reachable at %s (%s)", address, error)
    else:
        seen = ", ".join(str(a) for a in report.public_addresses) or "nowhere"
        nat = f"behind a {kind.value} NAT (peers see it at {seen})"
        if auto_relay:
            logger.warning(
                "peers cannot dial this server: it is %s. It serves through relays (a relay "
                "adds a leg to each step%s); forwarding UDP port %d to this machine, or giving "
                "the address others can dial with --announce_host, avoids that",
                nat,
                "" if kind is Reachability.SYMMETRIC else ", unless a hole can be punched",
                port,
            )
        else:
            logger.warning(
                "peers cannot dial this server: it is %s, and --no_auto_relay keeps it off "
                "relays, so clients and other servers will not reach it. Forward a UDP port "
                "to this machine and give the address others can dial with --announce_host "
                "(or --public_ip); --skip_reachability_check skips this check",
                nat,
            )


def _unique(addresses: list[Multiaddr]) -> list[Multiaddr]:
    unique: list[Multiaddr] = []
    for address in addresses:
        if address not in unique:
            unique.append(address)
    return unique
