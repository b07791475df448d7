"""The Kademlia routing table: IDs, the XOR metric, bucket rules, and a hypothesis state machine."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from collections import Counter

import attrs
import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from petals_core._errors import ConfigError
from petals_core.dht import (
    NODE_ID_BITS,
    Contact,
    NodeID,
    PingOldest,
    RoutingTable,
    bucket_index,
    host_of,
    xor_distance,
)
from petals_core.transport import Identity, PeerID

OWN = NodeID(0x5A5A << (NODE_ID_BITS - 16))
id_values = st.integers(min_value=0, max_value=(1 << NODE_ID_BITS) - 1)
node_ids = id_values.map(NodeID)


def contact(
    node_id: NodeID, *, port: int = 4000, last_seen: float = 0.0, host: str = "10.0.0.1"
) -> Contact:
    """A contact at a chosen ID (real contacts derive it from the PeerID; tests need to aim)."""
    peer_id = PeerID.from_public_key(node_id.value.to_bytes(32, "big"))
    return Contact(node_id, peer_id, f"/ip4/{host}/udp/{port}/quic-v1", last_seen)


def at_distance(own: NodeID, distance: int) -> NodeID:
    return NodeID(own.value ^ distance)


def in_bucket(own: NodeID, index: int, offset: int) -> NodeID:
    """The ID in bucket ``index`` of ``own``'s table whose distance is ``2**index + offset``."""
    assert 0 <= offset < 1 << index
    return at_distance(own, (1 << index) + offset)


def table(*, k: int = 3, cache: int | None = None, seed: int = 0) -> RoutingTable:
    return RoutingTable(OWN, k=k, replacement_cache_size=cache, rng=random.Random(seed))


# --- NodeID and the metric ---------------------------------------------------------------------


def test_node_id_from_peer_id_is_truncated_sha256_of_the_multihash() -> None:
    peer_id = Identity.generate().peer_id
    node_id = NodeID.from_peer_id(peer_id)
    assert node_id.to_bytes() == hashlib.sha256(peer_id.to_bytes()).digest()[:20]
    assert node_id == NodeID.from_peer_id(PeerID.from_bytes(peer_id.to_bytes()))
    assert node_id != NodeID.from_peer_id(Identity.generate().peer_id)


def test_keys_share_the_node_space() -> None:
    assert NodeID.from_key("llama-7b.0") == NodeID.from_key(b"llama-7b.0")
    assert NodeID.from_key("a") != NodeID.from_key("b")
    peer_id = Identity.generate().peer_id
    assert NodeID.from_key(peer_id.to_bytes()) == NodeID.from_peer_id(peer_id)
    with pytest.raises(TypeError):
        NodeID.from_key(42)  # type: ignore[arg-type]


def test_node_id_values_are_checked() -> None:
    with pytest.raises(ConfigError):
        NodeID(-1)
    with pytest.raises(ConfigError):
        NodeID(1 << NODE_ID_BITS)
    with pytest.raises(TypeError):
        NodeID(True)
    with pytest.raises(TypeError):
        NodeID("00")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        NodeID.from_bytes(b"\0" * 19)
    with pytest.raises(TypeError):
        NodeID.from_bytes(bytearray(20))  # type: ignore[arg-type]


@given(node_ids)
def test_node_id_bytes_text_and_repr_round_trip(node_id: NodeID) -> None:
    assert NodeID.from_bytes(node_id.to_bytes()) == node_id
    assert len(node_id.to_bytes()) == 20
    assert NodeID(int(str(node_id), 16)) == node_id
    assert len(str(node_id)) == 40
    assert eval(repr(node_id), {"NodeID": NodeID}) == node_id
    assert hash(node_id) == hash(NodeID(node_id.value))


def test_node_ids_order_by_value() -> None:
    assert sorted([NodeID(3), NodeID(1), NodeID(2)]) == [NodeID(1), NodeID(2), NodeID(3)]
    assert NodeID(1) < NodeID(2)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        NodeID(1).value = 2  # type: ignore[misc]


