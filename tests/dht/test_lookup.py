"""Iterative lookups against an in-memory world of Kademlia nodes, driven by a virtual clock."""

from __future__ import annotations

import heapq
import itertools
import math
import random

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from petals_core._errors import ConfigError
from petals_core.dht import Contact, NodeID, Record, RoutingTable, StoredValue, xor_distance
from petals_core.dht._lookup import Lookup, LookupResult, Query
from petals_core.transport import PeerID

N = 300
K = 8
TIMEOUT_S = 1.0


def make_contact(rng: random.Random, index: int) -> Contact:
    peer_id = PeerID.from_public_key(rng.randbytes(32))
    return Contact.from_peer_id(
        peer_id, f"/ip4/10.0.{index // 256}.{index % 256}/udp/4000/quic-v1", last_seen=0.0
    )


class World:
    """N nodes, each with a routing table that has heard from every other node (in random order),
    and the records it stores.  Behaviour per node: alive, dead (fails fast or never answers),
    slow (answers after the timeout), or lying (plants contacts at forged IDs)."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.contacts = [make_contact(rng, index) for index in range(n)]
        self.tables: dict[NodeID, RoutingTable] = {}
        for contact in self.contacts:
            table = RoutingTable(contact.node_id, k=K, rng=random.Random(rng.random()))
            others = list(self.contacts)
            rng.shuffle(others)
            for other in others:
                table.observe(other, 0.0)
            self.tables[contact.node_id] = table
        self.stored: dict[NodeID, list[Record]] = {}

    def true_closest(self, target: NodeID, alive: set[NodeID], own: NodeID) -> list[NodeID]:
        ids = [c.node_id for c in self.contacts if c.node_id in alive and c.node_id != own]
        return sorted(ids, key=lambda node_id: xor_distance(node_id, target))[:K]


@pytest.fixture(scope="module")
def world() -> World:
    return World(N, seed=1)


@attrs.define
class Run:
    result: LookupResult
    queried: list[NodeID]
    max_in_flight: int
    end_time: float


def drive(
    world: World,
    lookup: Lookup,
    rng: random.Random,
    *,
    dead: frozenset[NodeID] = frozenset(),
    silent: frozenset[NodeID] = frozenset(),
    slow: frozenset[NodeID] = frozenset(),
    liars: frozenset[NodeID] = frozenset(),
    fake: list[Contact] | None = None,
) -> Run:
    """Carry out the lookup's queries: each reply arrives after a random latency (so in a random
    order), dead nodes fail fast, silent ones never answer, slow ones answer after the timeout."""
    events: list[tuple[float, int, str, NodeID]] = []
    order = itertools.count()
    queried: list[NodeID] = []
    max_in_flight = 0
    now = 0.0

    def send(queries: list[Query]) -> None:
        nonlocal max_in_flight
        max_in_flight = max(max_in_flight, lookup.statistics().in_flight)
        for query in queries:
            node_id = query.contact.node_id
            assert query.target == lookup.target
            assert query.want_value == lookup.want_value
            queried.append(node_id)
            if node_id in silent:
                continue
            if node_id in dead:
                delay, kind = rng.uniform(0.001, 0.05), "fail"
            elif node_id in slow:
                delay, kind = TIMEOUT_S + rng.uniform(0.01, 1.0), "reply"
            else:
                delay, kind = rng.uniform(0.01, 0.3), "reply"
            heapq.heappush(events, (now + delay, next(order), kind, node_id))

    send(lookup.start(now))
    while not lookup.done:
        deadline = lookup.next_deadline()
        if deadline is not None and (not events or deadline <= events[0][0]):
            now = max(now, deadline)
            send(lookup.on_timeout(now))
            continue
        if not events:
            break
        now, _, kind, node_id = heapq.heappop(events)
        if kind == "fail":
            send(lookup.on_failure(node_id, now))
            continue
        contacts = world.tables[node_id].closest(lookup.target, K)
        if node_id in liars and fake is not None:
            contacts = fake + contacts
        records = None
        if lookup.want_value is not None:
            records = list(world.stored.get(node_id, []))
        send(lookup.on_reply(node_id, contacts, records, now))
    assert lookup.done
    return Run(lookup.result(), queried, max_in_flight, now)


def lookup_for(
    world: World,
    own: Contact,
    target: NodeID,
    *,
    alpha: int = 3,
    want_value: str | None = None,
    stop_after_values: int | None = None,
) -> Lookup:
    initial = world.tables[own.node_id].closest(target, K)
    return Lookup(
        target,
        initial,
        k=K,
        alpha=alpha,
        query_timeout_s=TIMEOUT_S,
        want_value=want_value,
        stop_after_values=stop_after_values,
        own=own.node_id,
    )


def ids(contacts: tuple[Contact, ...]) -> list[NodeID]:
    return [contact.node_id for contact in contacts]


def random_node(world: World, rng: random.Random) -> Contact:
    return world.contacts[rng.randrange(len(world.contacts))]


def pick(world: World, rng: random.Random, fraction: float, *, besides: set[NodeID]) -> set[NodeID]:
    return {
        c.node_id for c in world.contacts if c.node_id not in besides and rng.random() < fraction
    }


# --- finding nodes -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), alpha=st.integers(1, 6))
def test_lossless_lookup_finds_the_true_k_closest(world: World, seed: int, alpha: int) -> None:
    rng = random.Random(seed)
    own = random_node(world, rng)
    target = NodeID.random(rng) if rng.random() < 0.8 else random_node(world, rng).node_id
    run = drive(world, lookup_for(world, own, target, alpha=alpha), rng)
    everyone = {c.node_id for c in world.contacts}
    assert ids(run.result.contacts) == world.true_closest(target, everyone, own.node_id)
    assert own.node_id not in run.queried
    assert len(run.queried) == len(set(run.queried)) == run.result.messages
    assert run.max_in_flight <= alpha
    assert 1 <= run.result.hops <= math.ceil(math.log2(N))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    alpha=st.integers(1, 6),
    dead=st.floats(0, 0.4),
    silent=st.floats(0, 0.2),
    slow=st.floats(0, 0.2),
)
def test_lossy_lookup_returns_only_responsive_nodes_in_order(
    world: World, seed: int, alpha: int, dead: float, silent: float, slow: float
) -> None:
    rng = random.Random(seed)
    own = random_node(world, rng)
    target = NodeID.random(rng)
    dead_ids = pick(world, rng, dead, besides={own.node_id})
    silent_ids = pick(world, rng, silent, besides={own.node_id} | dead_ids)
    slow_ids = pick(world, rng, slow, besides={own.node_id} | dead_ids | silent_ids)
    run = drive(
        world,
        lookup_for(world, own, target, alpha=alpha),
        rng,
        dead=frozenset(dead_ids),
        silent=frozenset(silent_ids),
        slow=frozenset(slow_ids),
    )
    found = ids(run.result.contacts)
    assert len(found) <= K
    assert not set(found) & (dead_ids | silent_ids | slow_ids | {own.node_id})
    assert found == sorted(found, key=lambda node_id: xor_distance(node_id, target))
    assert len(run.queried) == len(set(run.queried)) == run.result.messages
    assert run.max_in_flight <= alpha
    # Nothing waits forever: silent nodes cost one timeout per round at most.
    assert run.end_time <= (run.result.messages + 1) * TIMEOUT_S
    assert run.result.messages <= N


@pytest.mark.parametrize(("loss", "min_recall"), [(0.1, 0.97), (0.2, 0.93), (0.4, 0.8)])
def test_lossy_lookups_have_high_recall(world: World, loss: float, min_recall: float) -> None:
    rng = random.Random(int(loss * 100))
    everyone = {c.node_id for c in world.contacts}
    recall = 0.0
    targets = 200
    for _ in range(targets):
        own = random_node(world, rng)
        target = NodeID.random(rng)
        dead_ids = pick(world, rng, loss / 2, besides={own.node_id})
        slow_ids = pick(world, rng, loss / 2, besides={own.node_id} | dead_ids)
        run = drive(
            world,
            lookup_for(world, own, target),
            rng,
            dead=frozenset(dead_ids),
            slow=frozenset(slow_ids),
        )
        truth = world.true_closest(target, everyone - dead_ids - slow_ids, own.node_id)
        recall += len(set(ids(run.result.contacts)) & set(truth)) / len(truth)
    assert recall / targets >= min_recall


def test_hops_grow_like_log_n(world: World) -> None:
    rng = random.Random(7)
    hops = []
    for _ in range(200):
        run = drive(world, lookup_for(world, random_node(world, rng), NodeID.random(rng)), rng)
        hops.append(run.result.hops)
    mean = sum(hops) / len(hops)
    # Each hop halves the distance at least (a k-bucket covers a power-of-two range), and with
    # k contacts per bucket it gains about log2(k) bits: between log2(N) / log2(k) and log2(N).
    assert math.log2(N) / math.log2(K) - 1 <= mean <= math.log2(N)
    assert max(hops) <= math.ceil(math.log2(N))


def test_lookup_from_a_lone_node_finishes_at_once() -> None:
    lookup = Lookup(NodeID(1), [], k=K)
    assert lookup.start(0.0) == []
    assert lookup.done
    assert lookup.next_deadline() is None
    result = lookup.result()
    assert result.contacts == () and result.hops == 0 and result.messages == 0


# --- distrust ------------------------------------------------------------------------------------


def test_lying_contacts_are_ignored(world: World) -> None:
    rng = random.Random(11)
    own = random_node(world, rng)
    target = NodeID.random(rng)
    everyone = {c.node_id for c in world.contacts}
    truth = world.true_closest(target, everyone, own.node_id)
    # Forged contacts right next to the target: real PeerIDs, made-up positions.
    fake = [
        attrs.evolve(contact, node_id=NodeID(target.value ^ (index + 1)))
        for index, contact in enumerate(world.contacts[:K])
    ]
    liars = frozenset(everyone)  # every node lies, and still the lookup finds the truth
    run = drive(world, lookup_for(world, own, target), rng, liars=liars, fake=fake)
    assert ids(run.result.contacts) == truth
    assert not {contact.node_id for contact in fake} & set(run.queried)


def test_replies_from_nodes_not_queried_and_duplicates_are_ignored(world: World) -> None:
    rng = random.Random(12)
    own = random_node(world, rng)
    target = NodeID.random(rng)
    lookup = lookup_for(world, own, target, alpha=1)
    (query,) = lookup.start(0.0)
    asked = query.contact.node_id
    stranger = next(c for c in world.contacts if c.node_id not in (asked, own.node_id))
    # A node we never asked cannot push contacts on us, nor fail on our behalf.
    assert lookup.on_reply(stranger.node_id, [stranger], None, 0.1) == []
    assert lookup.on_failure(stranger.node_id, 0.1) == []
    assert lookup.statistics().candidates == len(world.tables[own.node_id].closest(target, K))
    follow_up = lookup.on_reply(asked, world.tables[asked].closest(target, K), None, 0.2)
    assert len(follow_up) == 1
    # A second reply from the same node changes nothing.
    before = lookup.statistics()
    assert lookup.on_reply(asked, world.tables[asked].closest(target, K), None, 0.3) == []
    assert lookup.on_failure(asked, 0.3) == []
    assert lookup.statistics() == before


def test_own_contact_is_never_queried_nor_returned(world: World) -> None:
    rng = random.Random(13)
    own = random_node(world, rng)
    target = NodeID(own.node_id.value ^ 1)  # we are the closest node to the target
    run = drive(world, lookup_for(world, own, target), rng)
    assert own.node_id not in run.queried
    assert own.node_id not in ids(run.result.contacts)
    everyone = {c.node_id for c in world.contacts}
    assert ids(run.result.contacts) == world.true_closest(target, everyone, own.node_id)


# --- timeouts ------------------------------------------------------------------------------------


def test_timeouts_fire_via_next_deadline(world: World) -> None:
    rng = random.Random(14)
    own = random_node(world, rng)
    target = NodeID.random(rng)
    lookup = lookup_for(world, own, target, alpha=2)
    assert lookup.next_deadline() is None
    first = lookup.start(10.0)
    assert len(first) == 2
    assert lookup.next_deadline() == 10.0 + TIMEOUT_S
    # One query answers at 10.5 and starts a new one, so the deadlines differ.
    replier = first[1].contact.node_id
    (second,) = lookup.on_reply(replier, [], None, 10.5)
    assert lookup.next_deadline() == 10.0 + TIMEOUT_S
    assert lookup.on_timeout(10.0 + TIMEOUT_S - 0.001) == []  # early: nothing happens
    replacement = lookup.on_timeout(10.0 + TIMEOUT_S)
    assert [query.contact.node_id for query in replacement] != [first[0].contact.node_id]
    assert len(replacement) == 1
    assert lookup.statistics().timed_out == 1
    assert lookup.next_deadline() == 10.5 + TIMEOUT_S
    # The late reply of the query that timed out is ignored.
    late = first[0].contact.node_id
    assert lookup.on_reply(late, world.tables[late].closest(target, K), None, 11.2) == []
    assert late not in ids(lookup.result().contacts)
    # Let everything else time out: the lookup ends with just the one node that replied.
    while not lookup.done:
        deadline = lookup.next_deadline()
        assert deadline is not None
        lookup.on_timeout(deadline)
    assert ids(lookup.result().contacts) == [replier]
    assert second.contact.node_id not in ids(lookup.result().contacts)
    assert lookup.next_deadline() is None


def test_all_silent_lookup_ends_after_timeouts(world: World) -> None:
    rng = random.Random(15)
    own = random_node(world, rng)
    everyone = frozenset(c.node_id for c in world.contacts) - {own.node_id}
    run = drive(world, lookup_for(world, own, NodeID.random(rng)), rng, silent=everyone)
    assert run.result.contacts == ()
    assert run.result.messages == K  # each initial contact once, and nothing else was learned
    assert run.end_time == pytest.approx(math.ceil(K / 3) * TIMEOUT_S)


# --- finding values ------------------------------------------------------------------------------


def store_dictionary(world: World, key: str, holders: int) -> dict[str, bytes]:
    """Store a dictionary under ``key``: each of the ``holders`` nodes nearest to it holds one
    subkey, plus an older copy of the previous holder's entry, which newer ones must win over."""
    where = NodeID.from_key(key)
    nearest = sorted(world.contacts, key=lambda c: xor_distance(c.node_id, where))[:holders]
    world.stored.clear()
    expected = {}
    for index, contact in enumerate(nearest):
        subkey = f"server-{index}"
        value = f"info-{index}".encode()
        expected[subkey] = value
        records = [Record(key, subkey, value, 1000.0 + index)]
        if index:
            records.append(Record(key, f"server-{index - 1}", b"stale", 500.0))
        records.append(Record("another key", subkey, b"unrelated", 1000.0))
        world.stored[contact.node_id] = records
    return expected


