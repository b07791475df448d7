"""DHT records: expiration, newest-wins, ownership and signatures, limits and quotas, eviction,
merging answers from several nodes, and the wire forms (fuzzed: only CodecError escapes), the
values peers publish included (server announcements, registry entries)."""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import attrs
import cbor2
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from petals_core._errors import CodecError, ConfigError, LocalProtocolError
from petals_core.dht import ModelInfo, RecordStore
from petals_core.dht._records import (
    Entry,
    Record,
    ServerInfo,
    ServerState,
    StoredValue,
    StoreRefusal,
    decode_record_untrusted,
    encode_record,
    merge,
    merge_records,
)
from petals_core.transport import decode_message_untrusted, encode_message
from petals_core.transport._identity import Identity

NOW = 1_700_000_000.0
ALICE, BOB, CAROL = (Identity.from_private_bytes(bytes([seed]) * 32) for seed in (1, 2, 3))


def unsigned(key: str = "k", subkey: str | None = None, value: bytes = b"v", ttl: float = 60):
    return Record(key, subkey, value, NOW + ttl)


def signed(identity: Identity = ALICE, key: str = "k", value: bytes = b"v", ttl: float = 60):
    return Record.signed(identity, key, value, NOW + ttl)


def refusal(store: RecordStore, record: Record, now: float = NOW, **kwargs: Any):
    result = store.store(record, now, **kwargs)
    assert not result.accepted
    assert result.message
    return result.reason


def accept(store: RecordStore, record: Record, now: float = NOW, **kwargs: Any) -> None:
    result = store.store(record, now, **kwargs)
    assert result.accepted, result


def value_at(store: RecordStore, key: str, now: float = NOW) -> dict[str | None, bytes] | None:
    stored = store.get(key, now)
    return None if stored is None else {sub: entry.value for sub, entry in stored.entries.items()}


# --- records and signatures -----------------------------------------------------------------------


def test_signed_record_is_filed_under_its_signers_peer_id_and_verifies() -> None:
    record = signed(ALICE, "model.3", b"info")
    assert record.subkey == str(ALICE.peer_id)
    assert record.signer == ALICE.public_key_bytes
    assert record.verify()
    accept(RecordStore(), record)


@pytest.mark.parametrize(
    "change",
    [
        {"value": b"forged"},
        {"expiration": NOW + 61},
        {"key": "model.4"},
        {"signature": bytes(64)},
    ],
)
def test_tampered_signed_record_is_refused(change: dict[str, Any]) -> None:
    tampered = attrs.evolve(signed(), **change)
    assert not tampered.verify()
    assert refusal(RecordStore(), tampered) is StoreRefusal.BAD_SIGNATURE


def test_no_one_can_file_a_record_under_another_peers_id() -> None:
    alice = str(ALICE.peer_id)
    # Bob's own record moved under Alice's subkey.
    moved = attrs.evolve(signed(BOB), subkey=alice)
    # Bob's signature over a record naming Alice, with Bob's key or with Alice's.
    forged = Record.signed(BOB, "k", b"v", NOW + 60)
    claims_alice_key = attrs.evolve(forged, subkey=alice, signer=ALICE.public_key_bytes)
    for record, reason in [
        (moved, StoreRefusal.WRONG_SIGNER),
        (claims_alice_key, StoreRefusal.BAD_SIGNATURE),
        (unsigned(subkey=alice), StoreRefusal.UNSIGNED_PROTECTED),
        (attrs.evolve(signed(BOB), subkey=None), StoreRefusal.WRONG_SIGNER),
    ]:
        assert not record.verify()
        assert refusal(RecordStore(), record) is reason


def test_a_key_that_is_a_peer_id_belongs_to_that_peer() -> None:
    alice = str(ALICE.peer_id)
    store = RecordStore()
    assert refusal(store, unsigned(key=alice)) is StoreRefusal.UNSIGNED_PROTECTED
    assert refusal(store, unsigned(key=alice, subkey="x")) is StoreRefusal.UNSIGNED_PROTECTED
    assert refusal(store, signed(BOB, key=alice)) is StoreRefusal.WRONG_SIGNER
    accept(store, signed(ALICE, key=alice))