@given(node_ids, node_ids, node_ids)
def test_xor_is_a_metric(a: NodeID, b: NodeID, c: NodeID) -> None:
    assert xor_distance(a, b) == xor_distance(b, a)
    assert (xor_distance(a, b) == 0) == (a == b)
    assert xor_distance(a, c) <= xor_distance(a, b) + xor_distance(b, c)
    # Unidirectional: a distance from a point names exactly one point.
    assert at_distance(a, xor_distance(a, b)) == b


@given(node_ids, st.integers(min_value=1, max_value=(1 << NODE_ID_BITS) - 1))
def test_bucket_index_is_the_top_bit_of_the_distance(own: NodeID, distance: int) -> None:
    index = bucket_index(own, at_distance(own, distance))
    assert 1 << index <= distance < 1 << (index + 1)


def test_bucket_index_ends() -> None:
    assert bucket_index(OWN, at_distance(OWN, 1)) == 0
    assert bucket_index(OWN, at_distance(OWN, 1 << 159)) == 159
    with pytest.raises(ValueError, match="own ID"):
        bucket_index(OWN, OWN)


def test_contact_from_peer_id() -> None:
    peer_id = Identity.generate().peer_id
    c = Contact.from_peer_id(peer_id, "/ip4/1.2.3.4/udp/5/quic-v1", last_seen=7.0)
    assert c.node_id == NodeID.from_peer_id(peer_id)
    assert (c.peer_id, c.address, c.last_seen) == (peer_id, "/ip4/1.2.3.4/udp/5/quic-v1", 7.0)


# --- The table's rules --------------------------------------------------------------------------


def test_configuration_is_checked() -> None:
    with pytest.raises(ConfigError):
        table(k=0)
    with pytest.raises(ConfigError):
        table(cache=-1)
    assert table(k=5).replacement_cache_size == 5
    assert table(k=5, cache=0).replacement_cache_size == 0
    assert RoutingTable(OWN, rng=random.Random(0)).k == 20


def test_own_id_is_never_added() -> None:
    t = table()
    assert t.observe(contact(OWN), now=1.0) is None
    assert len(t) == 0
    assert OWN not in t
    assert t.get(OWN) is None
    t.failed(OWN, now=2.0)
    t.ping_result(OWN, alive=True, now=2.0)
    assert len(t) == 0


def test_observe_adds_then_refreshes() -> None:
    t = table()
    a, b = in_bucket(OWN, 4, 1), in_bucket(OWN, 4, 2)
    assert t.observe(contact(a, last_seen=99.0), now=1.0) is None
    assert t.observe(contact(b), now=2.0) is None
    assert len(t) == 2
    assert a in t
    assert "not an id" not in t
    assert t.get(a) == contact(a, last_seen=1.0)  # the table stamps its own clock
    assert [c.node_id for c in t.bucket(4)] == [a, b]

    assert t.observe(contact(a, port=5000), now=3.0) is None
    assert [c.node_id for c in t.bucket(4)] == [b, a]
    refreshed = t.get(a)
    assert refreshed is not None
    assert refreshed.address == "/ip4/10.0.0.1/udp/5000/quic-v1"
    assert refreshed.last_seen == 3.0
    assert len(t) == 2
    assert list(t) == list(t.bucket(4))


def full_bucket(t: RoutingTable, index: int = 5) -> list[NodeID]:
    members = [in_bucket(OWN, index, offset) for offset in range(t.k)]
    for step, node_id in enumerate(members):
        assert t.observe(contact(node_id), now=float(step)) is None
    return members


