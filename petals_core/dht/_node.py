"""The DHT node: a trio driver that runs the sans-IO cores over the transport's RPC.

It serves the ``dht.*`` RPCs (:class:`DHTService`), and offers ``store`` / ``get`` built on
iterative :class:`Lookup` s.  Everything it starts lives in the
nursery of :func:`open_dht_node`: nothing outlives that block.

On top of those, servers ``announce`` a :class:`ServerInfo` under ``f"{prefix}.{block}"`` for each
block they serve, signed so that only they can file or replace it, and anyone reads them back
with ``get_servers`` as a :class:`PeerTableSnapshot` or ``follow`` s a model by gossip (the peer
table: :class:`~petals_core.dht._peer_table.PeerTable`).

Two clocks, on purpose:

- ``clock`` (default :func:`time.time`) is wall time, the ``now`` of records, routing-table
  ``last_seen`` and lookups: record expirations are absolute and shared between machines, so they
  need a clock that every machine agrees on.  Tests inject a clock to expire records at will.
- ``trio.current_time()`` bounds waiting (request timeouts, lookup deadlines).

Maintenance (expiry sweeps, bucket refresh, republishing, hand-off of records to nodes that join;
:class:`~petals_core.dht._maintenance.Maintenance`) runs in the same nursery.

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
from typing import Any, Final

import attrs
import trio

from .._errors import CodecError, ConfigError, PeerUnreachable, TransportError
from .._groups import open_block_nursery
from ..transport import (
    Connection,
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
from ._gossip import PeerTableSnapshot
from ._lookup import Lookup, LookupResult
from ._maintenance import Maintenance
from ._messages import (
    MAX_RECORDS_PER_REPLY,
    MAX_RECORDS_PER_REQUEST,
    decode_contacts_untrusted,
    decode_records_untrusted,
    seen_from,
)
from ._peer_table import PeerTable
from ._reachability import DIAL_BACK, DialBack
from ._record_store import RecordStore, RecordStoreStatistics
from ._records import Record, ServerInfo, StoredValue, encode_record, merge
from ._routing import Contact, NodeID, PingOldest, RoutingTable, RoutingTableStatistics
from ._serving import DHTService
from ._speed_test import SPEED_TEST, SpeedTest
from ._topic import Topic

__all__ = ["DHTNode", "DHTStatistics", "open_dht_node"]

logger = logging.getLogger(__name__)

#: The default bound of a whole lookup: this long, or this many request timeouts if longer.
LOOKUP_TIMEOUT_S: Final = 30.0
LOOKUP_ROUNDS: Final = 6

#: Handed the records under the key of each node's reply to a lookup as it arrives (unchecked).
OnRecords = Callable[[Sequence[Record]], None]


@attrs.frozen(kw_only=True)
class DHTStatistics:
    routing: RoutingTableStatistics
    records: RecordStoreStatistics
    requests_served: int
    #: Requests from server-mode callers whose address was not where they called from (or
    #: who called through a relay): served, but not noted in the routing table.
    callers_not_noted: int
    requests_sent: int
    requests_failed: int
    refresh_rounds: int
    expire_rounds: int
    republish_rounds: int
    #: Records given to nodes that joined nearer their keys than others.
    records_handed_off: int
    #: Values found by a get and cached at the nearest node on the path that lacked them.
    records_cached: int


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
        lookup_timeout_s: float,
        clock: Callable[[], float],
        rng: random.Random,
        announce: Multiaddr | None = None,
        dialable: bool = True,
    ) -> None:
        #: The transport node under this DHT node (to dial peers for other services).
        self.node: Final = node
        self._announce = announce
        self._dialable = dialable
        #: The ``nat.punch`` service (the node punches holes for dialers reaching it by relay).
        self.punch = PunchService(node)
        #: The relay service, when this node relays for others.
        self.relay: RelayService | None = None
        self._nursery = nursery
        self.client_mode: Final = client_mode
        self._k = k
        self._alpha = alpha
        self._replicas = replicas
        self._request_timeout_s = request_timeout_s
        self._lookup_timeout_s = lookup_timeout_s
        self._clock = clock
        self._own = NodeID.from_peer_id(node.peer_id)
        #: Read it, don't change it: the node owns it.
        self.routing_table: Final = RoutingTable(self._own, k=k, rng=rng)
        self._records = RecordStore()
        self._sent = 0
        self._failed = 0
        self._cached = 0
        self._peer_table = PeerTable(self, nursery, clock=clock, rng=rng)
        self._maintenance = Maintenance(
            table=self.routing_table,
            records=self._records,
            clock=clock,
            replicas=replicas,
            lookup=lambda target: self._lookup(target, want_value=None),
            store_at=self._store_at,
        )
        self._service = DHTService(
            peer_id=node.peer_id,
            table=self.routing_table,
            records=self._records,
            topics=self._peer_table.topics,
            k=k,
            clock=clock,
            observe=self._observe,
        )

    @property
    def peer_id(self) -> PeerID:
        return self.node.peer_id

    @property
    def listen_multiaddr(self) -> Multiaddr:
        return self.node.listen_multiaddr

    @property
    def announce_multiaddr(self) -> Multiaddr:
        """The address other nodes are told to dial: ``announce`` if given, else where this
        node listens."""
        return self._announce if self._announce is not None else self.node.listen_multiaddr

    def statistics(self) -> DHTStatistics:
        return DHTStatistics(
            routing=self.routing_table.statistics(),
            records=self._records.statistics(),
            requests_served=self._service.served,
            callers_not_noted=self._service.unnoted,
            requests_sent=self._sent,
            requests_failed=self._failed,
            refresh_rounds=self._maintenance.refresh_rounds,
            expire_rounds=self._maintenance.expire_rounds,
            republish_rounds=self._maintenance.republish_rounds,
            records_handed_off=self._maintenance.handed_off,
            records_cached=self._cached,
        )

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
            record = Record.signed(self.node.identity, key, value, expiration)
        else:
            record = Record(key, subkey, value, expiration)
        return await self._store_record(record)

    async def _store_record(self, record: Record) -> int:
        if not self.client_mode:
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

    async def get(
        self,
        key: str,
        *,
        latest: bool = False,
        on_records: OnRecords | None = None,
    ) -> StoredValue | None:
        """What the network (and our own store) holds for ``key``, merged, or None.

        ``latest=False`` stops at the first node that has the key; ``latest=True`` asks all the
        ``k`` nearest nodes and merges everything (the newest entry of every subkey).
        ``on_records`` is handed the records under ``key`` of each node's reply as it arrives
        (unchecked: its receiver checks them), before the lookup ends.
        """
        result = await self._lookup(
            NodeID.from_key(key),
            want_value=key,
            stop_after_values=None if latest else 1,
            on_records=on_records,
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

    async def _fetch_records(
        self,
        prefix: str,
        blocks: Iterable[int],
        *,
        on_records: OnRecords | None = None,
    ) -> list[Record]:
        """The records held under ``f"{prefix}.{block}"`` for each of ``blocks``, looked up
        concurrently with ``get(latest=True)``; ``on_records`` as for :meth:`get`."""
        records: list[Record] = []

        async def get_block(block: int) -> None:
            key = f"{prefix}.{block}"
            value = await self.get(key, latest=True, on_records=on_records)
            if value is not None:
                records.extend(value.records(key))

        async with trio.open_nursery() as nursery:
            for block in dict.fromkeys(blocks):
                nursery.start_soon(get_block, block)
        return records

    # -- the peer table --------------------------------------------------------------------------

    async def announce(self, prefix: str, info: ServerInfo, *, expiration: float) -> int:
        """Announce ``info`` under ``f"{prefix}.{block}"`` for each block it serves, signed (so
        filed under our PeerID) and valid until ``expiration`` (absolute, on the node's clock).

        Blocks are stored concurrently; returns for how many at least one remote node accepted.
        A later announcement replaces an earlier one only if it expires later.  Client-mode nodes
        may announce too (a server behind NAT would), though nobody can connect back to them.
        """
        return await self._peer_table.announce(prefix, info, expiration=expiration)

    async def get_servers(self, prefix: str, blocks: Iterable[int]) -> PeerTableSnapshot:
        """The servers announcing each of ``blocks`` under ``prefix``, looked up concurrently.

        Announcements that are OFFLINE, do not decode or do not cover their block are left out
        (see :func:`build_snapshot`).  Each snapshot has a higher ``version`` than the last.
        """
        return await self._peer_table.get_servers(prefix, blocks)

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
        return self._peer_table.follow(
            prefix,
            num_blocks,
            update_period_s=update_period_s,
            gossip_interval_s=gossip_interval_s,
            fanout=fanout,
        )

    def unfollow(self, prefix: str) -> None:
        """Stop following ``prefix`` (nothing if it is not followed): its reads and gossip stop,
        and gossip about it is no longer answered.  Following it again starts afresh."""
        self._peer_table.unfollow(prefix)

    # -- lookups ---------------------------------------------------------------------------------

    async def _lookup(
        self,
        target: NodeID,
        *,
        want_value: str | None,
        stop_after_values: int | None = None,
        on_records: OnRecords | None = None,
    ) -> LookupResult:
        self.routing_table.mark_bucket_used(target, self._clock())
        lookup = Lookup(
            target,
            self.routing_table.closest(target, self._k),
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
            # On trio's clock, which no change of the wall clock moves.
            with trio.move_on_after(self._lookup_timeout_s) as budget:
                while not lookup.done:
                    deadline = lookup.next_deadline()
                    if deadline is None:
                        break  # nothing in flight and nothing left to ask
                    wait_until = trio.current_time() + max(0.0, deadline - self._clock())
                    with trio.move_on_at(wait_until):
                        contact, reply = await receive.receive()
                        launch(self._feed(lookup, contact, reply, on_records))
                        continue
                    launch(lookup.on_timeout(self._clock()))
            if budget.cancelled_caught:
                lookup.give_up()
                statistics = lookup.statistics()
                logger.warning(
                    "a lookup of %s ran out of time (%g s): %d queries, %d answered, %d failed, "
                    "%d unanswered",
                    want_value if want_value is not None else f"node {target}",
                    self._lookup_timeout_s,
                    statistics.messages,
                    statistics.replied,
                    statistics.failed,
                    statistics.in_flight,
                )
            nursery.cancel_scope.cancel()
        return lookup.result()

    def _feed(
        self,
        lookup: Lookup,
        contact: Contact,
        reply: dict[str, Any] | None,
        on_records: OnRecords | None = None,
    ) -> list[Any]:
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
            self.routing_table.failed(contact.node_id, now)
            return lookup.on_failure(contact.node_id, now)
        if records and on_records is not None:
            under_key = [record for record in records if record.key == lookup.want_value]
            if under_key:
                on_records(under_key)
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
        if self.client_mode or not self._dialable:
            request["client"] = True
        else:
            request["address"] = str(self.announce_multiaddr)
        return request

    async def _request(
        self, contact: Contact, method: str, request: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Call ``method`` on ``contact``; None (and the contact dropped) if it failed.  It is
        noted as :func:`seen_from` places it, from the host that answered (a live connection
        to that peer answers whatever address was named for it); through a relay, only at
        that relayed address."""
        reply, connection = await self._reach(contact.address, method, request)
        now = self._clock()
        if reply is None or connection is None:
            self.routing_table.failed(contact.node_id, now)
            return None
        if connection.is_relayed:
            same = connection.relay is not None and contact.address == str(connection.multiaddr)
            noted = contact if same else None
        else:
            noted = seen_from(contact, connection.address[0])
        if noted is not None:
            self._observe(noted, now)
        return reply

    async def _call(
        self, address: Multiaddr | str | list[Multiaddr], method: str, request: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Call ``method`` at ``address`` (or the first of a peer's addresses to answer)
        within the request timeout; None if it failed."""
        return (await self._reach(address, method, request))[0]

    async def _reach(
        self, address: Multiaddr | str | list[Multiaddr], method: str, request: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, Connection | None]:
        """``_call``, with the connection that answered."""
        self._sent += 1
        with trio.move_on_after(self._request_timeout_s):
            try:
                if isinstance(address, list):
                    connection = await self.node.connect_any(address)
                else:
                    connection = await self.node.connect(address)
                return await call_unary(connection, method, self._identify(request)), connection
            except TransportError as exc:
                logger.debug("%s to %s failed: %s", method, address, exc)
        self._failed += 1
        return None, None

    def _observe(self, contact: Contact, now: float) -> None:
        known = contact.node_id in self.routing_table
        action = self.routing_table.observe(contact, now)
        if isinstance(action, PingOldest):
            self._nursery.start_soon(self._ping_oldest, action.contact)
        if not known and contact.node_id in self.routing_table and not self.client_mode:
            self._nursery.start_soon(self._maintenance.hand_off, contact)

    async def _ping_oldest(self, contact: Contact) -> None:
        alive = await self._call(contact.address, "dht.ping", {}) is not None
        self.routing_table.ping_result(contact.node_id, alive, self._clock())

    async def _bootstrap(self, initial_peers: Sequence[str]) -> None:
        addresses = [Multiaddr.parse(text) for text in initial_peers]
        errors: list[str] = []

        async def ping(address: Multiaddr) -> None:
            with trio.move_on_after(self._request_timeout_s):
                try:
                    connection = await self.node.connect(address)
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
        if not len(self.routing_table):
            raise PeerUnreachable(
                f"none of the initial peers answered: {'; '.join(errors) or 'no peers given'}"
            )
        if not self.client_mode:
            # Kademlia's join: the nodes near our own id learn of us, and we of them.  A
            # client-mode node is in no one's table and stores nothing, so it skips this (a
            # round trip or two to peers it may never need); its own lookups teach it the
            # peers it asks.
            await self._lookup(self._own, want_value=None)


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
    lookup_timeout_s: float | None = None,
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
    nodes nearest its key every ``republish_interval_s``; None turns any of them off.  A request
    unanswered after ``request_timeout_s`` fails; a lookup (of a key or a node) ends after
    ``lookup_timeout_s`` with what it found by then (None: 30 s, or six request timeouts if that
    is longer).

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
    if lookup_timeout_s is None:
        lookup_timeout_s = max(LOOKUP_TIMEOUT_S, LOOKUP_ROUNDS * request_timeout_s)
    for name, timeout in [
        ("request_timeout_s", request_timeout_s),
        ("lookup_timeout_s", lookup_timeout_s),
    ]:
        if not timeout > 0:
            raise ConfigError(f"{name} must be positive, got {timeout}")
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
                    lookup_timeout_s=lookup_timeout_s,
                    clock=clock,
                    rng=rng if rng is not None else random.Random(),
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
                    nursery.start_soon(dht._maintenance.expire_forever, expire_interval_s)
                if refresh_interval_s is not None:
                    nursery.start_soon(dht._maintenance.refresh_forever, refresh_interval_s)
                if republish_interval_s is not None and not client_mode:
                    nursery.start_soon(dht._maintenance.republish_forever, republish_interval_s)
                yield dht
            finally:
                nursery.cancel_scope.cancel()
