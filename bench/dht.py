"""DHT benchmark: the sans-IO cores (routing table, iterative lookup, gossip) over an in-memory
network in virtual time, for N = 1,000 and N = 10,000 nodes in one process.

The network: a heap of events on a virtual clock.  Each node has an access delay of 10-100 ms, a
link's one-way latency is the sum of its two ends' (20-200 ms, stable per link), and every message
is lost with probability 1%.  A query to a node that left, or one whose request or reply is lost,
is noticed only by the lookup's timeout (2 s); the asker's routing table then drops that node
(``failed``).  Every request teaches the answerer about the asker and every reply teaches the
asker about the answerer (``observe``); a ``PingOldest`` is carried out over the same network.

- **Tables.**  Node IDs come from PeerIDs of seeded random 32-byte public keys (cheap; nothing
  here signs).  The starting tables are the ones Kademlia converges to: each bucket of each node
  observes up to ``k`` random nodes of its ID range (all of them where fewer).  A node that joins
  during the run starts from 3 random live nodes and looks up its own ID, the Kademlia join; it
  counts as a member once that lookup ends.
- **Lookups.**  FIND_NODE for a random target from a random member, ``k`` = 20, ``alpha`` = 3.
  Success: the nearest member to the target (among nodes that were members at the start and still
  are at the end) is in the result.  Also reported: how much of the true ``k`` nearest came back.
  While the lookups run, 20% of N nodes leave (stop answering, no goodbye) and as many join,
  evenly spread over the lookup phase.
- **Loss.**  The DHT rides on QUIC, so a lost datagram is resent after three round trips rather
  than losing the query; the ``loss drops`` row (N = 1,000) drops lost messages for good instead,
  and shows what the lookup alone makes of that (a dropped query fails its node for that lookup).
  Gossip messages lost are always dropped.
- **Announcement reach, without gossip.**  A record sits on the ``k`` members nearest its key at
  t = 0; 200 readers refresh every 30 s at a random phase with a FIND_VALUE lookup (stopping at
  the first copy; a reader that misses it tries again 30 s later).  Reported: when 99% of readers
  hold it.  No churn in this phase.
- **With gossip.**  The same 200 readers and the publisher form one topic (real :class:`Gossip`:
  fanout 3, interval 1 s, ttl 8) over the same kind of links; the publisher publishes at t = 0.

Run with ``nox -s bench -- dht``.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import time
from collections.abc import Callable
from typing import Any

import attrs

from petals_core.dht import Record, RecordStore
from petals_core.dht._gossip import Digest, Gossip, Push, Want
from petals_core.dht._lookup import Lookup, LookupResult, Query
from petals_core.dht._routing import NODE_ID_BITS, Contact, NodeID, PingOldest, RoutingTable
from petals_core.transport import PeerID
from petals_core.transport._identity import Identity

from ._report import percentile, print_table, summarize, write_json

T0 = 1_700_000_000.0  # the virtual clock starts here: records carry absolute expirations
PREFIX = "bench-model"
KEY = f"{PREFIX}.0"


@attrs.frozen(kw_only=True)
class SimConfig:
    nodes: int
    lookups: int
    #: Lookups start at this rate; the churn is spread over the same span.
    lookups_per_s: float = 10.0
    churn_fraction: float = 0.2
    k: int = 20
    alpha: int = 3
    query_timeout_s: float = 2.0
    loss: float = 0.01
    #: Lost DHT messages are resent after a timeout (QUIC); False drops them for good.
    retransmit: bool = True
    access_delay_s: tuple[float, float] = (0.010, 0.100)
    bootstrap_contacts: int = 3
    readers: int = 200
    poll_interval_s: float = 30.0
    gossip_fanout: int = 3
    gossip_interval_s: float = 1.0
    seed: int = 0


class _Clock:
    """Virtual time and a heap of callbacks."""

    def __init__(self) -> None:
        self.now = T0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._sequence = 0

    def at(self, when: float, callback: Callable[..., None], *args: Any) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (when, self._sequence, callback, args))

    def run(self, stop: Callable[[], bool] = lambda: False, until: float = math.inf) -> None:
        while self._events and not stop() and self._events[0][0] <= until:
            self.now, _, callback, args = heapq.heappop(self._events)
            callback(*args)


class _Running:
    __slots__ = ("finished", "lookup", "on_done", "origin", "outstanding")

    def __init__(self, origin: int, lookup: Lookup, on_done: Callable[[LookupResult], None]):
        self.origin = origin
        self.lookup = lookup
        self.on_done = on_done
        self.outstanding: dict[NodeID, float] = {}  # when each query in flight was sent
        self.finished = False


class _Network:
    """Nodes by index: their IDs, contacts, tables, access delays; who answers, who is a member."""

    def __init__(self, config: SimConfig, clock: _Clock, rng: random.Random) -> None:
        self.config = config
        self.clock = clock
        self.rng = rng
        self.ids: list[NodeID] = []
        self.contacts: list[Contact] = []
        self.tables: list[RoutingTable] = []
        self.delay: list[float] = []
        self.up: list[bool] = []  # answers messages
        self.joined_at: list[float] = []  # a member from then on; inf while joining
        self.index: dict[NodeID, int] = {}
        self.holders: set[int] = set()  # nodes that store the benchmark record
        self.record: Record | None = None

    def add_node(self) -> int:
        peer_id = PeerID.from_public_key(self.rng.randbytes(32))
        contact = Contact.from_peer_id(peer_id, f"/sim/{len(self.ids)}", last_seen=self.clock.now)
        node = len(self.ids)
        self.ids.append(contact.node_id)
        self.contacts.append(contact)
        self.tables.append(
            RoutingTable(contact.node_id, k=self.config.k, rng=random.Random(self.rng.random()))
        )
        self.delay.append(self.rng.uniform(*self.config.access_delay_s))
        self.up.append(True)
        self.joined_at.append(math.inf)
        self.index[contact.node_id] = node
        return node

    def members(self, since: float = math.inf) -> list[int]:
        return [n for n, t in enumerate(self.joined_at) if t <= since and self.up[n]]

    def fill_tables(self) -> None:
        """The converged tables: each bucket observes up to k random nodes of its range."""
        ordered = sorted(range(len(self.ids)), key=lambda n: self.ids[n].value)
        values = [self.ids[n].value for n in ordered]
        now = self.clock.now
        for node, own in enumerate(self.ids):
            table = self.tables[node]
            for bit in range(NODE_ID_BITS):
                low = ((own.value >> bit) ^ 1) << bit
                first = bisect.bisect_left(values, low)
                last = bisect.bisect_left(values, low + (1 << bit))
                if first == last:
                    continue
                span = range(first, last)
                for position in self.rng.sample(span, min(len(span), self.config.k)):
                    table.observe(self.contacts[ordered[position]], now)
            self.joined_at[node] = now

    def latency(self, a: int, b: int) -> float:
        return self.delay[a] + self.delay[b]

    def transit(self, a: int, b: int) -> float | None:
        """How long a message from ``a`` takes to reach ``b``, None if it never does.

        With ``retransmit`` (QUIC carries the DHT) a lost datagram costs one retransmission
        timeout, three round trips, and goes out again; without, it is gone.
        """
        latency = self.latency(a, b)
        delay = latency
        while self.rng.random() < self.config.loss:
            if not self.config.retransmit:
                return None
            delay += 6 * latency
        return delay if delay < self.config.query_timeout_s else None

    # Lookups

    def start_lookup(
        self,
        origin: int,
        target: NodeID,
        on_done: Callable[[LookupResult], None],
        *,
        want_value: str | None = None,
    ) -> None:
        config = self.config
        lookup = Lookup(
            target,
            self.tables[origin].closest(target, config.k),
            k=config.k,
            alpha=config.alpha,
            query_timeout_s=config.query_timeout_s,
            want_value=want_value,
            stop_after_values=1 if want_value is not None else None,
            own=self.ids[origin],
            # Without a transport that resends, a lost datagram would cost the node for good:
            # the lookup asks once more before giving up on it.
            max_attempts=1 if config.retransmit else 2,
        )
        running = _Running(origin, lookup, on_done)
        self._send(running, lookup.start(self.clock.now))

    def _send(self, running: _Running, queries: list[Query]) -> None:
        now = self.clock.now
        for query in queries:
            node_id = query.contact.node_id
            running.outstanding[node_id] = now
            self.clock.at(now + self.config.query_timeout_s, self._timeout, running)
            dest = self.index[node_id]
            delay = self.transit(running.origin, dest)
            if delay is not None:
                self.clock.at(now + delay, self._request, running, dest)
        self._check_done(running)

    def _request(self, running: _Running, dest: int) -> None:
        if not self.up[dest]:
            return
        origin = running.origin
        self._observe(dest, self.contacts[origin])
        lookup = running.lookup
        contacts = self.tables[dest].closest(lookup.target, self.config.k)
        records = None
        if lookup.want_value is not None and dest in self.holders and self.record is not None:
            records = [self.record]
        delay = self.transit(dest, origin)
        if delay is not None:
            self.clock.at(self.clock.now + delay, self._reply, running, dest, contacts, records)

    def _reply(
        self, running: _Running, dest: int, contacts: list[Contact], records: list[Record] | None
    ) -> None:
        node_id = self.ids[dest]
        if running.finished or node_id not in running.outstanding or not self.up[running.origin]:
            return
        del running.outstanding[node_id]
        self._observe(running.origin, self.contacts[dest])
        self._send(running, running.lookup.on_reply(node_id, contacts, records, self.clock.now))

    def _timeout(self, running: _Running) -> None:
        if running.finished:
            return
        now = self.clock.now
        expired = [
            node_id
            for node_id, sent_at in running.outstanding.items()
            if sent_at + self.config.query_timeout_s <= now
        ]
        if not expired:
            return
        for node_id in expired:
            del running.outstanding[node_id]
            self.tables[running.origin].failed(node_id, now)
        self._send(running, running.lookup.on_timeout(now))

    def _check_done(self, running: _Running) -> None:
        if running.lookup.done and not running.finished:
            running.finished = True
            running.on_done(running.lookup.result())

    # Pings of the oldest contact of a full bucket

    def _observe(self, node: int, contact: Contact) -> None:
        action = self.tables[node].observe(contact, self.clock.now)
        if isinstance(action, PingOldest):
            pinged = self.index[action.contact.node_id]
            there, back = self.transit(node, pinged), self.transit(pinged, node)
            alive = self.up[pinged] and there is not None and back is not None
            wait = there + back if there is not None and back is not None and alive else None
            if wait is None:
                wait = self.config.query_timeout_s
            self.clock.at(self.clock.now + wait, self._ping_result, node, pinged, alive)

    def _ping_result(self, node: int, pinged: int, alive: bool) -> None:
        if self.up[node]:
            self.tables[node].ping_result(self.ids[pinged], alive, self.clock.now)

    # Churn

    def leave(self, busy: set[int]) -> None:
        candidates = [n for n in self.members() if n not in busy]
        self.up[self.rng.choice(candidates)] = False

    def join(self) -> None:
        node = self.add_node()
        known = self.rng.sample(self.members(), self.config.bootstrap_contacts)
        for other in known:
            self.tables[node].observe(self.contacts[other], self.clock.now)

        def joined(result: LookupResult) -> None:
            self.joined_at[node] = self.clock.now

        self.start_lookup(node, self.ids[node], joined)


def _nearest(network: _Network, target: NodeID, nodes: list[int], count: int) -> list[NodeID]:
    goal = target.value
    best = heapq.nsmallest(count, nodes, key=lambda n: network.ids[n].value ^ goal)
    return [network.ids[n] for n in best]


def _lookup_phase(network: _Network, config: SimConfig) -> dict[str, Any]:
    clock, rng = network.clock, network.rng
    hops: list[int] = []
    messages: list[int] = []
    found_nearest: list[bool] = []
    recall: list[float] = []
    busy: set[int] = set()
    span_s = config.lookups / config.lookups_per_s
    churn = round(config.churn_fraction * config.nodes)
    start = clock.now
    for i in range(churn):
        clock.at(start + (i + 0.5) * span_s / churn, network.leave, busy)
        clock.at(start + (i + 0.5) * span_s / churn, network.join)

    def launch() -> None:
        origin = rng.choice(network.members())
        target = NodeID.random(rng)
        started = clock.now
        busy.add(origin)

        def done(result: LookupResult) -> None:
            busy.discard(origin)
            truth = network.members(since=started)
            nearest = _nearest(network, target, truth, config.k)
            got = {contact.node_id for contact in result.contacts}
            hops.append(result.hops)
            messages.append(result.messages)
            found_nearest.append(nearest[0] in got)
            recall.append(len(got.intersection(nearest)) / len(nearest))

        network.start_lookup(origin, target, done)

    for i in range(config.lookups):
        clock.at(start + i / config.lookups_per_s, launch)
    clock.run(stop=lambda: len(hops) == config.lookups)
    joins_done = sum(1 for t in network.joined_at[config.nodes :] if t < math.inf)
    return {
        "lookups": len(hops),
        "hops_p50": percentile(hops, 0.5),
        "hops_p99": percentile(hops, 0.99),
        "hops_target": math.log2(config.nodes) + 2,
        "success_rate": sum(found_nearest) / len(found_nearest),
        "k_nearest_recall": sum(recall) / len(recall),
        "messages_per_lookup_mean": sum(messages) / len(messages),
        "messages_per_lookup_p99": percentile(messages, 0.99),
        "nodes_left": churn,
        "nodes_joined": churn,
        "joins_completed": joins_done,
        "virtual_span_s": clock.now - start,
    }


def _poll_phase(network: _Network, config: SimConfig, readers: list[int]) -> float:
    """Seconds until 99% of ``readers`` found the record by their periodic FIND_VALUE."""
    clock, rng = network.clock, network.rng
    key_id = NodeID.from_key(KEY)
    network.holders = set(
        network.index[i] for i in _nearest(network, key_id, network.members(), config.k)
    )
    start = clock.now
    seen: list[float] = []

    def poll(reader: int) -> None:
        def done(result: LookupResult) -> None:
            if result.value is not None:
                seen.append(clock.now - start)
            else:
                clock.at(clock.now + config.poll_interval_s, poll, reader)

        network.start_lookup(reader, key_id, done, want_value=KEY)

    for reader in readers:
        clock.at(start + rng.uniform(0, config.poll_interval_s), poll, reader)
    needed = math.ceil(0.99 * len(readers))
    clock.run(stop=lambda: len(seen) >= needed)
    return sorted(seen)[needed - 1]


def _gossip_phase(
    network: _Network, config: SimConfig, readers: list[int], publisher: int
) -> float:
    """Seconds until 99% of ``readers`` hold the record, spread by gossip among the topic."""
    assert network.record is not None
    record = network.record
    clock = _Clock()
    clock.now = network.clock.now
    rng = random.Random(config.seed + 1)
    members = [publisher, *readers]
    name = {node: str(network.contacts[node].peer_id) for node in members}
    by_name = {peer: node for node, peer in name.items()}
    stores = {node: RecordStore() for node in members}
    nodes = {
        node: Gossip(
            name[node],
            stores[node],
            prefix=PREFIX,
            rng=random.Random(rng.random()),
            fanout=config.gossip_fanout,
            interval_s=config.gossip_interval_s,
        )
        for node in members
    }
    for gossip in nodes.values():
        for node in members:
            gossip.add_peer(name[node])
    reached: dict[int, float] = {}
    start = math.inf

    def send(sender: int, actions: list[Any]) -> None:
        for action in actions:
            if rng.random() >= config.loss:
                to = by_name[action.peer]
                clock.at(clock.now + network.latency(sender, to), deliver, to, sender, action)

    def tick(node: int) -> None:
        send(node, nodes[node].tick(clock.now))
        clock.at(nodes[node].next_deadline(), tick, node)

    def deliver(to: int, sender: int, action: Any) -> None:
        gossip, now = nodes[to], clock.now
        if isinstance(action, Digest):
            send(to, gossip.on_digest(name[sender], action.entries, now))
        elif isinstance(action, Want):
            send(to, gossip.on_want(name[sender], action.entries, now))
        elif isinstance(action, Push):
            send(to, gossip.on_push(name[sender], action.records, now, ttl=action.ttl))
            if to not in reached and stores[to].get(KEY, now) is not None:
                reached[to] = now - start

    for node in members:
        clock.at(clock.now + rng.uniform(0, config.gossip_interval_s), tick, node)
    clock.run(until=clock.now + 3 * config.gossip_interval_s)  # ticks settle into their phases
    start = clock.now
    send(publisher, nodes[publisher].publish(record, clock.now))
    needed = math.ceil(0.99 * len(readers))
    clock.run(stop=lambda: len(reached) >= needed, until=start + 600)
    return sorted(reached.values())[needed - 1] if len(reached) >= needed else math.inf


def simulate(config: SimConfig) -> dict[str, Any]:
    wall = time.perf_counter()
    rng = random.Random(config.seed)
    clock = _Clock()
    network = _Network(config, clock, rng)
    for _ in range(config.nodes):
        network.add_node()
    network.fill_tables()
    results = _lookup_phase(network, config)
    publisher_identity = Identity.from_private_bytes(rng.randbytes(32))
    network.record = Record.signed(publisher_identity, KEY, b"announcement", clock.now + 3600)
    members = network.members()
    chosen = rng.sample(members, config.readers + 1)
    publisher, readers = chosen[0], chosen[1:]
    results["reach99_without_gossip_s"] = _poll_phase(network, config, readers)
    results["reach99_with_gossip_s"] = _gossip_phase(network, config, readers, publisher)
    results["wall_s"] = time.perf_counter() - wall
    results["config"] = attrs.asdict(config)
    return results


CONFIGS = {
    "1000": SimConfig(nodes=1_000, lookups=2_000),
    "1000-drop": SimConfig(nodes=1_000, lookups=2_000, retransmit=False),
    "10000": SimConfig(nodes=10_000, lookups=1_000),
}


def main() -> None:
    results = {name: simulate(config) for name, config in CONFIGS.items()}
    rows = [
        (
            f"{r['config']['nodes']:,}" + ("" if r["config"]["retransmit"] else " (loss drops)"),
            r["lookups"],
            f"{r['hops_p50']} / {r['hops_p99']}",
            f"<= {r['hops_target']:.1f}",
            f"{100 * r['success_rate']:.2f}%",
            ">= 99.9%",
            f"{100 * r['k_nearest_recall']:.1f}%",
            f"{r['messages_per_lookup_mean']:.1f}",
            f"{r['reach99_with_gossip_s']:.2f}",
            f"{r['reach99_without_gossip_s']:.1f}",
            f"{r['wall_s']:.0f}",
        )
        for r in results.values()
    ]
    print_table(
        "DHT in memory: 20-200 ms links, 1% loss, 20% of N leaving and joining during lookups",
        [
            "N",
            "lookups",
            "hops p50/p99",
            "target",
            "success",
            "target",
            "k-nearest recall",
            "msgs/lookup",
            "reach 99% gossip s",
            "reach 99% polling s",
            "wall s",
        ],
        rows,
    )
    for name in ("1000", "10000"):
        r = results[name]
        nodes = f"N={r['config']['nodes']:,}"
        summarize(
            "dht",
            f"{nodes} lookup hops (p99), 1% loss, 20% churn",
            r["hops_p99"],
            unit="hops",
            target=f"<= log2(N)+2 = {r['hops_target']:.1f}",
            met=r["hops_p99"] <= r["hops_target"],
        )
        summarize(
            "dht",
            f"{nodes} lookups that found the nearest node",
            100 * r["success_rate"],
            unit="%",
            target=">= 99.9%",
            met=r["success_rate"] >= 0.999,
        )
    write_json("dht", results)