def test_full_bucket_asks_to_ping_the_oldest_once() -> None:
    t = table(k=3)
    members = full_bucket(t)
    newcomer, later = in_bucket(OWN, 5, 10), in_bucket(OWN, 5, 11)

    action = t.observe(contact(newcomer), now=10.0)
    assert action == PingOldest(contact(members[0], last_seen=0.0))
    assert newcomer not in t
    assert [c.node_id for c in t.replacements(5)] == [newcomer]
    assert t.pinging(5) == members[0]

    # One ping per bucket at a time: a second newcomer only waits.
    assert t.observe(contact(later), now=11.0) is None
    assert [c.node_id for c in t.replacements(5)] == [later, newcomer]
    assert t.statistics().pings_outstanding == 1


def test_oldest_that_answers_stays_and_newcomer_keeps_waiting() -> None:
    t = table(k=3)
    members = full_bucket(t)
    newcomer = in_bucket(OWN, 5, 10)
    action = t.observe(contact(newcomer), now=10.0)
    assert action is not None

    t.ping_result(action.contact.node_id, alive=True, now=12.0)
    assert [c.node_id for c in t.bucket(5)] == [members[1], members[2], members[0]]
    assert t.bucket(5)[-1].last_seen == 12.0
    assert [c.node_id for c in t.replacements(5)] == [newcomer]
    assert t.pinging(5) is None

    # The next newcomer checks the new oldest.
    action = t.observe(contact(in_bucket(OWN, 5, 11)), now=13.0)
    assert action is not None
    assert action.contact.node_id == members[1]


def test_oldest_that_does_not_answer_gives_way_to_the_freshest_replacement() -> None:
    t = table(k=3)
    members = full_bucket(t)
    first, second = in_bucket(OWN, 5, 10), in_bucket(OWN, 5, 11)
    action = t.observe(contact(first), now=10.0)
    assert action is not None
    t.observe(contact(second), now=11.0)

    t.ping_result(members[0], alive=False, now=14.0)
    assert members[0] not in t
    assert second in t
    assert [c.node_id for c in t.bucket(5)] == [members[1], members[2], second]
    assert [c.node_id for c in t.replacements(5)] == [first]
    assert t.pinging(5) is None
    assert len(t) == 3


def test_failed_node_is_replaced_in_last_seen_order() -> None:
    t = table(k=3)
    members = full_bucket(t)  # seen at 0, 1, 2
    waiting = in_bucket(OWN, 5, 10)
    t.observe(contact(waiting), now=1.5)
    t.failed(members[0], now=3.0)
    assert [c.node_id for c in t.bucket(5)] == [members[1], waiting, members[2]]
    assert t.bucket(5)[1].last_seen == 1.5
    assert t.replacements(5) == ()


def test_failure_without_replacement_leaves_room() -> None:
    t = table(k=3)
    members = full_bucket(t)
    t.failed(members[1], now=5.0)
    assert len(t) == 2
    assert t.observe(contact(in_bucket(OWN, 5, 10)), now=6.0) is None
    assert len(t) == 3
    t.failed(in_bucket(OWN, 7, 0), now=7.0)  # unknown: nothing happens
    assert len(t) == 3


def test_failed_replacement_leaves_the_cache() -> None:
    t = table(k=2)
    full_bucket(t)
    waiting = in_bucket(OWN, 5, 10)
    t.observe(contact(waiting), now=5.0)
    t.failed(waiting, now=6.0)
    assert t.replacements(5) == ()


def test_hearing_from_the_pinged_node_settles_the_ping() -> None:
    t = table(k=2)
    members = full_bucket(t)
    assert t.observe(contact(in_bucket(OWN, 5, 10)), now=5.0) is not None
    t.observe(contact(members[0]), now=6.0)
    assert t.pinging(5) is None
    action = t.observe(contact(in_bucket(OWN, 5, 11)), now=7.0)
    assert action is not None
    assert action.contact.node_id == members[1]