def test_unsigned_records_are_fine_under_names_that_are_not_peer_ids() -> None:
    store = RecordStore()
    for record in [unsigned(), unsigned(key="d", subkey="free"), unsigned(key="e", subkey="Qm")]:
        assert record.verify()
        accept(store, record)


@pytest.mark.parametrize(
    "fields",
    [
        ("", None, b"v", NOW),
        ("k" * 513, None, b"v", NOW),
        ("k", "", b"v", NOW),
        ("k", "s" * 129, b"v", NOW),
        (b"k", None, b"v", NOW),
        ("k", 3, b"v", NOW),
        ("k", None, "v", NOW),
        ("k", None, bytearray(b"v"), NOW),
        ("k", None, b"v", math.nan),
        ("k", None, b"v", math.inf),
        ("k", None, b"v", "soon"),
        ("k", None, b"v", NOW, bytes(32), None),
        ("k", None, b"v", NOW, None, bytes(64)),
        ("k", None, b"v", NOW, bytes(31), bytes(64)),
        ("k", None, b"v", NOW, bytes(32), bytes(65)),
        ("\ud800", None, b"v", NOW),
    ],
)
def test_records_the_protocol_cannot_carry_are_refused_at_construction(fields: tuple) -> None:
    with pytest.raises(LocalProtocolError):
        Record(*fields)


# --- expiration -----------------------------------------------------------------------------------


def test_expired_and_far_future_records_are_refused() -> None:
    store = RecordStore(max_expiration_s=3600)
    assert refusal(store, unsigned(ttl=0)) is StoreRefusal.EXPIRED
    assert refusal(store, unsigned(ttl=-5)) is StoreRefusal.EXPIRED
    assert refusal(store, unsigned(ttl=3600.5)) is StoreRefusal.EXPIRATION_TOO_FAR
    accept(store, unsigned(ttl=3600))


def test_entries_vanish_when_they_expire() -> None:
    store = RecordStore()
    accept(store, unsigned(key="a", ttl=10))
    accept(store, unsigned(key="d", subkey="x", ttl=10))
    accept(store, unsigned(key="d", subkey="y", ttl=30))
    accept(store, signed(key="d", ttl=20))
    assert value_at(store, "a", NOW + 9.9) == {None: b"v"}
    assert value_at(store, "a", NOW + 10) is None  # dropped lazily
    assert set(value_at(store, "d", NOW + 15) or {}) == {"y", str(ALICE.peer_id)}
    assert store.statistics().records == 2
    assert store.expire(NOW + 20) == 1
    assert store.keys(NOW + 20) == ["d"]
    assert value_at(store, "d", NOW + 20) == {"y": b"v"}
    assert store.expire(NOW + 100) == 1
    assert store.statistics() == attrs.evolve(store.statistics(), keys=0, records=0, stored_bytes=0)
    assert store.keys(NOW + 100) == []


# --- newest wins ----------------------------------------------------------------------------------


def test_newest_wins_for_a_single_value() -> None:
    store = RecordStore()
    accept(store, unsigned(value=b"old", ttl=10))
    accept(store, unsigned(value=b"new", ttl=20))
    assert refusal(store, unsigned(value=b"older", ttl=15)) is StoreRefusal.OLDER
    accept(store, unsigned(value=b"new", ttl=20))  # the same record again changes nothing
    assert value_at(store, "k") == {None: b"new"}
    # Same expiration, other value: the higher value wins, on every node alike.
    assert refusal(store, unsigned(value=b"a", ttl=20)) is StoreRefusal.OLDER
    accept(store, unsigned(value=b"z", ttl=20))
    assert value_at(store, "k") == {None: b"z"}


def test_newest_wins_per_subkey_and_replays_are_refused() -> None:
    store = RecordStore()
    first, second = signed(ALICE, value=b"v1", ttl=10), signed(ALICE, value=b"v2", ttl=20)
    accept(store, first)
    accept(store, signed(BOB, value=b"bob", ttl=5))
    accept(store, second)
    assert refusal(store, first) is StoreRefusal.OLDER  # a replay of a genuine, older record
    assert value_at(store, "k") == {str(ALICE.peer_id): b"v2", str(BOB.peer_id): b"bob"}
    stored = store.get("k", NOW)
    assert stored is not None
    assert stored.entries[str(ALICE.peer_id)] == Entry(
        b"v2", NOW + 20, ALICE.public_key_bytes, second.signature
    )


