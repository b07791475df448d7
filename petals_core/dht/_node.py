"""The DHT node: a trio driver that runs the sans-IO cores over the transport's RPC.

It serves the ``dht.*`` RPCs (:class:`DHTService`), and offers ``store`` / ``get`` built on
iterative :class:`Lookup` s.  Everything it starts lives in the
nursery of :func:`open_dht_node`: nothing outlives that block.

On top of those, servers ``announce`` a :class:`ServerInfo` under ``f"{prefix}.{block}"`` for each
block they serve, signed so that only they can file or replace it, and anyone reads them back
with ``get_servers`` as a :class:`PeerTableSnapshot`.

Two clocks, on purpose:

- ``clock`` (default :func:`time.time`) is wall time, the ``now`` of records, routing-table
  ``last_seen`` and lookups: record expirations are absolute and shared between machines, so they
  need a clock that every machine agrees on.  Tests inject a clock to expire records at will.
- ``trio.current_time()`` bounds waiting (request timeouts, lookup deadlines).

Maintenance runs in the same nursery: every ``expire_interval_s`` the store drops expired
entries, and every ``refresh_interval_s`` each bucket that no lookup has aimed at for that long is
refreshed with a lookup of a random ID inside it (Kademlia's bucket refresh), which is how a node
keeps learning peers after it joined.  A failed refresh is logged and the next round tries again.

Requests carry the caller's listen multiaddr (``"address"``) so the server can add it to its
routing table, or ``"client": true`` from a client-mode node, which serves nothing and must not
be added to anyone's table.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from .._errors import CodecError, ConfigError, PeerUnreachable, TransportError
from .._groups import open_block_nursery
from ..transport import (
    Handlers,
    Identity,
    Multiaddr,
    Node,
    PeerID,
    PunchService,
    RelayLimits,
    RelayService,
    TransportConfig,
    call_unary,
    open_node,
    serve_rpc,
)
from ._gossip import Gossip, PeerTableSnapshot, build_snapshot
from ._lookup import Lookup, LookupResult
from ._messages import (
    MAX_RECORDS_PER_REPLY,
    MAX_RECORDS_PER_REQUEST,
    decode_contacts_untrusted,
    decode_records_untrusted,
)
from ._reachability import DIAL_BACK, DialBack
from ._record_store import RecordStore, RecordStoreStatistics
from ._records import Record, ServerInfo, StoredValue, encode_record, merge
from ._routing import Contact, NodeID, PingOldest, RoutingTable, RoutingTableStatistics
from ._serving import DHTService
from ._speed_test import SPEED_TEST, SpeedTest
from ._topic import Topic

__all__ = ["DHTNode", "DHTStatistics", "open_dht_node"]

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class DHTStatistics:
    routing: RoutingTableStatistics
    records: RecordStoreStatistics
    requests_served: int
    requests_sent: int
    requests_failed: int
    refresh_rounds: int
    expire_rounds: int
    republish_rounds: int
    #: Records given to nodes that joined nearer their keys than others.
    records_handed_off: int
    #: Values found by a get and cached at the nearest node on the path that lacked them.
    records_cached: int


class _Rounds:
    """Counts finished rounds of a periodic task and wakes whoever waits for them."""

    def __init__(self) -> None:
        self.finished = 0
        self._event = trio.Event()

    def finish(self) -> None:
        self.finished += 1
        self._event.set()
        self._event = trio.Event()

    async def wait(self, n: int) -> None:
        target = self.finished + n
        while self.finished < target:
            await self._event.wait()


class DHTNode:
    """A Kademlia node on the transport; build it with :func:`open_dht_node`."""

    def __init__(
        self,
        node: Node,
        nursery: trio.Nursery,
        *,
        client_mode: bool,
        k: int,
        alpha: int,
        replicas: int,
        request_timeout_s: float,
        clock: Callable[[], float],
        rng: random.Random,
        refresh_interval_s: float | None,
        expire_interval_s: float | None,
        republish_interval_s: float | None,
        announce: Multiaddr | None = None,
        dialable: bool = True,
    ) -> None:
        self._node = node
        self._announce = announce
        self._dialable = dialable
        #: The ``nat.punch`` service (the node punches holes for dialers reaching it by relay).
        self.punch = PunchService(node)
        #: The relay service, when this node relays for others.
        self.relay: RelayService | None = None
        self._nursery = nursery
        self._client_mode = client_mode
        self._k = k
        self._alpha = alpha
        self._replicas = replicas
        self._request_timeout_s = request_timeout_s
        self._clock = clock
        self._own = NodeID.from_peer_id(node.peer_id)
        self._table = RoutingTable(self._own, k=k, rng=rng)
        self._records = RecordStore()
        self._sent = 0
        self._failed = 0
        self._refresh_interval_s = refresh_interval_s
        self._expire_interval_s = expire_interval_s
        self._refresh_rounds = _Rounds()
        self._expire_rounds = _Rounds()
        self._snapshots_built = 0
        self._republish_interval_s = republish_interval_s
        self._republish_rounds = _Rounds()
        self._rng = rng
        self._topics: dict[str, Topic] = {}
        self._topic_scopes: dict[str, trio.CancelScope] = {}
        self._handed_off = 0
        self._cached = 0
        self._service = DHTService(
            peer_id=node.peer_id,
            table=self._table,
            records=self._records,
            topics=self._topics,
            k=k,
            clock=clock,
            observe=self._observe,
        )

    @property
    def peer_id(self) -> PeerID:
        return self._node.peer_id

    @property
    def listen_multiaddr(self) -> Multiaddr:
        return self._node.listen_multiaddr

    @property
    def announce_multiaddr(self) -> Multiaddr:
        """The address other nodes are told to dial: ``announce`` if given, else where this
        node listens."""
        return self._announce if self._announce is not None else self._node.listen_multiaddr

    @property
    def node(self) -> Node:
        """The transport node under this DHT node (to dial peers for other services)."""
        return self._node

    @property
    def client_mode(self) -> bool:
        return self._client_mode

    @property
    def routing_table(self) -> RoutingTable:
        """Read it, don't change it: the node owns it."""
        return self._table

    def statistics(self) -> DHTStatistics:
        return DHTStatistics(
            routing=self._table.statistics(),
            records=self._records.statistics(),
            requests_served=self._service.served,
            requests_sent=self._sent,
            requests_failed=self._failed,
            refresh_rounds=self._refresh_rounds.finished,
            expire_rounds=self._expire_rounds.finished,
            republish_rounds=self._republish_rounds.finished,
            records_handed_off=self._handed_off,
            records_cached=self._cached,
        )

    async def wait_refresh_rounds(self, n: int = 1) -> None:
        """Wait until ``n`` more bucket-refresh rounds have finished."""
        if self._refresh_interval_s is None:
            raise RuntimeError("bucket refresh is disabled (refresh_interval_s=None)")
        await self._refresh_rounds.wait(n)

    async def wait_republish_rounds(self, n: int = 1) -> None:
        """Wait until ``n`` more republishing rounds have finished."""
        if self._republish_interval_s is None:
            raise RuntimeError("republishing is disabled (republish_interval_s=None)")
        await self._republish_rounds.wait(n)

    async def wait_expire_rounds(self, n: int = 1) -> None:
        """Wait until ``n`` more sweeps of expired records have finished."""
        if self._expire_interval_s is None:
            raise RuntimeError("expiry sweeps are disabled (expire_interval_s=None)")
        await self._expire_rounds.wait(n)

    # -- client API ------------------------------------------------------------------------------

    async def store(
        self,
        key: str,
        value: bytes,
        expiration: float,
        *,
        subkey: str | None = None,
        signed: bool = False,
    ) -> int:
        """Store ``value`` under ``key`` (and ``subkey``) until ``expiration`` (absolute, on the
        node's clock) on the ``replicas`` nodes nearest the key, and here unless in client mode.

        ``signed=True`` files it under our own PeerID as subkey, signed.  Returns how many remote
        nodes accepted it.
        """
        if signed:
            if subkey is not None:
                raise ValueError("a signed record's subkey is our PeerID; pass no subkey")
            record = Record.signed(self._node.identity, key, value, expiration)
        else:
            record = Record(key, subkey, value, expiration)
        return await self._store_record(record)

    async def _store_record(self, record: Record) -> int:
        if not self._client_mode:
            self._records.store(record, self._clock())
        result = await self._lookup(NodeID.from_key(record.key), want_value=None)
        return await self._store_at(result.contacts[: self._replicas], [record])

    async def _store_at(self, contacts: Sequence[Contact], records: Sequence[Record]) -> int:
        """Send ``records`` to each of ``contacts``; how many accepted them all."""
        accepted = 0
        encoded = [encode_record(record) for record in records[:MAX_RECORDS_PER_REQUEST]]

        async def store_at(contact: Contact) -> None:
            nonlocal accepted
            reply = await self._request(contact, "dht.store", {"records": encoded})
            if reply is None:
                return
            results = reply.get("results")
            if isinstance(results, list) and results == [None] * len(encoded):
                accepted += 1

        async with trio.open_nursery() as nursery:
            for contact in contacts:
                nursery.start_soon(store_at, contact)
        return accepted

    async def get(self, key: str, *, latest: bool = False) -> StoredValue | None:
        """What the network (and our own store) holds for ``key``, merged, or None.

        ``latest=False`` stops at the first node that has the key; ``latest=True`` asks all the
        ``k`` nearest nodes and merges everything (the newest entry of every subkey).
        """
        result = await self._lookup(
            NodeID.from_key(key), want_value=key, stop_after_values=None if latest else 1
        )
        now = self._clock()
        if result.value is not None and result.without_value:
            # Kademlia's caching along the path: the nearest node that replied without the value
            # gets it, so the next reader stops sooner.  Signed records travel as signed.
            self._cached += 1
            records = list(result.value.records(key))
            self._nursery.start_soon(self._store_at, result.without_value[:1], records)
        found = merge(result.value, self._records.get(key, now))
        if found is None:
            return None
        live = {s: e for s, e in found.entries.items() if e.expiration > now}
        return StoredValue(live) if live else None

    async def announce(self, prefix: str, info: ServerInfo, *, expiration: float) -> int:
        """Announce ``info`` under ``f"{prefix}.{block}"`` for each block it serves, signed (so
        filed under our PeerID) and valid until ``expiration`` (absolute, on the node's clock).

        Blocks are stored concurrently; returns for how many at least one remote node accepted.
        A later announcement replaces an earlier one only if it expires later.  Client-mode nodes
        may announce too (a server behind NAT would), though nobody can connect back to them.
        """
        value = info.to_bytes()
        announced = 0
        topic = self._topics.get(prefix)

        async def announce_block(block: int) -> None:
            nonlocal announced
            record = Record.signed(self._node.identity, f"{prefix}.{block}", value, expiration)
            if topic is not None:
                for push in topic.publish(record):
                    topic.send_soon(push)
            if await self._store_record(record):
                announced += 1

        async with trio.open_nursery() as nursery:
            for block in range(info.start_block, info.end_block):
                nursery.start_soon(announce_block, block)
        return announced

    async def get_servers(self, prefix: str, blocks: Iterable[int]) -> PeerTableSnapshot:
        """The servers announcing each of ``blocks`` under ``prefix``, looked up concurrently.

        Announcements that are OFFLINE, do not decode or do not cover their block are left out
        (see :func:`build_snapshot`).  Each snapshot has a higher ``version`` than the last.
        """
        records = await self._fetch_records(prefix, blocks)
        now = self._clock()
        found = RecordStore()
        for record in records:
            found.store(record, now)  # checks the signatures once more; cheap
        self._snapshots_built += 1
        return build_snapshot(found, prefix, now, version=self._snapshots_built)

    async def _fetch_records(self, prefix: str, blocks: Iterable[int]) -> list[Record]:
        records: list[Record] = []

        async def get_block(block: int) -> None:
            key = f"{prefix}.{block}"
            value = await self.get(key, latest=True)
            if value is not None:
                records.extend(value.records(key))

        async with trio.open_nursery() as nursery:
            for block in dict.fromkeys(blocks):
                nursery.start_soon(get_block, block)
        return records

    # -- gossip ----------------------------------------------------------------------------------

    def follow(
        self,
        prefix: str,
        num_blocks: int,
        *,
        update_period_s: float = 60.0,
        gossip_interval_s: float = 1.0,
        fanout: int = 3,
    ) -> Topic:
        """Follow the servers of the model ``prefix`` (blocks ``0 .. num_blocks - 1``): read
        their announcements from the DHT every ``update_period_s`` and gossip them every
        ``gossip_interval_s``, so that a new or departed server shows within seconds.

        Returns the :class:`Topic` whose :meth:`~Topic.snapshot` routing reads; following the
        same prefix again returns the same topic.  The loops run until the node closes or
        :meth:`unfollow` is called.
        """
        topic = self._topics.get(prefix)
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
        store = RecordStore()
        gossip = Gossip(
            str(self.peer_id),
            store,
            prefix=prefix,
            rng=self._rng,
            fanout=fanout,
            interval_s=gossip_interval_s,
        )
        topic = Topic(
            self,
            self._nursery,
            prefix=prefix,
            num_blocks=num_blocks,
            gossip=gossip,
            store=store,
            clock=self._clock,
            rng=self._rng,
        )
        self._topics[prefix] = topic
        scope = self._topic_scopes[prefix] = trio.CancelScope()
        self._nursery.start_soon(self._run_topic, topic, scope, update_period_s, gossip_interval_s)
        return topic

    def unfollow(self, prefix: str) -> None:
        """Stop following ``prefix`` (nothing if it is not followed): its reads and gossip stop,
        and gossip about it is no longer answered.  Following it again starts afresh."""
        self._topics.pop(prefix, None)
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

    # -- lookups ---------------------------------------------------------------------------------

    async def _lookup(
        self, target: NodeID, *, want_value: str | None, stop_after_values: int | None = None
    ) -> LookupResult:
        self._table.mark_bucket_used(target, self._clock())
        lookup = Lookup(
            target,
            self._table.closest(target, self._k),
            k=self._k,
            alpha=self._alpha,
            query_timeout_s=self._request_timeout_s,
            want_value=want_value,
            stop_after_values=stop_after_values if want_value is not None else None,
            own=self._own,
        )
        send, receive = trio.open_memory_channel[tuple[Contact, dict[str, Any] | None]](math.inf)
        async with trio.open_nursery() as nursery:

            def launch(queries: Iterable[Any]) -> None:
                for query in queries:
                    nursery.start_soon(ask, query.contact)

            async def ask(contact: Contact) -> None:
                if want_value is None:
                    request = {"target": target.to_bytes()}
                    reply = await self._request(contact, "dht.find_node", request)
                else:
                    reply = await self._request(contact, "dht.find_value", {"key": want_value})
                send.send_nowait((contact, reply))

            launch(lookup.start(self._clock()))
            while not lookup.done:
                deadline = lookup.next_deadline()
                if deadline is None:
                    break  # nothing in flight and nothing left to ask
                wait_until = trio.current_time() + max(0.0, deadline - self._clock())
                with trio.move_on_at(wait_until):
                    contact, reply = await receive.receive()
                    launch(self._feed(lookup, contact, reply))
                    continue
                launch(lookup.on_timeout(self._clock()))
            nursery.cancel_scope.cancel()
        return lookup.result()

    def _feed(self, lookup: Lookup, contact: Contact, reply: dict[str, Any] | None) -> list[Any]:
        now = self._clock()
        if reply is None:
            return lookup.on_failure(contact.node_id, now)
        try:
            contacts = decode_contacts_untrusted(reply.get("contacts"), now)
            records = None
            if lookup.want_value is not None:
                records = decode_records_untrusted(
                    reply.get("records", []), limit=MAX_RECORDS_PER_REPLY
                )
        except CodecError:
            self._table.failed(contact.node_id, now)
            return lookup.on_failure(contact.node_id, now)
        return lookup.on_reply(contact.node_id, contacts, records, now)

    # -- requests --------------------------------------------------------------------------------

    def set_reach(self, *, dialable: bool, announce: Multiaddr | None = None) -> None:
        """What a reachability check found: a node others cannot dial (behind a NAT) asks as a
        client does, staying out of others' routing tables; ``announce`` (when given) is the
        address they can dial, e.g. a NAT's forwarded port."""
        self._dialable = dialable
        if announce is not None:
            self._announce = announce

    def _identify(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._client_mode or not self._dialable:
            request["client"] = True
        else:
            request["address"] = str(self.announce_multiaddr)
        return request

    async def _request(
        self, contact: Contact, method: str, request: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Call ``method`` on ``contact``; None (and the contact dropped) if it failed."""
        reply = await self._call(contact.address, method, request)
        now = self._clock()
        if reply is None:
            self._table.failed(contact.node_id, now)
            return None
        self._observe(contact, now)
        return reply

    async def _call(
        self, address: Multiaddr | str | list[Multiaddr], method: str, request: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Call ``method`` at ``address`` (or the first of a peer's addresses to answer)
        within the request timeout; None if it failed."""
        self._sent += 1
        with trio.move_on_after(self._request_timeout_s):
            try:
                if isinstance(address, list):
                    connection = await self._node.connect_any(address)
                else:
                    connection = await self._node.connect(address)
                return await call_unary(connection, method, self._identify(request))
            except TransportError as exc:
                logger.debug("%s to %s failed: %s", method, address, exc)
        self._failed += 1
        return None

    def _observe(self, contact: Contact, now: float) -> None:
        known = contact.node_id in self._table
        action = self._table.observe(contact, now)
        if isinstance(action, PingOldest):
            self._nursery.start_soon(self._ping_oldest, action.contact)
        if not known and contact.node_id in self._table and not self._client_mode:
            self._nursery.start_soon(self._hand_off, contact)

    async def _hand_off(self, contact: Contact) -> None:
        """A node joined our table: give it the records it is now among the nearest for."""
        now = self._clock()
        records: list[Record] = []
        for key in self._records.keys(now):
            nearest = self._table.closest(NodeID.from_key(key), self._replicas)
            if any(c.node_id == contact.node_id for c in nearest):
                held = self._records.get(key, now)
                if held is not None:
                    records.extend(held.records(key))
        for start in range(0, len(records), MAX_RECORDS_PER_REQUEST):
            batch = records[start : start + MAX_RECORDS_PER_REQUEST]
            if await self._store_at([contact], batch):
                self._handed_off += len(batch)

    async def _ping_oldest(self, contact: Contact) -> None:
        alive = await self._call(contact.address, "dht.ping", {}) is not None
        self._table.ping_result(contact.node_id, alive, self._clock())

    async def _bootstrap(self, initial_peers: Sequence[str]) -> None:
        addresses = [Multiaddr.parse(text) for text in initial_peers]
        errors: list[str] = []

        async def ping(address: Multiaddr) -> None:
            with trio.move_on_after(self._request_timeout_s):
                try:
                    connection = await self._node.connect(address)
                    await call_unary(connection, "dht.ping", self._identify({}))
                except TransportError as exc:
                    errors.append(f"{address}: {type(exc).__name__}: {exc}")
                    return
                contact = Contact.from_peer_id(
                    connection.peer_id,
                    str(address.with_peer_id(connection.peer_id)),
                    last_seen=self._clock(),
                )
                self._observe(contact, self._clock())
                return
            errors.append(f"{address}: no answer within {self._request_timeout_s} s")

        async with trio.open_nursery() as nursery:
            for address in addresses:
                nursery.start_soon(ping, address)
        if not len(self._table):
            raise PeerUnreachable(
                f"none of the initial peers answered: {'; '.join(errors) or 'no peers given'}"
            )
        if not self._client_mode:
            # Kademlia's join: the nodes near our own id learn of us, and we of them.  A
            # client-mode node is in no one's table and stores nothing, so it skips this (a
            # round trip or two to peers it may never need); its own lookups teach it the
            # peers it asks.
            await self._lookup(self._own, want_value=None)

    # -- maintenance -----------------------------------------------------------------------------

    async def _expire_forever(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            dropped = self._records.expire(self._clock())
            if dropped:
                logger.debug("dropped %d expired entries", dropped)
            self._expire_rounds.finish()

    async def _refresh_forever(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            targets = self._table.buckets_needing_refresh(self._clock(), interval_s)
            async with trio.open_nursery() as nursery:
                for target in targets:
                    nursery.start_soon(self._refresh, target)
            self._refresh_rounds.finish()

    async def _republish_forever(self, interval_s: float) -> None:
        """Kademlia's republishing: every record held goes again to the nodes nearest its key,
        so records outlive the nodes that held them (until they expire)."""
        limiter = trio.CapacityLimiter(8)
        while True:
            await trio.sleep(interval_s)
            async with trio.open_nursery() as nursery:
                for key in self._records.keys(self._clock()):
                    nursery.start_soon(self._republish, key, limiter)
            self._republish_rounds.finish()

    async def _republish(self, key: str, limiter: trio.CapacityLimiter) -> None:
        async with limiter:
            held = self._records.get(key, self._clock())
            if held is None:
                return
            try:
                result = await self._lookup(NodeID.from_key(key), want_value=None)
                await self._store_at(result.contacts[: self._replicas], held.records(key))
            except Exception:
                logger.warning("republishing %r failed", key, exc_info=True)

    async def _refresh(self, target: NodeID) -> None:
        try:
            await self._lookup(target, want_value=None)
        except Exception:
            # A refresh is best effort: the bucket stays due and the next round retries it.
            logger.warning("refreshing the bucket of %s failed", target, exc_info=True)


@asynccontextmanager
async def open_dht_node(
    *,
    identity: Identity | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    initial_peers: Sequence[str] = (),
    client_mode: bool = False,
    k: int = 20,
    alpha: int = 3,
    replicas: int = 5,
    request_timeout_s: float = 5.0,
    transport_config: TransportConfig | None = None,
    clock: Callable[[], float] = time.time,
    rng: random.Random | None = None,
    refresh_interval_s: float | None = 60.0,
    expire_interval_s: float | None = 30.0,
    republish_interval_s: float | None = 3600.0,
    node: Node | None = None,
    handlers: Handlers | None = None,
    announce: Multiaddr | None = None,
    relay: RelayLimits | None = None,
    dialable: bool = True,
) -> AsyncIterator[DHTNode]:
    """A DHT node listening on ``host:port``, joined through ``initial_peers`` (multiaddrs).

    With no initial peers it starts a new network.  If none of them answers, raises
    :class:`PeerUnreachable` naming them.  ``client_mode`` nodes serve nothing and never enter
    other nodes' routing tables.  ``clock`` is the wall clock of record expirations (see the
    module docstring).  Buckets unused for ``refresh_interval_s`` are refreshed and expired
    records swept every ``expire_interval_s``, and every record held is republished to the
    nodes nearest its key every ``republish_interval_s``; None turns any of them off.

    To run other services on the same transport node (a server does), open the node yourself
    and pass it as ``node`` (it is then left open), with their ``handlers``: the DHT node serves
    its own methods and theirs.  ``host``, ``port``, ``identity`` and ``transport_config`` are
    then unused.

    ``announce`` is the address other nodes are told to dial instead of the listen address: a
    node behind port forwarding gives the outside address, so that its contacts in others'
    routing tables are ones they can reach.

    With ``relay``, the node relays for peers that cannot be dialled, within those limits (see
    :class:`~petals_core.transport.RelayService`).  ``dialable=False`` keeps the node out of
    others' routing tables (it asks as a client does, serving all the same) until
    :meth:`DHTNode.set_reach` says peers can dial it: a node that does not know yet whether it
    sits behind a NAT should not hand out an address nobody can dial.
    """
    if replicas < 1:
        raise ConfigError(f"replicas must be at least 1, got {replicas}")
    if not request_timeout_s > 0:
        raise ConfigError(f"request_timeout_s must be positive, got {request_timeout_s}")
    for name, interval in [
        ("refresh_interval_s", refresh_interval_s),
        ("expire_interval_s", expire_interval_s),
        ("republish_interval_s", republish_interval_s),
    ]:
        if interval is not None and not interval > 0:
            raise ConfigError(f"{name} must be positive or None, got {interval}")
    async with AsyncExitStack() as stack:
        if node is None:
            node = await stack.enter_async_context(
                open_node(identity, host=host, port=port, config=transport_config)
            )
        # The block's own exception (or the bootstrap's) is raised as it is, not wrapped in the
        # nursery's group.
        async with open_block_nursery() as nursery:
            try:
                dht = DHTNode(
                    node,
                    nursery,
                    client_mode=client_mode,
                    k=k,
                    alpha=alpha,
                    replicas=replicas,
                    request_timeout_s=request_timeout_s,
                    clock=clock,
                    rng=rng if rng is not None else random.Random(),
                    refresh_interval_s=refresh_interval_s,
                    expire_interval_s=expire_interval_s,
                    republish_interval_s=republish_interval_s,
                    announce=announce,
                    dialable=dialable,
                )
                served = dht._service.handlers()
                served.add_unary(DIAL_BACK, DialBack(node, request_timeout_s))
                served.add_stream(SPEED_TEST, SpeedTest(request_timeout_s))
                served.include(dht.punch.handlers())
                if relay is not None:
                    dht.relay = RelayService.on(node, relay)
                    served.include(dht.relay.handlers())
                if handlers is not None:
                    served.include(handlers)
                if not client_mode or handlers is not None:
                    await nursery.start(serve_rpc, node, served)
                if initial_peers:
                    await dht._bootstrap(initial_peers)
                if expire_interval_s is not None:
                    nursery.start_soon(dht._expire_forever, expire_interval_s)
                if refresh_interval_s is not None:
                    nursery.start_soon(dht._refresh_forever, refresh_interval_s)
                if republish_interval_s is not None and not client_mode:
                    nursery.start_soon(dht._republish_forever, republish_interval_s)
                yield dht
            finally:
                nursery.cancel_scope.cancel()