def test_replacement_cache_is_bounded_and_keeps_the_freshest() -> None:
    t = table(k=2, cache=2)
    full_bucket(t)
    newcomers = [in_bucket(OWN, 5, 10 + i) for i in range(4)]
    for step, node_id in enumerate(newcomers):
        t.observe(contact(node_id), now=10.0 + step)
    assert [c.node_id for c in t.replacements(5)] == [newcomers[3], newcomers[2]]
    # Hearing again from a waiting node makes it the freshest.
    t.observe(contact(newcomers[2]), now=20.0)
    assert [c.node_id for c in t.replacements(5)] == [newcomers[2], newcomers[3]]


def test_without_replacement_cache_newcomers_still_trigger_pings() -> None:
    t = table(k=2, cache=0)
    members = full_bucket(t)
    action = t.observe(contact(in_bucket(OWN, 5, 10)), now=5.0)
    assert action is not None
    assert t.replacements(5) == ()
    t.ping_result(members[0], alive=False, now=6.0)
    assert len(t) == 1


def test_buckets_are_independent() -> None:
    t = table(k=1)
    assert t.observe(contact(in_bucket(OWN, 0, 0)), now=1.0) is None
    assert t.observe(contact(in_bucket(OWN, 1, 0)), now=1.0) is None
    assert t.observe(contact(in_bucket(OWN, 159, 0)), now=1.0) is None
    assert t.observe(contact(in_bucket(OWN, 1, 1)), now=2.0) is not None
    stats = t.statistics()
    assert (stats.contacts, stats.buckets_used, stats.replacements) == (3, 3, 1)
    assert stats.contacts_per_bucket[:2] == (1, 1)
    assert stats.contacts_per_bucket[159] == 1
    assert stats.replacements_per_bucket[1] == 1
    assert len(stats.contacts_per_bucket) == NODE_ID_BITS
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.contacts = 0  # type: ignore[misc]


def test_bucket_accessors_check_the_index() -> None:
    t = table()
    with pytest.raises(IndexError):
        t.bucket(NODE_ID_BITS)
    with pytest.raises(IndexError):
        t.replacements(-1)


def test_closest_orders_by_xor_distance() -> None:
    rng = random.Random(1)
    t = RoutingTable(OWN, k=20, rng=random.Random(0))
    for step in range(2000):
        t.observe(contact(NodeID.random(rng)), now=float(step))
    # Random IDs crowd the far buckets, which fill up at k.
    assert len(t) < 2000
    everyone = list(t)
    assert len(everyone) == len(t)
    for _ in range(20):
        target = NodeID.random(rng)
        expected = sorted(everyone, key=lambda c: xor_distance(c.node_id, target))
        assert t.closest(target, 20) == expected[:20]
        excluded = {c.node_id for c in expected[:5]}
        assert t.closest(target, 10, exclude=excluded) == expected[5:15]
    assert t.closest(OWN, 0) == []
    assert len(t.closest(OWN, 10_000)) == len(t)
    with pytest.raises(ValueError, match="count"):
        t.closest(OWN, -1)


def test_refresh_targets_lie_in_their_buckets_and_wait_for_the_interval() -> None:
    t = table(seed=3)
    for index in (0, 7, 100, 159):
        t.observe(contact(in_bucket(OWN, index, 0)), now=0.0)

    # Never looked up: all due at once, as when joining.
    targets = t.buckets_needing_refresh(now=0.0, interval=3600.0)
    assert [bucket_index(OWN, target) for target in targets] == [0, 7, 100, 159]

    t.mark_bucket_used(targets[1], now=10.0)
    t.mark_bucket_used(in_bucket(OWN, 100, 12345), now=20.0)
    t.mark_bucket_used(OWN, now=20.0)  # a self-lookup marks no bucket
    due = t.buckets_needing_refresh(now=100.0, interval=3600.0)
    assert [bucket_index(OWN, target) for target in due] == [0, 159]
    due = t.buckets_needing_refresh(now=3610.0, interval=3600.0)
    assert [bucket_index(OWN, target) for target in due] == [0, 7, 159]
    due = t.buckets_needing_refresh(now=3620.0, interval=3600.0)
    assert [bucket_index(OWN, target) for target in due] == [0, 7, 100, 159]
    with pytest.raises(ValueError, match="interval"):
        t.buckets_needing_refresh(now=0.0, interval=-1.0)