def test_dictionaries_beat_single_values() -> None:
    store = RecordStore()
    accept(store, unsigned(value=b"single", ttl=100))
    accept(store, signed(ttl=10))  # replaces the single value even though it expires sooner
    assert value_at(store, "k") == {str(ALICE.peer_id): b"v"}
    assert refusal(store, unsigned(ttl=1000)) is StoreRefusal.KEY_HOLDS_DICTIONARY
    accept(store, unsigned(value=b"single", ttl=1000), now=NOW + 10)  # once the dictionary expired
    assert store.statistics().records == 1


# --- limits, quotas, eviction ---------------------------------------------------------------------


def test_oversized_values_are_refused() -> None:
    store = RecordStore(max_value_bytes=100)
    accept(store, unsigned(value=bytes(100)))
    assert refusal(store, unsigned(key="x", value=bytes(101))) is StoreRefusal.VALUE_TOO_LARGE


def test_one_peer_cannot_flood_the_store() -> None:
    store = RecordStore(max_records_per_peer=3, max_bytes_per_peer=10_000)
    for index in range(3):
        accept(store, unsigned(key=f"k{index}"), from_peer="mallory")
    assert refusal(store, unsigned(key="k3"), from_peer="mallory") is StoreRefusal.PEER_QUOTA
    accept(store, unsigned(key="k0", ttl=90), from_peer="mallory")  # replacing its own entry
    accept(store, unsigned(key="k3"), from_peer="honest")
    accept(store, unsigned(key="k4"))  # our own stores are not counted
    # Replacing another's entry counts against the new sender.
    assert refusal(store, unsigned(key="k3", ttl=90), from_peer="mallory") is (
        StoreRefusal.PEER_QUOTA
    )
    assert store.statistics().peers == 2
    # Expired entries give the quota back.
    accept(store, unsigned(key="k5", ttl=200), now=NOW + 100, from_peer="mallory")
    # Bytes count as well as records.
    assert refusal(store, unsigned(key="big", value=bytes(9_998)), from_peer="p") is (
        StoreRefusal.PEER_QUOTA
    )
    accept(store, unsigned(key="big", value=bytes(9_000)), from_peer="p")


def test_a_full_store_evicts_the_soonest_expiring_for_newer_records_only() -> None:
    store = RecordStore(max_records=3)
    for index, ttl in enumerate([30, 10, 20]):
        accept(store, unsigned(key=f"k{index}", ttl=ttl))
    assert refusal(store, unsigned(key="new", ttl=10)) is StoreRefusal.STORE_FULL
    assert refusal(store, unsigned(key="new", ttl=5)) is StoreRefusal.STORE_FULL
    assert sorted(store.keys(NOW)) == ["k0", "k1", "k2"]  # a refusal evicts nothing
    accept(store, unsigned(key="new", ttl=15))
    assert sorted(store.keys(NOW)) == ["k0", "k2", "new"]
    accept(store, unsigned(key="k0", ttl=40))  # a replacement needs no room
    accept(store, unsigned(key="later", ttl=100), now=NOW + 16)  # expired entries go first
    assert sorted(store.keys(NOW + 16)) == ["k0", "k2", "later"]


def test_a_full_store_pushes_out_no_signed_entry() -> None:
    """Entries signed by their peers never give way to newcomers, however long those last (a
    flood of fresh PeerIDs with large values would otherwise push every announcement out);
    unsigned ones do, to a later-expiring record."""
    store = RecordStore(max_records=2)
    accept(store, signed(ALICE, key="a", ttl=10))
    accept(store, unsigned(key="u", ttl=5))
    accept(store, signed(BOB, key="b", ttl=3600))  # in place of the unsigned entry
    assert sorted(store.keys(NOW)) == ["a", "b"]
    assert refusal(store, signed(CAROL, key="c", ttl=3600)) is StoreRefusal.STORE_FULL
    assert refusal(store, unsigned(key="v", ttl=3600)) is StoreRefusal.STORE_FULL
    assert sorted(store.keys(NOW)) == ["a", "b"]


