"""Gossip of server announcements: a simulated swarm of nodes in virtual time, with messages
delayed and lost in memory (spread, de-duplication, forged and expired records, replacement,
repair by push-pull), the protocol's limits message by message, and the peer table snapshot."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import pytest

from petals_core._errors import ConfigError, LocalProtocolError
from petals_core.dht import Record, RecordStore, ServerInfo, ServerState
from petals_core.dht._gossip import (
    Action,
    Digest,
    DigestEntry,
    Gossip,
    PeerTableSnapshot,
    Push,
    Want,
    build_snapshot,
)
from petals_core.transport._identity import Identity

NOW = 1_700_000_000.0
PREFIX = "llama-7b-hf"
KEY = f"{PREFIX}.0"


def identity(seed: int) -> Identity:
    return Identity.from_private_bytes((seed + 1).to_bytes(32, "big"))


ALICE, BOB, CAROL = identity(10_001), identity(10_002), identity(10_003)


def info(start: int = 0, end: int = 4, state: ServerState = ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(
        state=state, throughput=1.0, start_block=start, end_block=end, version="1", torch_dtype="f"
    )


def announce(who: Identity = ALICE, key: str = KEY, ttl: float = 600) -> Record:
    return Record.signed(who, key, info().to_bytes(), NOW + ttl)


def gossip(peer: str = "me", store: RecordStore | None = None, **kwargs: Any) -> Gossip:
    return Gossip(peer, store or RecordStore(), prefix=PREFIX, rng=random.Random(0), **kwargs)


def holds(store: RecordStore, record: Record, now: float) -> bool:
    stored = store.get(record.key, now)
    return stored is not None and stored.entries.get(record.subkey) == record.entry


class Swarm:
    """``n`` nodes, all members of the topic, exchanging messages through a heap of events in
    virtual time: each message is lost with probability ``loss`` or else arrives after a delay
    drawn from ``delay_s``.  Nodes in ``deaf`` receive nothing."""

    def __init__(
        self,
        n: int,
        *,
        seed: int = 0,
        loss: float = 0.0,
        delay_s: tuple[float, float] = (0.01, 0.1),
        **kwargs: Any,
    ) -> None:
        self.rng = random.Random(seed)
        self.loss = loss
        self.delay_s = delay_s
        self.ids = [str(identity(i).peer_id) for i in range(n)]
        self.stores = {peer: RecordStore() for peer in self.ids}
        self.nodes = {
            peer: Gossip(
                peer, self.stores[peer], prefix=PREFIX, rng=random.Random(seed * 1000 + i), **kwargs
            )
            for i, peer in enumerate(self.ids)
        }
        for node in self.nodes.values():
            for peer in self.ids:
                node.add_peer(peer)
        self.deaf: set[str] = set()
        self.now = NOW
        self._events: list[tuple[float, int, str, str, Action | None]] = []
        self._sequence = 0
        # (node, key, subkey, expiration) -> how many times the node forwarded that record
        self.forwards: Counter[tuple[str, str, str | None, float]] = Counter()
        for peer in self.ids:  # first ticks at random phases within one interval
            self._schedule(NOW + self.rng.uniform(0, 1), peer, peer, None)

    def _schedule(self, at: float, to: str, sender: str, action: Action | None) -> None:
        self._sequence += 1
        heapq.heappush(self._events, (at, self._sequence, to, sender, action))

    def send(self, sender: str, actions: Sequence[Action]) -> None:
        for action in actions:
            if self.rng.random() >= self.loss:
                self._schedule(
                    self.now + self.rng.uniform(*self.delay_s), action.peer, sender, action
                )

    def publish(self, peer: str, record: Record) -> None:
        self.send(peer, self.nodes[peer].publish(record, self.now))

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        while self._events and self._events[0][0] <= end and not stop():
            self.now, _, to, sender, action = heapq.heappop(self._events)
            node = self.nodes[to]
            if action is None:
                self.send(to, node.tick(self.now))
                self._schedule(node.next_deadline(), to, to, None)
            elif to in self.deaf:
                continue
            elif isinstance(action, Digest):
                self.send(to, node.on_digest(sender, action.entries, self.now))
            elif isinstance(action, Want):
                self.send(to, node.on_want(sender, action.entries, self.now))
            else:
                out = node.on_push(sender, action.records, self.now, ttl=action.ttl)
                for record in {record for push in out for record in push.records}:
                    self.forwards[to, record.key, record.subkey, record.expiration] += 1
                self.send(to, out)
        self.now = max(self.now, min(end, self._events[0][0] if self._events else end))

    def holding(self, record: Record) -> int:
        return sum(holds(store, record, self.now) for store in self.stores.values())


def test_a_published_record_reaches_99_percent_within_a_few_intervals() -> None:
    swarm = Swarm(200, seed=1, loss=0.05)
    swarm.run_until(NOW + 3)  # the ticks settle into their phases
    record = Record.signed(identity(0), KEY, info().to_bytes(), NOW + 600)
    start = swarm.now
    swarm.publish(swarm.ids[0], record)
    swarm.run_until(NOW + 100, stop=lambda: swarm.holding(record) >= 198)
    rounds = swarm.now - start  # interval_s is 1
    print(f"99% of 200 nodes after {rounds:.2f} intervals")
    assert swarm.holding(record) >= 198
    assert rounds <= 3 * math.log2(200)
    swarm.run_until(swarm.now + 10)
    assert swarm.holding(record) == 200
    # Each node forwarded the rumour at most once, and repeats were counted as duplicates.
    assert max(swarm.forwards.values()) == 1
    assert sum(node.statistics().duplicates for node in swarm.nodes.values()) > 0
    assert sum(node.statistics().refusals for node in swarm.nodes.values()) == 0


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_spread_rounds_stay_small_across_seeds(seed: int) -> None:
    swarm = Swarm(200, seed=seed, loss=0.1, delay_s=(0.05, 0.3))
    swarm.run_until(NOW + 2)
    record = Record.signed(identity(seed), KEY, info().to_bytes(), NOW + 600)
    start = swarm.now
    swarm.publish(swarm.ids[seed], record)
    swarm.run_until(NOW + 100, stop=lambda: swarm.holding(record) >= 198)
    print(f"seed {seed}: 99% after {swarm.now - start:.2f} intervals")
    assert swarm.now - start <= 3 * math.log2(200)


def test_forged_records_are_refused_and_never_spread() -> None:
    swarm = Swarm(50, seed=5)
    victim = identity(0)
    honest = Record.signed(victim, KEY, info().to_bytes(), NOW + 600)
    unsigned = Record(KEY, str(victim.peer_id), info().to_bytes(), NOW + 900)
    resigned = Record.signed(BOB, KEY, info(state=ServerState.OFFLINE).to_bytes(), NOW + 900)
    wrong_signer = attrs.evolve(resigned, subkey=str(victim.peer_id))  # BOB's key, victim's name
    tampered = attrs.evolve(honest, value=info(start=1).to_bytes())
    forged = [unsigned, wrong_signer, tampered]
    attacker = "attacker"
    for peer in swarm.ids[:10]:
        swarm.send(attacker, [Push(peer, tuple(forged), 8)])
    swarm.run_until(NOW + 10)
    for record in forged:
        assert swarm.holding(record) == 0
    assert sum(node.statistics().refusals for node in swarm.nodes.values()) == 30
    assert not swarm.forwards
    # The honest record still spreads as usual.
    swarm.publish(swarm.ids[0], honest)
    swarm.run_until(swarm.now + 10)
    assert swarm.holding(honest) == 50


def test_an_expired_record_is_not_spread() -> None:
    swarm = Swarm(30, seed=6)
    short = Record.signed(identity(0), KEY, info().to_bytes(), NOW + 0.5)
    late = Record.signed(identity(1), KEY, info().to_bytes(), NOW + 0.5)
    swarm.publish(swarm.ids[0], short)
    swarm.run_until(NOW + 2)
    assert swarm.holding(short) == 0  # gone everywhere, by now
    # Published after its expiration, it goes nowhere.
    assert swarm.nodes[swarm.ids[1]].publish(late, NOW + 2) == []
    for peer in swarm.ids[:5]:
        swarm.send("someone", [Push(peer, (late,), 8)])
    swarm.run_until(NOW + 6)
    assert swarm.holding(late) == 0
    assert not any(
        key == late.key and subkey == late.subkey for (_, key, subkey, _) in swarm.forwards
    )


def test_a_newer_announcement_replaces_the_older_everywhere() -> None:
    swarm = Swarm(100, seed=7, loss=0.05)
    server = identity(3)
    old = Record.signed(server, KEY, info().to_bytes(), NOW + 300)
    swarm.publish(swarm.ids[3], old)
    swarm.run_until(NOW + 10)
    assert swarm.holding(old) == 100
    new = Record.signed(server, KEY, info(state=ServerState.OFFLINE).to_bytes(), NOW + 310)
    swarm.publish(swarm.ids[3], new)
    swarm.run_until(NOW + 20)
    assert swarm.holding(new) == 100
    assert swarm.holding(old) == 0
    for store in swarm.stores.values():
        assert build_snapshot(store, PREFIX, swarm.now).servers_for(0) == {}


def test_push_pull_repairs_a_node_that_missed_the_rumour() -> None:
    swarm = Swarm(100, seed=8)
    record = Record.signed(identity(0), KEY, info().to_bytes(), NOW + 600)
    missed = swarm.ids[-1]
    swarm.deaf.add(missed)
    swarm.publish(swarm.ids[0], record)
    swarm.run_until(NOW + 5)
    assert swarm.holding(record) == 99
    swarm.deaf.clear()
    swarm.run_until(NOW + 8)
    assert holds(swarm.stores[missed], record, swarm.now)
    assert not any(node == missed for (node, *_) in swarm.forwards)  # repairs are not rumours


def test_digest_exchange_between_two_nodes_pushes_and_pulls() -> None:
    a, b = gossip("a", push_ttl=4), gossip("b")
    a.add_peer("b")
    b.add_peer("a")
    record = announce()
    assert a.publish(record, NOW) == [Push("b", (record,), 4)]
    # b never got the push.  b's digest shows a that b lacks it: a pushes it back (push).
    [digest] = b.tick(NOW)
    assert digest == Digest("a", ())
    [push] = a.on_digest("b", digest.entries, NOW)
    assert push == Push("b", (record,), 0)
    assert b.on_push("a", push.records, NOW, ttl=push.ttl) == []  # ttl 0: not forwarded
    assert holds(b._store, record, NOW)
    # A newer version reaches b only.  a's digest shows b that a holds it older: b wants it.
    newer = announce(ttl=700)
    b.publish(newer, NOW)
    [digest] = a.tick(NOW)
    assert digest.entries == (DigestEntry(KEY, record.subkey, record.expiration),)
    actions = b.on_digest("a", digest.entries, NOW)
    assert actions == [Push("a", (newer,), 0)]
    # And the other way round: b holds the older one, a's digest lists the newer: b wants it.
    c = gossip("c")
    c.add_peer("a")
    c.on_push("a", (record,), NOW, ttl=0)
    a.on_push("b", (newer,), NOW + 2, ttl=0)
    [digest] = a.tick(NOW + 4)
    [want] = c.on_digest("a", digest.entries, NOW + 4)
    assert want == Want("a", (DigestEntry(KEY, newer.subkey, newer.expiration),))
    [push] = a.on_want("c", want.entries, NOW + 4)
    assert push.records == (newer,)
    c.on_push("a", push.records, NOW + 4, ttl=push.ttl)
    assert holds(c._store, newer, NOW + 4)
    assert a.statistics().wants_received == 1
    assert c.statistics().wants_sent == 1


def test_a_duplicate_is_counted_and_not_forwarded() -> None:
    node = gossip()
    for peer in "pqrs":
        node.add_peer(peer)
    record = announce()
    first = node.on_push("p", (record,), NOW, ttl=3)
    assert len(first) == 3
    assert all(push.ttl == 2 and push.peer in "qrs" for push in first)  # never back to p
    assert node.on_push("q", (record,), NOW, ttl=3) == []
    older = announce(ttl=500)
    assert node.on_push("r", (older,), NOW, ttl=3) == []
    stats = node.statistics()
    assert (stats.records_new, stats.duplicates, stats.refusals) == (1, 2, 0)
    assert stats.pushes_received == 3
    assert stats.pushes_sent == 3


def test_ttl_runs_out_and_is_capped() -> None:
    node = gossip(push_ttl=2)
    node.add_peer("p")
    node.add_peer("q")
    assert node.on_push("p", (announce(ALICE),), NOW, ttl=1) == [Push("q", (announce(ALICE),), 0)]
    assert node.on_push("p", (announce(BOB),), NOW, ttl=0) == []
    [push] = node.on_push("p", (announce(CAROL),), NOW, ttl=10**9)
    assert push.ttl == 1


def test_records_outside_the_topic_are_refused() -> None:
    node = gossip()
    node.add_peer("p")
    other = Record.signed(ALICE, "other-model.0", b"x", NOW + 60)
    with pytest.raises(LocalProtocolError):
        node.publish(other, NOW)
    prefixed = Record.signed(ALICE, f"{PREFIX}x.0", b"x", NOW + 60)  # prefix, but not the topic
    assert node.on_push("p", (other, prefixed), NOW, ttl=3) == []
    assert node.statistics().refusals == 2
    assert node.on_digest("p", [DigestEntry("other-model.0", None, NOW + 60)], NOW) == []
    assert node.on_want("p", [DigestEntry("other-model.0", None, NOW + 60)], NOW) == []


def test_only_signed_announcements_of_the_models_blocks_enter_the_topic() -> None:
    """Under the topic's prefix only ``{prefix}.{block}`` keys, signed by their server, are
    held: junk keys or unsigned entries would fill the store (whose full keys push nobody out)
    and make every digest costly."""
    node = gossip(num_blocks=4)
    node.add_peer("p")
    junk = [
        Record.signed(ALICE, f"{PREFIX}.junk", b"x", NOW + 60),
        Record.signed(ALICE, f"{PREFIX}.4", b"x", NOW + 60),  # past the model's blocks
        Record.signed(ALICE, f"{PREFIX}.01", b"x", NOW + 60),
        Record(f"{PREFIX}.0", "not-a-peer", b"x", NOW + 60),  # unsigned
    ]
    assert node.on_push("p", tuple(junk), NOW, ttl=3) == []
    assert node.statistics().refusals == len(junk)
    entries = [DigestEntry(f"{PREFIX}.junk", None, NOW + 60)]
    assert node.on_digest("p", entries, NOW) == []
    assert node.on_push("p", (announce(ALICE),), NOW, ttl=0) == []
    assert node.statistics().refusals == len(junk)  # the announcement itself was taken


def test_expired_records_leave_digests_and_are_not_pushed() -> None:
    node = gossip()
    node.add_peer("p")
    record = announce(ttl=10)
    node.publish(record, NOW)
    [digest] = node.tick(NOW)
    assert len(digest.entries) == 1
    assert node.tick(NOW + 0.1) == []  # before the deadline
    assert node.next_deadline() >= NOW + 0.75
    [digest] = node.tick(NOW + 11)
    assert digest.entries == ()
    assert node.on_digest("p", (), NOW + 11) == []
    assert node.on_want("p", [DigestEntry(KEY, record.subkey, record.expiration)], NOW + 11) == []
    # Malformed entries are skipped, and entries the peer lists as expired are not wanted.
    junk: list[Any] = [
        DigestEntry(1, None, NOW + 60),  # type: ignore[arg-type]
        DigestEntry(KEY, b"x", NOW + 60),  # type: ignore[arg-type]
        DigestEntry(KEY, None, math.nan),
        DigestEntry(KEY, None, "soon"),  # type: ignore[arg-type]
        (KEY, None, NOW + 60),
        None,
    ]
    assert node.on_digest("p", junk, NOW + 11) == []
    assert node.on_want("p", junk, NOW + 11) == []
    stale = [DigestEntry(KEY, str(BOB.peer_id), NOW + 5)]
    assert node.on_digest("p", stale, NOW + 11) == []


def test_digests_and_pushes_are_bounded() -> None:
    store = RecordStore()
    node = gossip(store=store, max_digest_entries=5, max_push_records=3)
    node.add_peer("p")
    records = [announce(identity(i), key=f"{PREFIX}.{i}") for i in range(20)]
    for record in records:
        store.store(record, NOW)
    [digest] = node.tick(NOW)
    assert len(digest.entries) == 5
    [push] = node.on_digest("p", (), NOW)
    assert isinstance(push, Push) and len(push.records) == 3
    flood = [DigestEntry(f"{PREFIX}.{i}", "x", NOW + 60 + i) for i in range(1000)]
    want = node.on_digest("p", flood, NOW)[-1]
    assert isinstance(want, Want) and len(want.entries) == 3
    # Incoming pushes past the limit are not even looked at.
    fresh = gossip(max_push_records=3)
    fresh.on_push("p", records, NOW, ttl=0)
    assert fresh.statistics().records_new == 3
    big = gossip(max_push_bytes=1000)
    big.add_peer("p")
    for record in records:
        big._store.store(record, NOW)
    [push] = big.on_digest("p", (), NOW)
    assert isinstance(push, Push) and 1 <= len(push.records) < 20


def test_floods_are_rate_limited() -> None:
    node = gossip(max_messages_per_peer_per_s=10, max_unknown_messages_per_s=4)
    node.add_peer("p")
    for _ in range(100):
        node.on_digest("p", (), NOW)
    for i in range(100):
        node.on_digest(f"stranger-{i}", (), NOW)
    stats = node.statistics()
    assert stats.digests_received == 10 + 4
    assert stats.messages_dropped == 186
    node.on_digest("p", (), NOW + 0.5)  # half a second refills half the bucket
    node.on_digest(f"stranger-{i}", (), NOW + 0.5)
    assert node.statistics().digests_received == 16
    # A stranger is still heard: a new server not yet known from the DHT gets through.
    assert node.on_push("newcomer", (announce(),), NOW + 10, ttl=1) == [Push("p", (announce(),), 0)]


def test_membership() -> None:
    node = gossip("me")
    assert node.tick(NOW) == []
    node.add_peer("me")
    for peer in "abcde":
        node.add_peer(peer)
        node.add_peer(peer)
    node.remove_peer("c")
    node.remove_peer("a")
    node.remove_peer("zz")
    assert node.peers == frozenset("bde")
    assert node.statistics().peers == 3
    targets = {push.peer for push in node.publish(announce(), NOW)}
    assert targets == set("bde")
    with pytest.raises(ConfigError):
        gossip(fanout=0)
    with pytest.raises(ConfigError):
        gossip(interval_s=-1)
    with pytest.raises(ConfigError):
        Gossip("me", RecordStore(), prefix="", rng=random.Random(0))


def test_snapshot_reads_the_topic_from_the_store() -> None:
    store = RecordStore()
    a = Record.signed(ALICE, f"{PREFIX}.0", info(0, 2).to_bytes(), NOW + 60)
    a1 = Record.signed(ALICE, f"{PREFIX}.1", info(0, 2).to_bytes(), NOW + 60)
    b1 = Record.signed(BOB, f"{PREFIX}.1", info(1, 3).to_bytes(), NOW + 30)
    offline = Record.signed(
        CAROL, f"{PREFIX}.1", info(state=ServerState.OFFLINE).to_bytes(), NOW + 60
    )
    garbage = Record.signed(identity(7), f"{PREFIX}.1", b"\xff\x00", NOW + 60)
    outside = Record.signed(identity(8), f"{PREFIX}.5", info(0, 2).to_bytes(), NOW + 60)
    unsigned = Record(f"{PREFIX}.2", "not-a-peer", info(2, 3).to_bytes(), NOW + 60)
    other_model = Record.signed(ALICE, "other.0", info(0, 2).to_bytes(), NOW + 60)
    bad_key = Record.signed(ALICE, f"{PREFIX}.x", info(0, 2).to_bytes(), NOW + 60)
    for record in [a, a1, b1, offline, garbage, outside, unsigned, other_model, bad_key]:
        assert store.store(record, NOW).accepted
    snapshot = build_snapshot(store, PREFIX, NOW, version=7)
    assert isinstance(snapshot, PeerTableSnapshot)
    assert (snapshot.prefix, snapshot.now, snapshot.version) == (PREFIX, NOW, 7)
    assert set(snapshot.blocks) == {0, 1}
    assert dict(snapshot.servers_for(0)) == {str(ALICE.peer_id): info(0, 2)}
    assert set(snapshot.servers_for(1)) == {str(ALICE.peer_id), str(BOB.peer_id)}
    assert snapshot.servers_for(2) == {}
    assert snapshot.servers_for(5) == {}
    assert snapshot.peer_ids == {str(ALICE.peer_id), str(BOB.peer_id)}
    with pytest.raises(TypeError):
        snapshot.blocks[9] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        snapshot.servers_for(0)["x"] = info()  # type: ignore[index]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snapshot.version = 8  # type: ignore[misc]
    # Later, BOB's announcement has expired; the old snapshot is unchanged.
    later = build_snapshot(store, PREFIX, NOW + 40, version=8)
    assert set(later.servers_for(1)) == {str(ALICE.peer_id)}
    assert set(snapshot.servers_for(1)) == {str(ALICE.peer_id), str(BOB.peer_id)}
    assert build_snapshot(RecordStore(), PREFIX, NOW).blocks == {}