def test_refresh_targets_come_from_the_given_rng() -> None:
    def targets(seed: int) -> list[NodeID]:
        t = table(seed=seed)
        t.observe(contact(in_bucket(OWN, 150, 0)), now=0.0)
        return t.buckets_needing_refresh(now=0.0, interval=1.0)

    assert targets(1) == targets(1)
    assert targets(1) != targets(2)


def test_empty_buckets_need_no_refresh() -> None:
    assert table().buckets_needing_refresh(now=1e9, interval=1.0) == []


def test_one_host_holds_its_share_under_any_number_of_peer_ids() -> None:
    """PeerIDs cost nothing: 300 of one host's take 2 places a bucket and 10 in all; other
    hosts are noted as before, and a place its contact leaves can be taken again."""
    t = RoutingTable(OWN, rng=random.Random(0))
    rng = random.Random(1)
    sybils = [contact(NodeID.random(rng), host="198.51.100.7") for _ in range(300)]
    for sybil in sybils:
        t.observe(sybil, 1.0)
    held = [c for c in t if host_of(c.address) == "198.51.100.7"]
    assert len(held) == 10
    assert max(Counter(bucket_index(OWN, c.node_id) for c in held).values()) <= 2
    assert t.statistics().crowded_out == 290
    others = [contact(NodeID.random(rng), host=f"203.0.113.{i}") for i in range(1, 21)]
    for other in others:
        t.observe(other, 2.0)
    assert all(c.node_id in t for c in others)
    # One of the host's contacts fails: the host may take that place again.
    t.failed(held[0].node_id, 3.0)
    newcomer = next(
        c
        for c in sybils
        if bucket_index(OWN, c.node_id) == bucket_index(OWN, held[0].node_id) and c.node_id not in t
    )
    t.observe(newcomer, 4.0)
    assert newcomer.node_id in t


def test_loopback_and_lan_hosts_are_not_bounded() -> None:
    # Buckets large enough for all: what bounds here would be the per-host share alone.
    t = RoutingTable(OWN, k=100, rng=random.Random(0))
    rng = random.Random(2)
    for host in ("127.0.0.1", "10.1.2.3", "192.168.0.9"):
        peers = [contact(NodeID.random(rng), host=host) for _ in range(30)]
        for peer in peers:
            t.observe(peer, 1.0)
        assert sum(c.node_id in t for c in peers) == 30
    assert t.statistics().crowded_out == 0


def test_a_known_contact_moving_to_a_crowded_host_stays_where_it_was() -> None:
    t = RoutingTable(OWN, max_per_host_per_bucket=1, max_per_host=1, rng=random.Random(0))
    first, second = in_bucket(OWN, 10, 1), in_bucket(OWN, 12, 1)
    t.observe(contact(first, host="198.51.100.7"), 1.0)
    t.observe(contact(second, host="198.51.100.8"), 1.0)
    t.observe(contact(second, host="198.51.100.7", port=5000), 2.0)
    assert t.get(second) == contact(second, host="198.51.100.8", last_seen=2.0)
    # To a host with room it moves.
    t.observe(contact(second, host="198.51.100.9", port=5000), 3.0)
    assert t.get(second) == contact(second, host="198.51.100.9", port=5000, last_seen=3.0)