def test_a_store_full_of_bytes_evicts_as_many_entries_as_needed() -> None:
    footprint = len("k0") + 100
    store = RecordStore(max_total_bytes=4 * footprint)
    for index in range(4):
        accept(store, unsigned(key=f"k{index}", value=bytes(100), ttl=10 + index))
    big = unsigned(key="kk", value=bytes(2 * footprint - 2), ttl=10.5)
    assert refusal(store, big) is StoreRefusal.STORE_FULL  # it would need k1 (ttl 11) too
    assert store.statistics().records == 4
    accept(store, attrs.evolve(big, expiration=NOW + 20))
    assert sorted(store.keys(NOW)) == ["k2", "k3", "kk"]
    assert store.statistics().stored_bytes == 4 * footprint


def test_a_full_key_makes_room_only_for_a_signed_entry_in_place_of_an_unsigned_one() -> None:
    """Newcomers never push out entries signed by their peers, however long they last (one
    could sign up a thousand PeerIDs and take the key from every server announced under it);
    a signed entry takes the place of an unsigned one, the soonest to expire."""
    store = RecordStore(max_subkeys_per_key=2)
    accept(store, unsigned(subkey="a", ttl=10))
    accept(store, unsigned(subkey="b", ttl=20))
    assert refusal(store, unsigned(subkey="c", ttl=30)) is StoreRefusal.KEY_FULL
    accept(store, signed(ALICE, ttl=5))
    assert set(value_at(store, "k") or {}) == {"b", str(ALICE.peer_id)}
    accept(store, signed(BOB, ttl=5))
    assert refusal(store, signed(CAROL, ttl=3600)) is StoreRefusal.KEY_FULL
    assert refusal(store, unsigned(subkey="c", ttl=3600)) is StoreRefusal.KEY_FULL
    # An entry's own peer may still replace it.
    accept(store, signed(ALICE, value=b"new", ttl=6))
    assert set(value_at(store, "k") or {}) == {str(ALICE.peer_id), str(BOB.peer_id)}


