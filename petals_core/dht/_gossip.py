"""Push-pull gossip of server announcements among the nodes interested in one model, and the
peer table snapshot that routing reads.  Sans-IO: ``now`` and a ``random.Random`` come in, actions
come out for a driver to send.

One :class:`Gossip` serves one topic: the records whose key starts with ``f"{prefix}."`` (a
model's ``dht_prefix``), held in the node's :class:`RecordStore`, which the DHT feeds too.

- **Rumour mongering (push).**  A new announcement is pushed to ``fanout`` random members at
  once (:meth:`Gossip.publish`); a member that finds a record *new* to it forwards it to
  ``fanout`` others with the push's ``ttl`` decremented, and forwards nothing once the ``ttl`` is
  0.  A record is new when the store accepts it and held nothing of equal rank for its key and
  subkey, so each node forwards a given record at most once: duplicates die where they land.
- **Anti-entropy (push-pull).**  Every ``interval_s`` or so a node sends ``fanout`` random
  members a :class:`Digest` of ``(key, subkey, expiration)`` for its unexpired topic records.
  The receiver pushes back what the sender lacks or holds older, and asks (:class:`Want`) for
  what the sender holds newer.  This repairs nodes the rumour missed (pure rumour mongering
  reaches about 94% of nodes with fanout 3) and nodes that joined late; such replies travel
  with ``ttl=0``, so repairs are not re-broadcast.
- **Trust.**  Signatures, expirations and quotas are the store's rules: whatever it refuses is
  counted and never forwarded.  Records outside the topic are refused here.  Digests, wants and
  pushes are cut to ``max_digest_entries`` / ``max_push_records`` / ``max_push_bytes`` both
  ways, an incoming ``ttl`` is capped at ``push_ttl``, and each member may send
  ``max_messages_per_peer_per_s`` messages (a token bucket); peers that are not members share
  one bucket of ``max_unknown_messages_per_s``, so a server not yet known from the DHT is still
  heard, while a flood from minted PeerIDs is not.
"""

from __future__ import annotations

import math
import random
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, NamedTuple

import attrs

from .._errors import CodecError, ConfigError, LocalProtocolError
from ._record_store import RecordStore, check_positive_number
from ._records import Record, ServerInfo, ServerState, StoreRefusal, peer_id_or_none

__all__ = [
    "Action",
    "Digest",
    "DigestEntry",
    "Gossip",
    "GossipStatistics",
    "PeerTableSnapshot",
    "Push",
    "Want",
    "build_snapshot",
]

# Nodes tick at slightly different moments so that their digests do not all go out at once.
_JITTER: Final = 0.25


class DigestEntry(NamedTuple):
    """What a digest says about one record: which it is and how new."""

    key: str
    subkey: str | None
    expiration: float


@attrs.frozen
class Digest:
    """Send ``entries``, a summary of our topic records, to ``peer``."""

    peer: str
    entries: tuple[DigestEntry, ...]


@attrs.frozen
class Push:
    """Send ``records`` to ``peer``, which may forward the new ones ``ttl`` more hops."""

    peer: str
    records: tuple[Record, ...]
    ttl: int


@attrs.frozen
class Want:
    """Ask ``peer`` for the records it listed as newer than ours."""

    peer: str
    entries: tuple[DigestEntry, ...]


Action = Digest | Push | Want


@attrs.frozen
class GossipStatistics:
    peers: int
    digests_sent: int
    digests_received: int
    pushes_sent: int
    pushes_received: int
    wants_sent: int
    wants_received: int
    #: Records that arrived in pushes and were new to us.
    records_new: int
    #: Records that arrived in pushes and that we held already (same or newer).
    duplicates: int
    #: Records the store (or the topic check) refused.
    refusals: int
    #: Messages dropped by the rate limits.
    messages_dropped: int


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