def test_a_host_is_an_ipv4_address_or_an_ipv6_slash_56() -> None:
    assert host_of("/ip4/198.51.100.7/udp/4000/quic-v1") == "198.51.100.7"
    # A machine can answer from every address of the prefix it was given (a /64, a /56).
    assert host_of("/ip6/2001:db8:1:2::5/udp/4000/quic-v1") == "2001:db8:1::/56"
    assert host_of("/ip6/2001:db8:1:ff::9/udp/4000/quic-v1") == "2001:db8:1::/56"
    assert host_of("/ip6/2001:db8:1:100::9/udp/4000/quic-v1") == "2001:db8:1:100::/56"
    assert host_of("/ip6/::ffff:198.51.100.7/udp/4000/quic-v1") == "198.51.100.7"
    for unbounded in (
        "/ip4/127.0.0.1/udp/4000/quic-v1",
        "/ip6/::ffff:127.0.0.1/udp/4000/quic-v1",
        "/ip4/172.20.0.1/udp/4000/quic-v1",
        "/ip6/::ffff:192.168.1.1/udp/4000/quic-v1",
        "/ip4/169.254.3.4/udp/4000/quic-v1",
        "/ip6/::1/udp/4000/quic-v1",
        "/ip6/fd00::1/udp/4000/quic-v1",
        "/ip6/fe80::1/udp/4000/quic-v1",
        "/dns4/peer.example/udp/4000/quic-v1",
        "not a multiaddr",
    ):
        assert host_of(unbounded) is None, unbounded


def test_a_hosts_share_is_at_least_one_place() -> None:
    with pytest.raises(ConfigError, match="at least 1 per bucket"):
        RoutingTable(OWN, max_per_host_per_bucket=0, rng=random.Random(0))
    with pytest.raises(ConfigError, match="no fewer in the table"):
        RoutingTable(OWN, max_per_host_per_bucket=3, max_per_host=2, rng=random.Random(0))


# --- The state machine --------------------------------------------------------------------------


#: The machine's contacts' hosts by port, and bounds small enough to bite.
MACHINE_HOSTS = {1: "10.0.0.1", 2: "198.51.100.1", 3: "198.51.100.2"}
MACHINE_PER_HOST_PER_BUCKET = 1
MACHINE_PER_HOST = 3