@pytest.mark.parametrize(
    "limits",
    [
        {"max_records": 0},
        {"max_value_bytes": -1},
        {"max_expiration_s": math.inf},
        {"max_records": "1"},
    ],
)
def test_store_limits_are_validated(limits: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RecordStore(**limits)


class StoreInvariants(RuleBasedStateMachine):
    """Random stores (unsigned, and signed by three peers), reads and sweeps: the books always
    balance, no limit is ever passed, and an entry signed by its peer leaves only by expiring or
    by its peer's newer one."""

    def __init__(self) -> None:
        super().__init__()
        self.store = RecordStore(
            max_records=6,
            max_total_bytes=600,
            max_records_per_peer=3,
            max_bytes_per_peer=300,
            max_subkeys_per_key=3,
            max_value_bytes=30,
            max_expiration_s=50,
        )
        self.now = NOW
        #: (key, subkey) -> expiration of each signed entry the store took.
        self.signed: dict[tuple[str, str], float] = {}

    def _put(self, record: Record, peer: str | None) -> bool:
        before = self.store.get(record.key, self.now)
        result = self.store.store(record, self.now, from_peer=peer)
        after = self.store.get(record.key, self.now)
        if result.accepted:
            assert after is not None
            assert after.entries[record.subkey] == record.entry
        else:
            assert after == before  # a refusal changes nothing under the key
        return result.accepted

    @rule(
        key=st.sampled_from(["a", "b", "c"]),
        subkey=st.sampled_from([None, "x", "y", "z", "w"]),
        size=st.integers(0, 35),
        ttl=st.integers(-2, 52),
        peer=st.sampled_from([None, "p", "q"]),
    )
    def put(self, key: str, subkey: str | None, size: int, ttl: int, peer: str | None) -> None:
        self._put(Record(key, subkey, bytes(size), self.now + ttl), peer)

    @rule(
        key=st.sampled_from(["a", "b", "c"]),
        who=st.sampled_from([ALICE, BOB, CAROL]),
        size=st.integers(0, 35),
        ttl=st.integers(-2, 52),
        peer=st.sampled_from([None, "p", "q"]),
    )
    def put_signed(self, key: str, who: Identity, size: int, ttl: int, peer: str | None) -> None:
        record = Record.signed(who, key, bytes(size), self.now + ttl)
        if self._put(record, peer):
            assert record.subkey is not None
            self.signed[(key, record.subkey)] = record.expiration

    @rule(step=st.integers(0, 20))
    def tick(self, step: int) -> None:
        self.now += step
        self.store.expire(self.now)
        self.signed = {at: until for at, until in self.signed.items() if until > self.now}

    @invariant()
    def signed_entries_stay(self) -> None:
        for (key, subkey), until in self.signed.items():
            value = self.store.get(key, self.now)
            assert value is not None and value.entries[subkey].expiration == until

    @invariant()
    def books_balance(self) -> None:
        stats = self.store.statistics()
        records = []
        for key in self.store.keys(self.now):
            value = self.store.get(key, self.now)
            assert value is not None
            assert len(value.entries) <= 3
            records += value.records(key)
        assert stats.records == len(records) <= 6
        footprints = [
            len(r.key)
            + len(r.subkey or "")
            + len(r.value)
            + len(r.signer or b"")
            + len(r.signature or b"")
            for r in records
        ]
        assert stats.stored_bytes == sum(footprints) <= 600
        assert all(record.expiration > self.now for record in records)
        usage = self.store._usage
        assert all(0 < use.records <= 3 and use.bytes <= 300 for use in usage.values())
        assert stats.peers == len(usage)


TestStoreInvariants = StoreInvariants.TestCase
TestStoreInvariants.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- merging answers from several nodes -----------------------------------------------------------


def test_get_merges_dictionaries_found_on_several_nodes() -> None:
    nodes = [RecordStore() for _ in range(3)]
    alice_old, alice_new = signed(ALICE, value=b"a1", ttl=10), signed(ALICE, value=b"a2", ttl=20)
    accept(nodes[0], alice_old)
    accept(nodes[1], alice_new)
    accept(nodes[1], signed(BOB, value=b"b"))
    accept(nodes[2], signed(CAROL, value=b"c"))
    accept(nodes[2], alice_old)
    merged = None
    for node in nodes:
        merged = merge(merged, node.get("k", NOW))
    assert merged is not None and merged.is_dictionary
    assert {sub: entry.value for sub, entry in merged.entries.items()} == {
        str(ALICE.peer_id): b"a2",
        str(BOB.peer_id): b"b",
        str(CAROL.peer_id): b"c",
    }
    assert merged.expiration == NOW + 60
    # Re-stored elsewhere (caching along the lookup path), the records still verify.
    cache = RecordStore()
    for record in merged.records("k"):
        accept(cache, record, from_peer="client")
    assert cache.get("k", NOW) == merged


def test_merge_of_single_values_and_mixed_kinds() -> None:
    old = StoredValue({None: Entry(b"old", NOW + 1)})
    new = StoredValue({None: Entry(b"new", NOW + 2)})
    table = StoredValue({"x": Entry(b"x", NOW)})
    assert merge(old, new) == merge(new, old) == new
    assert merge(new, table) == merge(table, new) == table
    assert merge(None, old) == merge(old, None) == old
    assert merge(None, None) is None


def test_merge_records_keeps_only_genuine_live_records_for_the_key() -> None:
    genuine = signed(ALICE, key="k", ttl=10)
    answers = [
        genuine,
        attrs.evolve(signed(BOB, key="k", ttl=10), value=b"tampered"),
        unsigned(key="k", subkey=str(CAROL.peer_id)),
        signed(CAROL, key="other"),
        signed(BOB, key="k", ttl=-1),
    ]
    merged = merge_records("k", answers, NOW)
    assert merged == StoredValue({genuine.subkey: genuine.entry})
    assert merge_records("k", [], NOW) is None


def test_stored_value_is_one_kind() -> None:
    with pytest.raises(LocalProtocolError):
        StoredValue({None: Entry(b"a", NOW), "x": Entry(b"b", NOW)})
    with pytest.raises(LocalProtocolError):
        StoredValue({})


entries = st.builds(
    Entry,
    value=st.sampled_from([b"", b"a", b"b"]),
    expiration=st.sampled_from([NOW, NOW + 1, NOW + 2]),
    signer=st.sampled_from([None, bytes(32), b"\xff" * 32]),
    signature=st.sampled_from([None, bytes(64)]),
)
stored_values = st.none() | st.one_of(
    st.builds(lambda entry: StoredValue({None: entry}), entries),
    st.dictionaries(st.sampled_from("wxyz"), entries, min_size=1).map(StoredValue),
)


@settings(max_examples=300, deadline=None)
@given(stored_values, stored_values, stored_values)
def test_merge_is_commutative_and_associative(a: Any, b: Any, c: Any) -> None:
    assert merge(a, b) == merge(b, a)
    assert merge(merge(a, b), c) == merge(a, merge(b, c))
    assert merge(a, a) == a


# --- wire forms -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "record", [unsigned(), unsigned(subkey="s", value=b""), signed(), signed(BOB, key="\u00e9")]
)
def test_records_round_trip_through_the_codec(record: Record) -> None:
    wire = encode_message({"records": [encode_record(record)]})
    decoded = decode_record_untrusted(decode_message_untrusted(wire)["records"][0])
    assert decoded == record
    assert decoded.verify() == record.verify()


