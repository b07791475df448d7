"""The monitor's trio part: a client-mode DHT node that keeps a :class:`SwarmState` current.

Every ``refresh_period_s`` a round:

1. reads the registry of models (:func:`get_models`) and follows each new model
   (:meth:`DHTNode.follow`: DHT reads plus gossip keep its peer table, so servers that come and
   go show within seconds), waiting for the first read of the models it just began to follow;
2. meanwhile times a ``dht.ping`` call to every server listed, all at once, each bounded by
   ``ping_timeout_s``; a server that does not answer is unreachable, and its model's blocks are
   read from the DHT again (in the background) to learn whether it left, as are those of a
   model no server announces (to see one that joins);
3. builds the state (:func:`build_state`) and, when the models in it changed, gives it the next
   version and wakes whoever waits in :meth:`SwarmMonitor.wait_state` (the event streams).

Beside the rounds, one at a time, the monitor judges each model's fraud reports as a client does
(``petals_core.client._report_judge``: other servers recompute the reported answer, and only a
report they confirm is upheld) and shows, per server, the reports upheld against it.  Reading
the lists of reports needs no torch; judging one does, so torch is loaded once a report names a
server the monitor sees.

A model stays on the page while the registry lists it or servers still announce it; once
neither holds, the monitor stops following it.  When the registry gives a model another block
count, the model is followed afresh with that count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Final

import attrs
import trio

from .._errors import ConfigError, PetalsError, TransportError
from .._groups import open_block_nursery
from .._validators import positive
from ..dht import (
    DHTNode,
    ListingKey,
    ModelInfo,
    PeerTableSnapshot,
    Topic,
    fetch_listings,
    get_models,
    open_dht_node,
)
from ..transport import Multiaddr, call_unary, client_listen_host
from ._state import SwarmState, build_state

if TYPE_CHECKING:
    from ..client import RemoteSequenceManager, Verdict

__all__ = ["MonitorConfig", "SwarmMonitor", "open_monitor"]

logger = logging.getLogger(__name__)

#: A followed model's blocks are read from the DHT at most this often: gossip brings what
#: changes within seconds, the reads catch what it missed.
_MIN_TOPIC_READ_PERIOD_S: Final = 30.0
#: Servers pinged at the same time (a round waits for the slowest batch of them).
_MAX_CONCURRENT_PINGS: Final = 128


def _multiaddrs(
    instance: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]
) -> None:
    if not value:
        raise ConfigError(f"{attribute.name}: give the multiaddr of at least one peer of the swarm")
    for text in value:
        Multiaddr.parse(text)  # InvalidMultiaddr (a ConfigError) saying what is wrong


@attrs.frozen(kw_only=True)
class MonitorConfig:
    """What the monitor is told: the swarm to join (``initial_peers``: multiaddrs), how often it
    looks (``refresh_period_s``), how long a server may take to answer a ping, the DHT's request
    timeout, how many models it follows at most (each one's blocks are read from the DHT), and
    the address its DHT node binds (a client: it only dials out; None picks loopback when every
    initial peer is there, else every interface)."""

    initial_peers: tuple[str, ...] = attrs.field(converter=tuple, validator=_multiaddrs)
    refresh_period_s: float = attrs.field(default=5.0, validator=positive)
    ping_timeout_s: float = attrs.field(default=3.0, validator=positive)
    request_timeout_s: float = attrs.field(default=5.0, validator=positive)
    max_models: int = attrs.field(default=64, validator=positive)
    dht_host: str | None = None


class SwarmMonitor:
    """The swarm as last seen (:attr:`state`); build it with :func:`open_monitor`."""

    def __init__(
        self,
        dht: DHTNode,
        config: MonitorConfig,
        nursery: trio.Nursery,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._dht = dht
        self._nursery = nursery
        self.config: Final = config
        self._clock = clock
        self._topics: dict[str, Topic] = {}
        self._models: dict[str, ModelInfo] = {}
        self._listed: set[str] = set()
        self._rtts: dict[str, float | None] = {}
        self._limiter = trio.CapacityLimiter(_MAX_CONCURRENT_PINGS)
        self._state = SwarmState(version=0, updated_at=clock(), models=())
        self._changed = trio.Event()
        self._closed = False
        self._over_limit_logged = False
        #: Per followed model, the manager that judges its fraud reports (started on demand).
        self._judges: dict[str, RemoteSequenceManager] = {}
        self._judging = False

    @property
    def state(self) -> SwarmState:
        return self._state

    async def wait_state(self, after_version: int) -> SwarmState | None:
        """The state once its version is above ``after_version``; None once :meth:`close` was
        called."""
        while not self._closed:
            if self._state.version > after_version:
                return self._state
            await self._changed.wait()
        return None

    def close(self) -> None:
        """End every :meth:`wait_state` (the page's event streams end with them)."""
        self._closed = True
        self._changed.set()

    async def refresh(self) -> None:
        """One round: the registry and the pings at the same time, then the state."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_registry)
            nursery.start_soon(self._ping_servers)
        self._publish()
        if not self._judging:
            self._judging = True
            self._nursery.start_soon(self._judge_reports)

    async def run(self) -> None:
        """Refresh every ``refresh_period_s`` until cancelled."""
        while True:
            await trio.sleep(self.config.refresh_period_s)
            await self.refresh()

    # -- a round -----------------------------------------------------------------------------------

    async def _read_registry(self) -> None:
        try:
            registry = await get_models(self._dht)
        except TransportError as exc:
            logger.warning("reading the registry of models failed: %s", exc)
            return  # what was listed stays listed until a read succeeds
        for prefix, followed in list(self._topics.items()):
            listed = registry.get(prefix)
            gone = listed is None and not followed.snapshot().peer_ids
            if gone or (listed is not None and listed.num_blocks != followed.num_blocks):
                self._unfollow(prefix)
        new: list[Topic] = []
        for prefix, info in sorted(registry.items()):
            topic = self._topics.get(prefix)
            if topic is None:
                topic = self._follow(prefix, info)
                if topic is None:
                    continue
                new.append(topic)
            self._models[prefix] = info
        async with trio.open_nursery() as nursery:
            for topic in new:
                nursery.start_soon(topic.refresh)
        self._listed = set(registry)

    def _follow(self, prefix: str, info: ModelInfo) -> Topic | None:
        if len(self._topics) >= self.config.max_models:
            if not self._over_limit_logged:
                logger.warning(
                    "the registry lists more than %d models: following the first only",
                    self.config.max_models,
                )
                self._over_limit_logged = True
            return None
        period = max(self.config.refresh_period_s, _MIN_TOPIC_READ_PERIOD_S)
        topic = self._dht.follow(prefix, info.num_blocks, update_period_s=period)
        self._topics[prefix] = topic
        logger.info("following %s (%d blocks)", prefix, info.num_blocks)
        return topic

    def _unfollow(self, prefix: str) -> None:
        judge = self._judges.pop(prefix, None)
        if judge is not None:
            judge.close()
        self._dht.unfollow(prefix)
        del self._topics[prefix]
        self._models.pop(prefix, None)
        self._over_limit_logged = False
        logger.info("no longer following %s", prefix)

    def _snapshots(self) -> dict[str, PeerTableSnapshot]:
        return {prefix: topic.snapshot() for prefix, topic in self._topics.items()}

    async def _ping_servers(self) -> None:
        rtts: dict[str, float | None] = {}

        async def ping(peer_id: str, topic: Topic) -> None:
            addresses = topic.addresses_of(peer_id)
            rtts[peer_id] = await self._ping(addresses) if addresses else None

        listed = self._snapshots()
        async with trio.open_nursery() as nursery:
            seen: set[str] = set()
            for prefix, snapshot in listed.items():
                for peer_id in sorted(snapshot.peer_ids - seen):
                    seen.add(peer_id)
                    nursery.start_soon(ping, peer_id, self._topics[prefix])
        self._rtts = rtts
        for prefix, snapshot in listed.items():
            if not snapshot.peer_ids or any(rtts.get(p) is None for p in snapshot.peer_ids):
                # A server that stopped answering may have left: its OFFLINE announcement is in
                # the DHT even when gossip missed it.  A model nobody serves has nobody to
                # gossip with: a new server shows only in the DHT.  Read it without holding up
                # the rounds.
                topic = self._topics.get(prefix)  # None: no longer followed
                if topic is not None:
                    period = self.config.refresh_period_s
                    self._nursery.start_soon(partial(topic.refresh, min_interval_s=period))

    async def _ping(self, addresses: list[Multiaddr]) -> float | None:
        """Seconds a ``dht.ping`` call takes on a connection to a server at one of its
        ``addresses`` (dialled first, not timed); None if it does not answer within
        ``ping_timeout_s``."""
        async with self._limiter:
            with trio.move_on_after(self.config.ping_timeout_s):
                try:
                    connection = await self._dht.node.connect_any(addresses)
                    began = trio.current_time()
                    await call_unary(connection, "dht.ping", {"client": True})
                    return trio.current_time() - began
                except TransportError as exc:
                    logger.debug("pinging %s failed: %s", addresses[0].peer_id, exc)
            return None

    async def _judge_reports(self) -> None:
        """Judge the followed models' new fraud reports, then show the verdicts."""
        try:
            for prefix, topic in list(self._topics.items()):
                try:
                    listings = await fetch_listings(self._dht, prefix)
                except TransportError as exc:
                    logger.info("reading the reports of %s failed: %r", prefix, exc)
                    continue
                judged = self._verdicts().get(prefix, {})
                peers = topic.snapshot().peer_ids
                if any(x.key not in judged and x.accused in peers for x in listings):
                    await self._judge(prefix, topic)
        finally:
            self._judging = False
        self._publish()

    async def _judge(self, prefix: str, topic: Topic) -> None:
        # Judging recomputes answers: the client's machinery, and torch, load only now.
        from ..client import RemoteSequenceManager, SequenceManagerConfig, judge_listed

        judge = self._judges.get(prefix)
        if judge is None:
            config = SequenceManagerConfig(
                dht_prefix=prefix,
                verify="none",
                request_timeout_s=max(self.config.request_timeout_s, 30.0),
                missing_blocks_timeout_s=self.config.request_timeout_s,
                max_retries=1,
            )
            judge = RemoteSequenceManager(config, topic.num_blocks, dht=self._dht)
            await self._nursery.start(judge.run)
            self._judges[prefix] = judge
        try:
            await judge_listed(judge)
        except PetalsError as exc:
            logger.info("judging the reports of %s failed: %r", prefix, exc)

    def _verdicts(self) -> dict[str, dict[ListingKey, Verdict]]:
        """Per model, the verdicts on reports that still count, by their listings' keys."""
        verdicts: dict[str, dict[ListingKey, Verdict]] = {}
        now = time.time()  # the clock verdicts are dated by
        for prefix, judge in self._judges.items():
            book = judge.state.reports
            if book is not None:
                verdicts[prefix] = {k: v for k, v in book.verdicts.items() if v.expires > now}
        return verdicts

    def _publish(self) -> None:
        snapshots = self._snapshots()
        shown = {
            prefix: info
            for prefix, info in self._models.items()
            if prefix in self._listed or snapshots[prefix].peer_ids
        }
        previous = self._state
        state = build_state(
            shown,
            snapshots,
            self._rtts,
            version=previous.version,
            updated_at=self._clock(),
            verdicts={
                prefix: list(verdicts.values()) for prefix, verdicts in self._verdicts().items()
            },
        )
        if state.models != previous.models:
            state = attrs.evolve(state, version=previous.version + 1)
            self._state = state
            self._changed.set()
            self._changed = trio.Event()
        else:
            self._state = state


@asynccontextmanager
async def open_monitor(config: MonitorConfig) -> AsyncIterator[SwarmMonitor]:
    """Join the swarm as a client-mode DHT node, take a first look (the block starts with the
    swarm's state in :attr:`SwarmMonitor.state`), and keep looking until the block ends.

    Raises :class:`PeerUnreachable` if none of the initial peers answers.
    """
    async with (
        open_dht_node(
            host=config.dht_host or client_listen_host(config.initial_peers),
            client_mode=True,
            initial_peers=config.initial_peers,
            request_timeout_s=config.request_timeout_s,
        ) as dht,
        open_block_nursery() as nursery,
    ):
        monitor = SwarmMonitor(dht, config, nursery)
        await monitor.refresh()
        nursery.start_soon(monitor.run)
        try:
            yield monitor
        finally:
            monitor.close()
            nursery.cancel_scope.cancel()