def test_find_value_merges_dictionaries_from_several_nodes(world: World) -> None:
    rng = random.Random(16)
    key = "bigscience/bloom-560m.3"
    expected = store_dictionary(world, key, holders=5)
    own = next(c for c in world.contacts if c.node_id not in world.stored)
    run = drive(world, lookup_for(world, own, NodeID.from_key(key), want_value=key), rng)
    value = run.result.value
    assert isinstance(value, StoredValue) and value.is_dictionary
    assert {subkey: entry.value for subkey, entry in value.entries.items()} == expected
    holders = set(world.stored)
    without = ids(run.result.without_value)
    assert without and not set(without) & holders
    assert set(without) | holders >= set(ids(run.result.contacts))
    assert without == sorted(without, key=lambda n: xor_distance(n, NodeID.from_key(key)))


def test_find_value_can_stop_after_the_first_values(world: World) -> None:
    rng = random.Random(17)
    key = "bigscience/bloom-560m.7"
    store_dictionary(world, key, holders=K)
    own = next(c for c in world.contacts if c.node_id not in world.stored)
    target = NodeID.from_key(key)
    full = drive(world, lookup_for(world, own, target, want_value=key), random.Random(1))
    early = drive(world, lookup_for(world, own, target, want_value=key, stop_after_values=1), rng)
    assert early.result.value is not None and len(early.result.value.entries) >= 1
    assert early.result.messages < full.result.messages
    # Replies arriving after it stopped are ignored.
    # From a node whose first round reaches a holder:
    near = next(
        c
        for c in world.contacts
        if c.node_id not in world.stored
        and any(n.node_id in world.stored for n in world.tables[c.node_id].closest(target, 3))
    )
    lookup = lookup_for(world, near, target, want_value=key, stop_after_values=1)
    queries = lookup.start(0.0)
    holder = next(q for q in queries if q.contact.node_id in world.stored)
    other = next(q for q in queries if q is not holder)
    lookup.on_reply(holder.contact.node_id, [], world.stored[holder.contact.node_id], 0.1)
    assert lookup.done
    assert lookup.statistics().value_replies == 1
    assert lookup.on_reply(other.contact.node_id, [], None, 0.2) == []
    assert lookup.result().without_value == ()