def test_decoding_a_record_accepts_int_expirations_and_ignores_unknown_fields() -> None:
    obj = encode_record(unsigned()) | {"expiration": 5, "future": [1, 2], "subkey": None}
    assert decode_record_untrusted(obj) == Record("k", None, b"v", 5.0)


VALID_RECORD = encode_record(signed())


@pytest.mark.parametrize(
    "change",
    [
        {"key": None},
        {"key": 5},
        {"key": ""},
        {"value": "text"},
        {"value": None},
        {"value": bytes(65 << 10)},
        {"expiration": None},
        {"expiration": True},
        {"expiration": math.nan},
        {"expiration": -math.inf},
        {"expiration": 10**400},
        {"subkey": b"bytes"},
        {"signer": None},
        {"signature": b"short"},
        {"signer": "text"},
    ],
)
def test_malformed_records_are_refused(change: dict[str, Any]) -> None:
    with pytest.raises(CodecError):
        decode_record_untrusted(VALID_RECORD | change)


def test_the_record_value_limit_is_the_callers() -> None:
    with pytest.raises(CodecError):
        decode_record_untrusted(VALID_RECORD, max_value_bytes=0)


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=60)
    | st.binary(max_size=70),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3)
    ),
    max_leaves=10,
)
record_fields = st.fixed_dictionaries(
    {},
    optional={
        name: json_like | st.sampled_from([VALID_RECORD[name]])
        for name in ["key", "subkey", "value", "expiration", "signer", "signature"]
    },
)


@settings(max_examples=400, deadline=None)
@given(json_like | record_fields)
def test_decode_record_untrusted_raises_only_codec_error(obj: Any) -> None:
    try:
        record = decode_record_untrusted(obj)
    except CodecError:
        return
    assert isinstance(record, Record)
    assert decode_record_untrusted(encode_record(record)) == record
    record.verify()


# --- ServerInfo -----------------------------------------------------------------------------------

INFO = ServerInfo(
    state="online",
    throughput=123.5,
    start_block=3,
    end_block=7,
    version="0.1.0",
    public_name="lab box",
    inference_rps=500,
    forward_rps=20.5,
    torch_dtype="bfloat16",
    quant_type="nf4",
    adapters=["lora-a", "lora-b"],
    cache_tokens_left=2**40,
    next_pings={str(BOB.peer_id): 0.01, str(CAROL.peer_id): 0.25},
    push_grants=1,
)


def test_announced_rates_are_bounded() -> None:
    """Throughput and request rates are at most MAX_RATE: two announcements of the largest
    float made every sum over a block's servers overflow, which took down every server choosing
    its blocks and every client planning a forward pass."""
    for field in ("throughput", "inference_rps", "forward_rps"):
        with pytest.raises(LocalProtocolError, match=f"{field} is a number from 0 to 1e"):
            attrs.evolve(INFO, **{field: 1.7e308}).to_bytes()
    assert ServerInfo.from_bytes_untrusted(attrs.evolve(INFO, throughput=1e9).to_bytes())


def test_server_info_round_trips() -> None:
    assert INFO.state is ServerState.ONLINE
    assert INFO.adapters == ("lora-a", "lora-b")
    assert ServerInfo.from_bytes_untrusted(INFO.to_bytes()) == INFO
    minimal = ServerInfo(
        state=ServerState.JOINING,
        throughput=0,
        start_block=0,
        end_block=1,
        version="",
        torch_dtype="float32",
    )
    assert ServerInfo.from_bytes_untrusted(minimal.to_bytes()) == minimal
    assert minimal.next_pings == {} and minimal.public_name is None
    assert hash(minimal) == hash(attrs.evolve(minimal))