@attrs.define
class _Bucket:
    tokens: float
    updated: float

    def take(self, now: float, rate: float) -> bool:
        """Refill at ``rate`` per second up to one second's worth, then spend one token."""
        self.tokens = min(rate, self.tokens + max(0.0, now - self.updated) * rate)
        self.updated = max(self.updated, now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class Gossip:
    """Gossip of one topic's records for the node ``own_peer``, whose records live in ``store``.

    The driver tells it the topic's members (:meth:`add_peer`, :meth:`remove_peer`), calls
    :meth:`tick` when :meth:`next_deadline` passes, hands it what peers send (``on_*``), and
    sends the actions each call returns.
    """

    def __init__(
        self,
        own_peer: str,
        store: RecordStore,
        *,
        prefix: str,
        rng: random.Random,
        num_blocks: int | None = None,
        fanout: int = 3,
        interval_s: float = 1.0,
        push_ttl: int = 8,
        max_digest_entries: int = 4096,
        max_push_records: int = 256,
        max_push_bytes: int = 1 << 20,
        max_messages_per_peer_per_s: float = 50.0,
        max_unknown_messages_per_s: float = 20.0,
    ) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise ConfigError(f"prefix must be a non-empty string, got {prefix!r}")
        for name, value in [
            ("fanout", fanout),
            ("push_ttl", push_ttl),
            ("max_digest_entries", max_digest_entries),
            ("max_push_records", max_push_records),
            ("max_push_bytes", max_push_bytes),
        ]:
            _positive_int(name, value)
        for name, number in [
            ("interval_s", interval_s),
            ("max_messages_per_peer_per_s", max_messages_per_peer_per_s),
            ("max_unknown_messages_per_s", max_unknown_messages_per_s),
        ]:
            check_positive_number(name, number)
        self._own_peer = own_peer
        self._store = store
        self._topic = f"{prefix}."
        self._num_blocks = num_blocks
        self._rng = rng
        self._fanout = fanout
        self._interval_s = float(interval_s)
        self._push_ttl = push_ttl
        self._max_digest_entries = max_digest_entries
        self._max_push_records = max_push_records
        self._max_push_bytes = max_push_bytes
        self._peer_rate = float(max_messages_per_peer_per_s)
        self._unknown_rate = float(max_unknown_messages_per_s)
        # A list for sampling, and each member's index in it for O(1) removal.
        self._peers: list[str] = []
        self._peer_index: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._unknown_bucket = _Bucket(self._unknown_rate, -math.inf)
        self._deadline = -math.inf
        self._counts = dict.fromkeys(
            [field.name for field in attrs.fields(GossipStatistics) if field.name != "peers"], 0
        )

    # Membership

    def add_peer(self, peer_id: str) -> None:
        if peer_id == self._own_peer or peer_id in self._peer_index:
            return
        self._peer_index[peer_id] = len(self._peers)
        self._peers.append(peer_id)

    def remove_peer(self, peer_id: str) -> None:
        index = self._peer_index.pop(peer_id, None)
        if index is None:
            return
        last = self._peers.pop()
        if last != peer_id:
            self._peers[index] = last
            self._peer_index[last] = index
        self._buckets.pop(peer_id, None)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # Our side

    def publish(self, record: Record, now: float) -> list[Push]:
        """Store our own new ``record`` and push it to ``fanout`` random members at once.

        A record outside the topic raises :class:`LocalProtocolError`; one the store refuses
        (expired, older than what it holds) is counted and pushed nowhere.
        """
        if not record.key.startswith(self._topic):
            raise LocalProtocolError(f"key {record.key!r} is not in topic {self._topic!r}")
        if not self._store.store(record, now).accepted:
            self._counts["refusals"] += 1
            return []
        return self._pushes(self._sample(self._fanout), [record], self._push_ttl)

    def next_deadline(self) -> float:
        """When :meth:`tick` next has work: ``-inf`` before the first tick."""
        return self._deadline

    def tick(self, now: float) -> list[Digest]:
        """Once the deadline passed: send a digest to ``fanout`` random members."""
        if now < self._deadline:
            return []
        self._deadline = now + self._interval_s * self._rng.uniform(1 - _JITTER, 1 + _JITTER)
        return self.digest_round(now)

    def digest_round(self, now: float) -> list[Digest]:
        """Digests to ``fanout`` random members now, whatever the deadline: for drivers that keep
        the schedule on a clock of their own (the record clock may be a test's frozen one)."""
        targets = self._sample(self._fanout)
        if not targets:
            return []
        entries = self._digest_entries(now)
        self._counts["digests_sent"] += len(targets)
        return [Digest(peer, entries) for peer in targets]

    # Their side

    def on_digest(self, from_peer: str, entries: Sequence[DigestEntry], now: float) -> list[Action]:
        """Push what ``from_peer`` lacks or holds older; want what it holds newer."""
        if not self._admit(from_peer, now):
            return []
        self._counts["digests_received"] += 1
        theirs: dict[tuple[str, str | None], float] = {}
        for entry in entries[: self._max_digest_entries]:
            if self._in_topic(entry) and entry.expiration > now:
                theirs[entry.key, entry.subkey] = entry.expiration
        mine = self._topic_records(now)
        missing = [
            record
            for record in mine
            if theirs.get((record.key, record.subkey), -math.inf) < record.expiration
        ]
        held = {(record.key, record.subkey): record.expiration for record in mine}
        wanted = [
            DigestEntry(key, subkey, expiration)
            for (key, subkey), expiration in theirs.items()
            if held.get((key, subkey), -math.inf) < expiration
        ]
        actions: list[Action] = []
        if missing:
            self._rng.shuffle(missing)  # a peer far behind gets a different part each round
            actions.extend(self._pushes([from_peer], missing, 0))
        if wanted:
            self._counts["wants_sent"] += 1
            actions.append(Want(from_peer, tuple(wanted[: self._max_push_records])))
        return actions

    def on_want(self, from_peer: str, entries: Sequence[DigestEntry], now: float) -> list[Push]:
        """Push the records ``from_peer`` asked for that we still hold."""
        if not self._admit(from_peer, now):
            return []
        self._counts["wants_received"] += 1
        records: list[Record] = []
        for entry in entries[: self._max_push_records]:
            if not self._in_topic(entry):
                continue
            stored = self._store.get(entry.key, now)
            held = None if stored is None else stored.entries.get(entry.subkey)
            if held is not None:
                records.append(Record(entry.key, entry.subkey, *held))
        return self._pushes([from_peer], records, 0)

    def on_push(
        self, from_peer: str, records: Sequence[Record], now: float, *, ttl: int
    ) -> list[Push]:
        """Store what ``from_peer`` pushed; forward the records new to us ``ttl - 1`` more hops
        to ``fanout`` random members, unless ``ttl`` is 0."""
        if not self._admit(from_peer, now):
            return []
        self._counts["pushes_received"] += 1
        new: list[Record] = []
        for record in records[: self._max_push_records]:
            if not isinstance(record, Record) or not self.is_announcement(record):
                self._counts["refusals"] += 1
                continue
            stored = self._store.get(record.key, now)
            before = None if stored is None else stored.entries.get(record.subkey)
            result = self._store.store(record, now, from_peer=from_peer)
            if result.reason is StoreRefusal.OLDER or record.entry == before:
                self._counts["duplicates"] += 1
            elif not result.accepted:
                self._counts["refusals"] += 1
            else:
                self._counts["records_new"] += 1
                new.append(record)
        ttl = min(ttl, self._push_ttl) if isinstance(ttl, int) else 0
        if not new or ttl < 1:
            return []
        return self._pushes(self._sample(self._fanout, exclude=from_peer), new, ttl - 1)

    def statistics(self) -> GossipStatistics:
        return GossipStatistics(peers=len(self._peers), **self._counts)

    # Helpers

    def _admit(self, peer: str, now: float) -> bool:
        if peer in self._peer_index:
            bucket = self._buckets.get(peer)
            if bucket is None:
                bucket = self._buckets[peer] = _Bucket(self._peer_rate, now)
            admitted = bucket.take(now, self._peer_rate)
        else:
            admitted = self._unknown_bucket.take(now, self._unknown_rate)
        if not admitted:
            self._counts["messages_dropped"] += 1
        return admitted

    def is_announcement(self, record: Record) -> bool:
        """Whether ``record`` is what the topic holds: a server's announcement for one block
        (key ``{prefix}.{block}``, block below ``num_blocks`` if known), signed by the server
        (its PeerID the subkey).  Nothing else may fill the topic's store."""
        return record.signer is not None and self._is_block_key(record.key)

    def _is_block_key(self, key: str) -> bool:
        block = key.removeprefix(self._topic)
        return (
            key.startswith(self._topic)
            and block.isascii()
            and block.isdigit()
            and (block == "0" or not block.startswith("0"))
            and (self._num_blocks is None or int(block) < self._num_blocks)
        )

    def _in_topic(self, entry: object) -> bool:
        """Whether ``entry`` is a well-formed digest entry in our topic (a driver may hand us
        whatever a peer sent)."""
        return (
            isinstance(entry, DigestEntry)
            and isinstance(entry.key, str)
            and self._is_block_key(entry.key)
            and (entry.subkey is None or isinstance(entry.subkey, str))
            and isinstance(entry.expiration, int | float)
            and not isinstance(entry.expiration, bool)
            and math.isfinite(entry.expiration)
        )

    def _sample(self, count: int, *, exclude: str | None = None) -> list[str]:
        extra = 1 if exclude in self._peer_index else 0
        picked = self._rng.sample(self._peers, min(len(self._peers), count + extra))
        return [peer for peer in picked if peer != exclude][:count]

    def _topic_records(self, now: float) -> list[Record]:
        records: list[Record] = []
        for key in self._store.keys(now):
            if key.startswith(self._topic):
                stored = self._store.get(key, now)
                if stored is not None:
                    records.extend(stored.records(key))
        return records

    def _digest_entries(self, now: float) -> tuple[DigestEntry, ...]:
        entries = [
            DigestEntry(record.key, record.subkey, record.expiration)
            for record in self._topic_records(now)
        ]
        if len(entries) > self._max_digest_entries:
            # A different sample each round, so that every record gets compared in time.
            entries = self._rng.sample(entries, self._max_digest_entries)
        return tuple(entries)

    def _pushes(self, peers: Iterable[str], records: Sequence[Record], ttl: int) -> list[Push]:
        """One push per peer of as many of ``records`` as the size limits allow."""
        chosen: list[Record] = []
        size = 0
        for record in records:
            footprint = len(record.key) + len(record.value) + 256  # 256: subkey, signature, map
            if len(chosen) == self._max_push_records or size + footprint > self._max_push_bytes:
                break
            chosen.append(record)
            size += footprint
        if not chosen:
            return []
        pushes = [Push(peer, tuple(chosen), ttl) for peer in peers]
        self._counts["pushes_sent"] += len(pushes)
        return pushes


def _frozen_blocks(
    blocks: Mapping[int, Mapping[str, ServerInfo]],
) -> Mapping[int, Mapping[str, ServerInfo]]:
    return types.MappingProxyType(
        {index: types.MappingProxyType(dict(servers)) for index, servers in blocks.items()}
    )


@attrs.frozen
class PeerTableSnapshot:
    """The servers of one model at ``now``: ``blocks[block_index][peer_id]`` is the
    announcement that peer made for that block.  Read-only; ``version`` grows with each rebuild
    so that readers can tell a newer table from an older one."""

    prefix: str
    now: float
    version: int
    blocks: Mapping[int, Mapping[str, ServerInfo]] = attrs.field(
        converter=_frozen_blocks, hash=False
    )

    def servers_for(self, block_index: int) -> Mapping[str, ServerInfo]:
        """The servers announcing ``block_index``, by PeerID (empty if none)."""
        return self.blocks.get(block_index, _EMPTY)

    @property
    def peer_ids(self) -> frozenset[str]:
        return frozenset(peer for servers in self.blocks.values() for peer in servers)


_EMPTY: Final[Mapping[str, ServerInfo]] = types.MappingProxyType({})


def build_snapshot(
    store: RecordStore, prefix: str, now: float, *, version: int = 0
) -> PeerTableSnapshot:
    """The peer table for ``prefix`` from what ``store`` holds at ``now``.

    Only keys ``f"{prefix}.{block_index}"`` count, only entries whose subkey is a PeerID (the
    store made sure the owner signed them), only announcements that decode, are not OFFLINE,
    and cover the block they were filed under.
    """
    topic = f"{prefix}."
    decoded: dict[bytes, ServerInfo | None] = {}  # a server files one value under many blocks
    blocks: dict[int, dict[str, ServerInfo]] = {}
    for key in store.keys(now):
        suffix = key[len(topic) :]
        if not key.startswith(topic) or not suffix.isdigit() or not suffix.isascii():
            continue
        block_index = int(suffix)
        stored = store.get(key, now)
        if stored is None:
            continue
        for subkey, entry in stored.entries.items():
            if subkey is None or peer_id_or_none(subkey) is None:
                continue
            if entry.value not in decoded:
                try:
                    decoded[entry.value] = ServerInfo.from_bytes_untrusted(entry.value)
                except CodecError:
                    decoded[entry.value] = None
            info = decoded[entry.value]
            if (
                info is not None
                and info.state is not ServerState.OFFLINE
                and info.start_block <= block_index < info.end_block
            ):
                blocks.setdefault(block_index, {})[subkey] = info
    return PeerTableSnapshot(prefix=prefix, now=now, version=version, blocks=blocks)