def test_find_value_with_no_value_anywhere(world: World) -> None:
    world.stored.clear()
    rng = random.Random(18)
    own = random_node(world, rng)
    run = drive(
        world, lookup_for(world, own, NodeID.from_key("nothing"), want_value="nothing"), rng
    )
    assert run.result.value is None
    assert ids(run.result.without_value)[:K] == ids(run.result.contacts)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k": 0},
        {"alpha": 0},
        {"query_timeout_s": 0.0},
        {"query_timeout_s": math.nan},
        {"stop_after_values": 1},
        {"want_value": "key", "stop_after_values": 0},
    ],
)
def test_invalid_configuration_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Lookup(NodeID(1), [], **kwargs)  # type: ignore[arg-type]


def test_start_twice_is_refused() -> None:
    lookup = Lookup(NodeID(1), [])
    lookup.start(0.0)
    with pytest.raises(RuntimeError):
        lookup.start(0.0)


@pytest.mark.parametrize("max_attempts", [1, 2])
def test_a_timed_out_query_is_asked_again_when_allowed(max_attempts: int) -> None:
    rng = random.Random(11)
    contact = make_contact(rng, 0)
    lookup = Lookup(
        contact.node_id, [contact], k=1, alpha=1, query_timeout_s=1.0, max_attempts=max_attempts
    )
    (first,) = lookup.start(0.0)
    assert first.contact == contact
    again = lookup.on_timeout(1.0)
    if max_attempts == 1:
        assert again == [] and lookup.done and lookup.result().contacts == ()
        return
    assert [query.contact for query in again] == [contact]
    assert lookup.on_reply(contact.node_id, [], None, 1.5) == []
    assert lookup.done
    assert [c.node_id for c in lookup.result().contacts] == [contact.node_id]
    assert lookup.result().messages == 2