class RoutingTableMachine(RuleBasedStateMachine):
    """Random traffic against the table; small k so buckets fill and overflow often."""

    nodes = Bundle("nodes")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pings: list[NodeID] = []
        self.crowded_out = 0

    @initialize(
        target=nodes,
        own=id_values,
        k=st.integers(min_value=1, max_value=4),
        cache=st.integers(min_value=0, max_value=3),
        seed=st.integers(min_value=0, max_value=2**32),
    )
    def start(self, own: int, k: int, cache: int, seed: int) -> NodeID:
        self.table = RoutingTable(
            NodeID(own),
            k=k,
            replacement_cache_size=cache,
            max_per_host_per_bucket=MACHINE_PER_HOST_PER_BUCKET,
            max_per_host=MACHINE_PER_HOST,
            rng=random.Random(seed),
        )
        return self.table.own

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def contact_at(self, node_id: NodeID, port: int, *, last_seen: float = 0.0) -> Contact:
        """Port 1 is on a LAN host (not bounded), ports 2 and 3 on two public hosts."""
        return contact(node_id, port=port, last_seen=last_seen, host=MACHINE_HOSTS[port])

    def has_room(self, newcomer: Contact, index: int) -> bool:
        """The per-host bounds, recounted from what the table shows."""
        host = host_of(newcomer.address)
        if host is None:
            return True

        def held(indices: range) -> int:
            t = self.table
            places = [c for i in indices for c in t.bucket(i) + t.replacements(i)]
            return sum(host_of(c.address) == host for c in places if c.node_id != newcomer.node_id)

        return (
            held(range(NODE_ID_BITS)) < MACHINE_PER_HOST
            and held(range(index, index + 1)) < MACHINE_PER_HOST_PER_BUCKET
        )

    def observe_checked(self, node_id: NodeID, port: int) -> NodeID:
        t = self.table
        new = self.contact_at(node_id, port)
        if node_id == t.own:
            assert t.observe(new, self.tick()) is None
            assert node_id not in t
            return node_id
        index = bucket_index(t.own, node_id)
        before = t.bucket(index)
        was_pinging = t.pinging(index)
        old = t.get(node_id)
        room = self.has_room(new, index)
        action = t.observe(new, self.tick())
        after = t.bucket(index)
        if old is not None:
            # A known contact whose new host holds its share stays where it was.
            moved = host_of(old.address) == host_of(new.address) or room
            assert action is None
            assert after[-1] == attrs.evolve(new if moved else old, last_seen=self.now)
            assert len(after) == len(before)
        elif not room:
            assert action is None and after == before
            assert node_id not in {c.node_id for c in t.replacements(index)}
            self.crowded_out += 1
            event("newcomer crowded out")
        elif len(before) < t.k:
            assert action is None
            assert after[-1] == self.contact_at(node_id, port, last_seen=self.now)
            assert len(after) == len(before) + 1
        else:
            assert after == before
            if t.replacement_cache_size:
                assert t.replacements(index)[0] == self.contact_at(
                    node_id, port, last_seen=self.now
                )
            if was_pinging is None:
                assert action == PingOldest(before[0])
                self.pings.append(before[0].node_id)
                event("ping issued")
            else:
                assert action is None
                assert t.pinging(index) == was_pinging
        return node_id

    @rule(target=nodes, value=id_values, port=st.integers(1, 3))
    def observe_random(self, value: int, port: int) -> NodeID:
        return self.observe_checked(NodeID(value), port)

    @rule(
        target=nodes,
        index=st.integers(min_value=0, max_value=5),
        offset=st.integers(min_value=0, max_value=31),
        port=st.integers(1, 3),
    )
    def observe_near_own(self, index: int, offset: int, port: int) -> NodeID:
        return self.observe_checked(in_bucket(self.table.own, index, offset % (1 << index)), port)

    @rule(target=nodes)
    def observe_own(self) -> NodeID:
        return self.observe_checked(self.table.own, 1)

    @rule(node_id=nodes, port=st.integers(1, 3))
    def observe_again(self, node_id: NodeID, port: int) -> None:
        self.observe_checked(node_id, port)

    def fail_checked(self, node_id: NodeID, alive: bool | None) -> None:
        t = self.table
        if node_id == t.own:
            t.failed(node_id, self.tick())
            return
        index = bucket_index(t.own, node_id)
        before, waiting = t.bucket(index), t.replacements(index)
        if alive is None:
            t.failed(node_id, self.tick())
        else:
            t.ping_result(node_id, alive, self.tick())
        after = t.bucket(index)
        if alive:
            assert t.replacements(index) == waiting
            if node_id in {c.node_id for c in before}:
                assert (after[-1].node_id, after[-1].last_seen) == (node_id, self.now)
                assert len(after) == len(before)
            else:
                assert after == before
            return
        assert node_id not in t
        assert node_id not in {c.node_id for c in t.replacements(index)}
        if node_id not in {c.node_id for c in before}:
            assert after == before
            return
        waiting = tuple(c for c in waiting if c.node_id != node_id)
        if waiting:
            # Replacement on eviction: the freshest waiting node takes the failed node's place.
            assert len(after) == len(before)
            assert waiting[0] in after
            event("replacement promoted")
            assert t.replacements(index) == waiting[1:]
        else:
            assert len(after) == len(before) - 1

    @rule(node_id=nodes)
    def fail(self, node_id: NodeID) -> None:
        self.fail_checked(node_id, None)

    @rule(node_id=nodes, alive=st.booleans())
    def ping_result(self, node_id: NodeID, alive: bool) -> None:
        self.fail_checked(node_id, alive)

    @precondition(lambda self: self.table.statistics().replacements > 0)
    @rule(pick=st.integers(min_value=0))
    def fail_member_of_a_full_bucket(self, pick: int) -> None:
        crowded = [i for i in range(NODE_ID_BITS) if self.table.replacements(i)]
        members = self.table.bucket(crowded[pick % len(crowded)])
        self.fail_checked(members[pick % len(members)].node_id, None)

    @precondition(lambda self: self.pings)
    @rule(pick=st.integers(min_value=0), alive=st.booleans())
    def answer_ping(self, pick: int, alive: bool) -> None:
        self.fail_checked(self.pings.pop(pick % len(self.pings)), alive)

    @rule(
        target_value=id_values,
        count=st.integers(min_value=0, max_value=12),
        exclude=st.lists(nodes, max_size=4),
    )
    def closest(self, target_value: int, count: int, exclude: list[NodeID]) -> None:
        target = NodeID(target_value)
        found = self.table.closest(target, count, exclude=set(exclude))
        everyone = sorted(
            (c for c in self.table if c.node_id not in exclude),
            key=lambda c: xor_distance(c.node_id, target),
        )
        assert found == everyone[:count]
        distances = [xor_distance(c.node_id, target) for c in found]
        assert distances == sorted(set(distances))

    @rule(interval=st.sampled_from([0.0, 5.0, 50.0]))
    def refresh(self, interval: float) -> None:
        t = self.table
        now = self.tick()
        targets = t.buckets_needing_refresh(now, interval)
        indices = [bucket_index(t.own, target) for target in targets]
        assert indices == sorted(set(indices))
        assert all(t.bucket(index) for index in indices)
        for target in targets:
            t.mark_bucket_used(target, now)
        if interval > 0:
            assert t.buckets_needing_refresh(now, interval) == []

    @invariant()
    def buckets_hold_what_their_distance_says(self) -> None:
        t = self.table
        seen: set[NodeID] = set()
        total = 0
        for index in range(NODE_ID_BITS):
            members, waiting = t.bucket(index), t.replacements(index)
            assert len(members) <= t.k
            assert len(waiting) <= t.replacement_cache_size
            if len(members) < t.k:
                assert waiting == ()
            for c in members + waiting:
                assert c.node_id != t.own
                assert bucket_index(t.own, c.node_id) == index
                assert c.node_id not in seen
                seen.add(c.node_id)
            last_seen = [c.last_seen for c in members]
            assert last_seen == sorted(last_seen)
            pinging = t.pinging(index)
            assert pinging is None or pinging in {c.node_id for c in members}
            total += len(members)
        assert t.own not in t
        assert len(t) == total == len(list(t))
        stats = t.statistics()
        assert stats.contacts == total
        assert sum(stats.contacts_per_bucket) == total
        assert stats.replacements == sum(stats.replacements_per_bucket)
        assert stats.crowded_out == self.crowded_out

    @invariant()
    def no_host_holds_more_than_its_share(self) -> None:
        t = self.table
        everywhere: Counter[str | None] = Counter()
        for index in range(NODE_ID_BITS):
            here = Counter(host_of(c.address) for c in t.bucket(index) + t.replacements(index))
            here.pop(None, None)
            assert all(n <= MACHINE_PER_HOST_PER_BUCKET for n in here.values())
            everywhere.update(here)
        assert all(n <= MACHINE_PER_HOST for n in everywhere.values())

    @invariant()
    def closest_to_own_is_everyone_by_distance(self) -> None:
        t = self.table
        everyone = sorted(t, key=lambda c: xor_distance(c.node_id, t.own))
        assert t.closest(t.own, len(t)) == everyone


RoutingTableMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
TestRoutingTableMachine = RoutingTableMachine.TestCase


# --- Layering -----------------------------------------------------------------------------------


def test_importing_the_dht_pulls_in_no_torch() -> None:
    # The DHT rides on the transport (signatures, codec), so trio may come along; torch never.
    code = (
        "import sys, petals_core.dht\n"
        "watched = ('torch', 'transformers', 'triton')\n"
        "print(','.join(m for m in watched if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True
    )
    assert result.stdout.strip() == ""
