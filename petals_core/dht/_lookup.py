"""Iterative Kademlia lookups, sans-IO: FIND_NODE and FIND_VALUE as a state machine.

A :class:`Lookup` walks towards a target: it asks the nearest nodes it knows for nodes nearer
still, and each answer teaches it new candidates.  The driver sends the :class:`Query` actions it
returns, feeds back what happened (``on_reply``, ``on_failure``) and calls ``on_timeout`` once
``next_deadline()`` has passed.  The rules, all here:

- **Parallelism.**  At most ``alpha`` queries are in flight.  Queries go to the nearest candidates
  not yet asked, and only to candidates among the ``k`` nearest that have not failed: a farther
  one could not enter the result.
- **Termination.**  The lookup is done when the ``k`` nearest candidates that have not failed
  have all replied: nothing nearer is pending or in flight.  A failure drops a candidate, which
  lets the next one into that window.  Queries still in flight then are abandoned; the driver
  may cancel them.  A FIND_VALUE lookup also stops once ``stop_after_values`` replies carried the
  value (if set); otherwise it runs to the end, since a dictionary is merged from many nodes.
- **Timeouts.**  A query unanswered ``query_timeout_s`` after it was sent counts as failed.  Its
  late reply, like any reply from a node we did not query, a second reply, or anything after the
  lookup is done, is ignored.  The driver bounds the whole lookup with its own clock and calls
  ``give_up`` when that runs out: the lookup ends with what it found by then.  Nodes that answer
  slowly, each naming nearer nodes that answer slowly too, could otherwise keep it going.
- **Distrust.**  A contact whose ``node_id`` is not ``NodeID.from_peer_id(peer_id)`` is dropped,
  so no node can plant a peer at a position of its choosing; so is a contact for ``own``.
- **Hops.**  Querying a contact we started with is hop 1; querying one that a hop-``h`` reply
  taught us is hop ``h + 1`` (its shortest chain known when it was queried).  A result's ``hops``
  is that of its nearest contact.

Nothing here reads a clock, draws global randomness or does I/O.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterable

import attrs

from .._errors import ConfigError
from ._records import Record, StoredValue, merge, merge_records
from ._routing import Contact, NodeID

__all__ = ["Lookup", "LookupResult", "LookupStatistics", "Query"]


@attrs.frozen
class Query:
    """Send ``contact`` a FIND_NODE for ``target`` (a FIND_VALUE for key ``want_value`` when set),
    and report its outcome to the lookup numbered ``lookup_id``."""

    contact: Contact
    target: NodeID
    want_value: str | None
    lookup_id: int


@attrs.frozen(kw_only=True)
class LookupResult:
    """What a lookup found.

    ``contacts`` are the ``k`` nearest nodes that replied, nearest first, with ``last_seen`` set to
    the time of their reply.  For FIND_VALUE, ``value`` merges every record received (None if no
    node had one) and ``without_value`` lists the nodes that replied without it, nearest first:
    where to cache the value.  ``messages`` counts the queries sent.
    """

    target: NodeID
    contacts: tuple[Contact, ...]
    value: StoredValue | None
    without_value: tuple[Contact, ...]
    hops: int
    messages: int


@attrs.frozen(kw_only=True)
class LookupStatistics:
    candidates: int
    in_flight: int
    replied: int
    failed: int
    timed_out: int
    messages: int
    #: FIND_VALUE: replies that carried the value.
    value_replies: int
    done: bool
    #: Whether it ended because the driver gave up on it (:meth:`Lookup.give_up`).
    out_of_time: bool


class _State(enum.Enum):
    PENDING = "pending"
    IN_FLIGHT = "in flight"
    REPLIED = "replied"
    FAILED = "failed"


class _Candidate:
    __slots__ = ("attempts", "contact", "depth", "had_value", "sent_at", "state")

    def __init__(self, contact: Contact, depth: int) -> None:
        self.contact = contact
        # Hops to reach this node: the reply that taught us of it came at hop depth - 1.
        self.depth = depth
        self.state = _State.PENDING
        self.sent_at = 0.0
        self.had_value = False
        self.attempts = 0


def _positive(name: str, value: float, minimum: float) -> None:
    if not value >= minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {value}")


class Lookup:
    """One iterative lookup of ``target`` starting from ``initial`` contacts (typically our routing
    table's ``closest(target, k)``).

    ``want_value`` is the record key for FIND_VALUE (None for FIND_NODE).  ``own`` is our node ID,
    never queried nor returned.  ``lookup_id`` is copied into each :class:`Query` so a driver
    running several lookups can route outcomes back.
    """

    def __init__(
        self,
        target: NodeID,
        initial: Iterable[Contact],
        *,
        k: int = 20,
        alpha: int = 3,
        query_timeout_s: float = 5.0,
        want_value: str | None = None,
        stop_after_values: int | None = None,
        own: NodeID | None = None,
        lookup_id: int = 0,
        max_attempts: int = 1,
    ) -> None:
        if not isinstance(target, NodeID):
            raise TypeError(f"target must be a NodeID, got {type(target).__name__}")
        _positive("k", k, 1)
        _positive("alpha", alpha, 1)
        _positive("max_attempts", max_attempts, 1)
        if not query_timeout_s > 0:
            raise ConfigError(f"query_timeout_s must be positive, got {query_timeout_s}")
        if stop_after_values is not None:
            if want_value is None:
                raise ConfigError("stop_after_values applies to FIND_VALUE lookups only")
            _positive("stop_after_values", stop_after_values, 1)
        self._target = target
        self._k = k
        self._alpha = alpha
        self._query_timeout_s = query_timeout_s
        self._out_of_time = False
        self._want_value = want_value
        self._stop_after_values = stop_after_values
        self._own = own
        self._lookup_id = lookup_id
        # A query that timed out is asked again (a lost datagram should not cost the nearest
        # node) before the node counts as failed; an explicit failure counts at once.
        self._max_attempts = max_attempts
        self._candidates: dict[NodeID, _Candidate] = {}
        # XOR distances of every candidate, ascending; distinct, since the metric is unidirectional.
        self._order: list[int] = []
        self._at_distance: dict[int, _Candidate] = {}
        self._in_flight = 0
        self._messages = 0
        self._failed = 0
        self._timed_out = 0
        self._value: StoredValue | None = None
        self._value_replies = 0
        self._started = False
        self._done = False
        for contact in initial:
            self._learn(contact, depth=1)

    @property
    def target(self) -> NodeID:
        return self._target

    @property
    def want_value(self) -> str | None:
        return self._want_value

    @property
    def done(self) -> bool:
        return self._done

    def start(self, now: float) -> list[Query]:
        """The first queries; call once."""
        if self._started:
            raise RuntimeError("this lookup has already started")
        self._started = True
        return self._advance(now)

    def on_reply(
        self,
        node_id: NodeID,
        contacts: Iterable[Contact],
        records: Iterable[Record] | None,
        now: float,
    ) -> list[Query]:
        """``node_id`` answered with ``contacts`` (and, for FIND_VALUE, the ``records`` it holds
        under the key, None or empty if none)."""
        candidate = self._in_flight_candidate(node_id)
        if candidate is None:
            return []
        candidate.state = _State.REPLIED
        candidate.contact = attrs.evolve(candidate.contact, last_seen=now)
        self._in_flight -= 1
        if self._want_value is not None and records is not None:
            found = merge_records(self._want_value, records, now)
            if found is not None:
                self._value = merge(self._value, found)
                self._value_replies += 1
                candidate.had_value = True
        for contact in contacts:
            self._learn(contact, depth=candidate.depth + 1)
        if self._stop_after_values is not None and self._value_replies >= self._stop_after_values:
            self._done = True
            return []
        return self._advance(now)

    def on_failure(self, node_id: NodeID, now: float) -> list[Query]:
        """The query to ``node_id`` failed (unreachable, an error, a reply we could not read)."""
        candidate = self._in_flight_candidate(node_id)
        if candidate is None:
            return []
        self._fail(candidate)
        return self._advance(now)

    def on_timeout(self, now: float) -> list[Query]:
        """Fail the queries sent ``query_timeout_s`` or more before ``now``; call it when
        ``next_deadline()`` has passed (calling it early does nothing)."""
        if self._done:
            return []
        expired = [
            candidate
            for candidate in self._candidates.values()
            if candidate.state is _State.IN_FLIGHT
            and candidate.sent_at + self._query_timeout_s <= now
        ]
        if not expired:
            return []
        for candidate in expired:
            self._timed_out += 1
            if candidate.attempts < self._max_attempts:
                candidate.state = _State.PENDING
                self._in_flight -= 1
            else:
                self._fail(candidate)
        return self._advance(now)

    def next_deadline(self) -> float | None:
        """When the oldest query in flight times out, or None if none is (or the lookup is done)."""
        if self._done or not self._in_flight:
            return None
        return (
            min(
                candidate.sent_at
                for candidate in self._candidates.values()
                if candidate.state is _State.IN_FLIGHT
            )
            + self._query_timeout_s
        )

    def give_up(self) -> None:
        """End the lookup now (the driver's time for it ran out): :meth:`result` is what it
        found so far, and whatever comes later is ignored."""
        if not self._done:
            self._done = self._out_of_time = True

    def result(self) -> LookupResult:
        """What the lookup has found so far: final once ``done``."""
        replied = [
            candidate for candidate in self._by_distance() if candidate.state is _State.REPLIED
        ][: self._k]
        without_value: tuple[Contact, ...] = ()
        if self._want_value is not None:
            without_value = tuple(
                candidate.contact
                for candidate in self._by_distance()
                if candidate.state is _State.REPLIED and not candidate.had_value
            )
        return LookupResult(
            target=self._target,
            contacts=tuple(candidate.contact for candidate in replied),
            value=self._value,
            without_value=without_value,
            hops=replied[0].depth if replied else 0,
            messages=self._messages,
        )

    def statistics(self) -> LookupStatistics:
        states = [candidate.state for candidate in self._candidates.values()]
        return LookupStatistics(
            candidates=len(states),
            in_flight=self._in_flight,
            replied=states.count(_State.REPLIED),
            failed=self._failed,
            timed_out=self._timed_out,
            messages=self._messages,
            value_replies=self._value_replies,
            done=self._done,
            out_of_time=self._out_of_time,
        )

    def _in_flight_candidate(self, node_id: NodeID) -> _Candidate | None:
        if self._done:
            return None
        candidate = self._candidates.get(node_id)
        if candidate is None or candidate.state is not _State.IN_FLIGHT:
            return None
        return candidate

    def _learn(self, contact: Contact, depth: int) -> None:
        node_id = contact.node_id
        if not isinstance(node_id, NodeID) or node_id == self._own:
            return
        known = self._candidates.get(node_id)
        if known is not None:
            if known.state is _State.PENDING and depth < known.depth:
                known.depth = depth
            return
        if NodeID.from_peer_id(contact.peer_id) != node_id:
            return  # a peer lying about where another sits
        candidate = _Candidate(contact, depth)
        distance = node_id.value ^ self._target.value
        self._candidates[node_id] = candidate
        self._at_distance[distance] = candidate
        bisect.insort(self._order, distance)

    def _by_distance(self) -> Iterable[_Candidate]:
        for distance in self._order:
            yield self._at_distance[distance]

    def _fail(self, candidate: _Candidate) -> None:
        candidate.state = _State.FAILED
        self._in_flight -= 1
        self._failed += 1

    def _advance(self, now: float) -> list[Query]:
        """Fill the free query slots from the window of the ``k`` nearest live candidates, or
        finish when that window holds only nodes that replied."""
        if self._done:
            return []
        queries: list[Query] = []
        window = 0
        unsettled = False
        for candidate in self._by_distance():
            if candidate.state is _State.FAILED:
                continue
            window += 1
            if window > self._k:
                break
            if candidate.state is _State.PENDING and self._in_flight < self._alpha:
                candidate.state = _State.IN_FLIGHT
                candidate.sent_at = now
                candidate.attempts += 1
                self._in_flight += 1
                self._messages += 1
                queries.append(
                    Query(candidate.contact, self._target, self._want_value, self._lookup_id)
                )
            if candidate.state is not _State.REPLIED:
                unsettled = True
        if not unsettled:
            self._done = True
        return queries