def _slow_sybils(target: NodeID, initial: list[Contact], rng: random.Random) -> list[Contact]:
    """Identities nearer ``target`` than any of ``initial``, farthest first: what an attacker
    who ground keys for a known key (a block's) hands out a few at a time, each batch nearer
    than the last."""
    nearest = min(xor_distance(c.node_id, target) for c in initial)
    drawn = [make_contact(rng, index) for index in range(20_000)]
    ground = [c for c in drawn if xor_distance(c.node_id, target) < nearest]
    return sorted(ground, key=lambda c: xor_distance(c.node_id, target), reverse=True)


def _answer_slowly(
    lookup: Lookup, start: float, sybils: list[Contact], give_up_at: float = math.inf
) -> tuple[float, list[Query]]:
    """Drive ``lookup`` against nodes that each answer just before their query times out, naming
    the next ``K`` of ``sybils``, as a driver that gives up at ``give_up_at`` does; returns the
    time it ended and the queries left unanswered."""
    pool = iter(sybils)
    in_flight = [(start + 0.9 * TIMEOUT_S, query) for query in lookup.start(start)]
    now = start
    while not lookup.done and in_flight:
        in_flight.sort(key=lambda item: item[0])
        answer_at, query = in_flight[0]
        deadline = lookup.next_deadline()
        assert deadline is not None
        if min(deadline, answer_at) >= give_up_at:
            lookup.give_up()
            return give_up_at, [query for _, query in in_flight]
        if deadline < answer_at:
            now = deadline
            sent = lookup.on_timeout(now)
        else:
            now = answer_at
            in_flight.pop(0)
            named = list(itertools.islice(pool, K))
            sent = lookup.on_reply(query.contact.node_id, named, None, now)
        in_flight += [(now + 0.9 * TIMEOUT_S, query) for query in sent]
    return now, [query for _, query in in_flight]


