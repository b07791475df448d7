"""The peer table over a DHT node: servers announce a :class:`ServerInfo` under
``f"{prefix}.{block}"`` for each block they serve, signed so that only they can file or replace
it; anyone reads them back as a :class:`PeerTableSnapshot`, and a followed model (a
:class:`Topic`) keeps its snapshot fresh by gossip beside the DHT.

:class:`DHTNode` offers this as its ``announce``, ``get_servers``, ``follow`` and ``unfollow``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from .._errors import ConfigError
from ._gossip import Gossip, PeerTableSnapshot, build_snapshot
from ._record_store import RecordStore
from ._records import MAX_ANNOUNCEMENT_S, Record, ServerInfo
from ._topic import Topic

if TYPE_CHECKING:
    from ._node import DHTNode

__all__ = ["PeerTable"]


class PeerTable:
    """The announcements and followed models of one DHT node (see the ``DHTNode`` methods of the
    same names)."""

    def __init__(
        self,
        dht: DHTNode,
        nursery: trio.Nursery,
        *,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._dht = dht
        self._nursery = nursery
        self._clock = clock
        self._rng = rng
        #: The followed models by prefix, whose gossip the node answers.
        self.topics: dict[str, Topic] = {}
        self._topic_scopes: dict[str, trio.CancelScope] = {}
        self._snapshots_built = 0

    async def announce(self, prefix: str, info: ServerInfo, *, expiration: float) -> int:
        value = info.to_bytes()
        announced = 0
        topic = self.topics.get(prefix)

        async def announce_block(block: int) -> None:
            nonlocal announced
            record = Record.signed(self._dht.node.identity, f"{prefix}.{block}", value, expiration)
            if topic is not None:
                for push in topic.publish(record):
                    topic.send_soon(push)
            if await self._dht._store_record(record):
                announced += 1

        async with trio.open_nursery() as nursery:
            for block in range(info.start_block, info.end_block):
                nursery.start_soon(announce_block, block)
        return announced

    async def get_servers(self, prefix: str, blocks: Iterable[int]) -> PeerTableSnapshot:
        records = await self._dht._fetch_records(prefix, blocks)
        now = self._clock()
        found = RecordStore()
        for record in records:
            found.store(record, now)  # checks the signatures once more; cheap
        self._snapshots_built += 1
        return build_snapshot(found, prefix, now, version=self._snapshots_built)

    def follow(
        self,
        prefix: str,
        num_blocks: int,
        *,
        update_period_s: float,
        gossip_interval_s: float,
        fanout: int,
    ) -> Topic:
        topic = self.topics.get(prefix)
        if topic is not None:
            if topic.num_blocks != num_blocks:
                raise ConfigError(
                    f"{prefix!r} is followed with {topic.num_blocks} blocks, not {num_blocks}"
                )
            return topic
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        for name, value in [
            ("update_period_s", update_period_s),
            ("gossip_interval_s", gossip_interval_s),
        ]:
            if not 0 < value < math.inf:
                raise ConfigError(f"{name} must be positive, got {value}")
        # Announcements only (see Gossip.is_announcement), none lasting beyond an hour.
        store = RecordStore(max_expiration_s=MAX_ANNOUNCEMENT_S)
        gossip = Gossip(
            str(self._dht.peer_id),
            store,
            prefix=prefix,
            rng=self._rng,
            num_blocks=num_blocks,
            fanout=fanout,
            interval_s=gossip_interval_s,
        )
        topic = Topic(
            self._dht,
            self._nursery,
            prefix=prefix,
            num_blocks=num_blocks,
            gossip=gossip,
            store=store,
            clock=self._clock,
            rng=self._rng,
        )
        self.topics[prefix] = topic
        scope = self._topic_scopes[prefix] = trio.CancelScope()
        self._nursery.start_soon(self._run_topic, topic, scope, update_period_s, gossip_interval_s)
        return topic

    def unfollow(self, prefix: str) -> None:
        self.topics.pop(prefix, None)
        scope = self._topic_scopes.pop(prefix, None)
        if scope is not None:
            scope.cancel()

    @staticmethod
    async def _run_topic(
        topic: Topic, scope: trio.CancelScope, update_period_s: float, gossip_interval_s: float
    ) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(topic.refresh_forever, update_period_s)
                nursery.start_soon(topic.gossip_forever, gossip_interval_s)
