"""A DHT node's upkeep, run in the node's nursery: expiry sweeps, bucket refresh, republishing,
and the hand-off of records to nodes that join nearer their keys.

Every ``expire_interval_s`` the store drops expired entries, and every ``refresh_interval_s`` each
bucket that no lookup has aimed at for that long is refreshed with a lookup of a random ID inside
it (Kademlia's bucket refresh), which is how a node keeps learning peers after it joined.  A
failed refresh is logged and the next round tries again.  The rounds finished are counted, and
the node reports the counts in its :class:`~petals_core.dht.DHTStatistics`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import attrs
import trio

from ._lookup import LookupResult
from ._messages import MAX_RECORDS_PER_REQUEST
from ._record_store import RecordStore
from ._records import Record
from ._routing import Contact, NodeID, RoutingTable

__all__ = ["Maintenance"]

logger = logging.getLogger(__name__)

#: Keys :meth:`Maintenance.hand_off` goes through between checkpoints.
_KEYS_PER_CHECKPOINT: Final = 256


@attrs.define(kw_only=True, eq=False)
class Maintenance:
    """The periodic tasks of a node over its routing table and record store; ``lookup`` finds the
    nodes nearest a target and ``store_at`` sends records to contacts (how many accepted them)."""

    _table: RoutingTable
    _records: RecordStore
    _clock: Callable[[], float]
    _replicas: int
    _lookup: Callable[[NodeID], Awaitable[LookupResult]]
    _store_at: Callable[[Sequence[Contact], Sequence[Record]], Awaitable[int]]
    #: Rounds of each loop finished so far.
    expire_rounds: int = attrs.field(default=0, init=False)
    refresh_rounds: int = attrs.field(default=0, init=False)
    republish_rounds: int = attrs.field(default=0, init=False)
    #: Records given to nodes that joined nearer their keys than others.
    handed_off: int = attrs.field(default=0, init=False)

    async def expire_forever(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            dropped = self._records.expire(self._clock())
            if dropped:
                logger.debug("dropped %d expired entries", dropped)
            self.expire_rounds += 1

    async def refresh_forever(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            targets = self._table.buckets_needing_refresh(self._clock(), interval_s)
            async with trio.open_nursery() as nursery:
                for target in targets:
                    nursery.start_soon(self._refresh, target)
            self.refresh_rounds += 1

    async def republish_forever(self, interval_s: float) -> None:
        """Kademlia's republishing: every record held goes again to the nodes nearest its key,
        so records outlive the nodes that held them (until they expire)."""
        limiter = trio.CapacityLimiter(8)
        while True:
            await trio.sleep(interval_s)
            async with trio.open_nursery() as nursery:
                for key in self._records.keys(self._clock()):
                    nursery.start_soon(self._republish, key, limiter)
            self.republish_rounds += 1

    async def hand_off(self, contact: Contact) -> None:
        """A node joined our table: give it the records it is now among the nearest for."""
        now = self._clock()
        records: list[Record] = []
        for index, key in enumerate(self._records.keys(now)):
            if index % _KEYS_PER_CHECKPOINT == 0:
                await trio.lowlevel.checkpoint()  # a full store takes seconds to go through
            nearest = self._table.closest(NodeID.from_key(key), self._replicas)
            if any(c.node_id == contact.node_id for c in nearest):
                held = self._records.get(key, now)
                if held is not None:
                    records.extend(held.records(key))
        for start in range(0, len(records), MAX_RECORDS_PER_REQUEST):
            batch = records[start : start + MAX_RECORDS_PER_REQUEST]
            if await self._store_at([contact], batch):
                self.handed_off += len(batch)

    async def _republish(self, key: str, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            held = self._records.get(key, self._clock())
            if held is None:
                return
            try:
                result = await self._lookup(NodeID.from_key(key))
                await self._store_at(result.contacts[: self._replicas], held.records(key))
            except Exception:
                logger.warning("republishing %r failed", key, exc_info=True)

    async def _refresh(self, target: NodeID) -> None:
        try:
            await self._lookup(target)
        except Exception:
            # A refresh is best effort: the bucket stays due and the next round retries it.
            logger.warning("refreshing the bucket of %s failed", target, exc_info=True)