def test_slow_sybils_keep_a_lookup_going_until_its_driver_gives_up() -> None:
    rng = random.Random(21)
    target = NodeID.random(rng)
    initial = [make_contact(rng, index) for index in range(K)]
    sybils = _slow_sybils(target, initial, random.Random(22))
    unbounded = Lookup(target, initial, k=K, alpha=3, query_timeout_s=TIMEOUT_S)
    # Left alone, it goes on for as long as the attacker has nearer identities.
    ended, _ = _answer_slowly(unbounded, 0.0, sybils)
    assert ended > 50 * TIMEOUT_S
    assert not unbounded.statistics().out_of_time
    bounded = Lookup(target, initial, k=K, alpha=3, query_timeout_s=TIMEOUT_S)
    _, unanswered = _answer_slowly(bounded, 100.0, sybils, give_up_at=105.0)
    statistics = bounded.statistics()
    assert bounded.done and statistics.out_of_time
    assert unanswered and statistics.in_flight == len(unanswered)
    assert bounded.next_deadline() is None
    # It returns the nodes that answered by then, nearest first, and ignores what comes later.
    result = bounded.result()
    assert 0 < len(result.contacts) <= K
    distances = [xor_distance(c.node_id, target) for c in result.contacts]
    assert distances == sorted(distances)
    late = unanswered[0].contact.node_id
    assert bounded.on_reply(late, sybils[-K:], None, 105.5) == []
    assert bounded.on_timeout(200.0) == []
    assert bounded.result() == result