def test_server_info_readers_ignore_unknown_fields() -> None:
    message = cbor2.loads(INFO.to_bytes())
    message |= {"new_field": {"nested": [1, 2.5, b"x"]}, "public_name": None}
    decoded = ServerInfo.from_bytes_untrusted(encode_message(message))
    assert decoded == attrs.evolve(INFO, public_name=None)


@pytest.mark.parametrize(
    "change",
    [
        {"state": "napping"},
        {"state": 2},
        {"throughput": -1.0},
        {"throughput": math.inf},
        {"throughput": "fast"},
        {"start_block": -1},
        {"start_block": 1.0},
        {"end_block": 3},
        {"end_block": True},
        {"end_block": 2**32 + 1},
        {"version": 1},
        {"version": "v" * 257},
        {"torch_dtype": None},
        {"adapters": "lora-a"},
        {"adapters": [1]},
        {"adapters": ["a"] * 65},
        {"cache_tokens_left": -5},
        {"next_pings": [1]},
        {"next_pings": {"not-a-peer": 0.1}},
        {"next_pings": {str(BOB.peer_id): -0.1}},
        {"next_pings": {str(BOB.peer_id): math.nan}},
        {"forward_rps": [1.0]},
        {"push_grants": True},
        {"push_grants": 0},
        {"push_grants": "1"},
    ],
)
def test_malformed_server_info_is_refused(change: dict[str, Any]) -> None:
    message = cbor2.loads(INFO.to_bytes()) | change
    with pytest.raises(CodecError):
        ServerInfo.from_bytes_untrusted(cbor2.dumps(message))
    with pytest.raises(LocalProtocolError):
        ServerInfo(**{**attrs.asdict(INFO, recurse=False), **change})


@pytest.mark.parametrize("data", [b"", b"\x00", cbor2.dumps([1]), cbor2.dumps({"state": "online"})])
def test_server_info_that_is_not_a_map_of_fields_is_refused(data: bytes) -> None:
    with pytest.raises(CodecError):
        ServerInfo.from_bytes_untrusted(data)


#: What peers publish as DHT values, with a valid example of each: their decoders are fuzzed alike.
PEER_VALUES: dict[str, ServerInfo | ModelInfo] = {
    "server_info": INFO,
    "model_info": ModelInfo(num_blocks=32, repository="org/model", model_type="llama"),
}


def fields_like(valid: ServerInfo | ModelInfo) -> st.SearchStrategy[dict[str, Any]]:
    """Maps with some of ``valid``'s fields, each either its value or anything at all."""
    return st.fixed_dictionaries(
        {},
        optional={
            name: json_like | st.sampled_from([value])
            for name, value in cbor2.loads(valid.to_bytes()).items()
        },
    )


@pytest.mark.parametrize("valid", PEER_VALUES.values(), ids=PEER_VALUES)
@settings(max_examples=400, deadline=None)
@given(st.data())
def test_values_from_peer_maps_raise_only_codec_error(
    valid: ServerInfo | ModelInfo, draw: Any
) -> None:
    decode = type(valid).from_bytes_untrusted
    try:
        value = decode(cbor2.dumps(draw.draw(fields_like(valid))))
    except CodecError:
        return
    assert decode(value.to_bytes()) == value


@pytest.mark.parametrize("valid", PEER_VALUES.values(), ids=PEER_VALUES)
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.data())
def test_values_from_peer_bytes_raise_only_codec_error(
    valid: ServerInfo | ModelInfo, data: bytes, draw: Any
) -> None:
    encoded = valid.to_bytes()
    cut = draw.draw(st.integers(0, len(encoded)))
    for candidate in [data, encoded[:cut], encoded[:cut] + data + encoded[cut:]]:
        try:
            type(valid).from_bytes_untrusted(candidate)
        except CodecError:
            pass


def test_records_import_no_torch() -> None:
    code = "import sys, petals_core.dht._record_store\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True
    )
    assert result.stdout.strip() == "False"
