"""One node's records, sans-IO: what it stores, what it refuses and what gives way when it is
full.  ``now`` comes in as an argument (absolute seconds on the clock that expirations use).

A key holds either one value or a dictionary of subkeys, each entry with its own expiration.
Values are opaque bytes here (the encoded form, e.g. :meth:`ServerInfo.to_bytes`), so that size
limits are exact.  The rules, all here:

- **Expiration.**  An entry whose expiration is ``<= now`` is gone: it is refused on arrival,
  dropped lazily when its key is read, and swept by :meth:`RecordStore.expire`.  An expiration
  more than ``max_expiration_s`` after ``now`` is refused, so nothing squats a node for long.
- **Newest wins**, per subkey (or for the single value): an entry replaces the one it finds only
  if it ranks at least as high, comparing ``(expiration, value, signer, signature)`` in that
  order.  The tie-break after the expiration is arbitrary but the same everywhere, so every node,
  and :func:`merge`, picks the same winner.  Re-storing an identical entry is accepted (it changes
  nothing); replaying an older one is refused.
- **Dictionaries beat single values.**  Single values carry no protection (anyone may overwrite
  one with a newer expiration), so a dictionary entry replaces a single value whatever the
  expirations, and a single value is refused by a key that holds unexpired dictionary entries:
  otherwise one unsigned write could wipe every server's announcement for a block.
- **Ownership**, as :mod:`petals_core.dht._records` states it: a record that fails
  :meth:`Record.verify` is refused.
- **Limits.**  A value larger than ``max_value_bytes`` is refused.  Each peer that sends us
  records (``from_peer``) may hold at most ``max_records_per_peer`` entries and
  ``max_bytes_per_peer`` bytes here; our own stores (``from_peer=None``) are not counted.  A key
  holds at most ``max_subkeys_per_key`` entries: when full, a new subkey is refused, unless it
  is signed and an unsigned entry can give way (the soonest to expire); entries signed by their
  peers are never pushed out by newcomers.  The store holds at most ``max_records`` entries and
  ``max_total_bytes`` bytes: when full, the soonest-expiring unsigned entries give way, but only
  to a record that expires strictly later than each of them; signed ones never do.

Checks run cheapest first, signatures before anything that compares with what is stored.  Quotas
bound what one PeerID can take, not what many can: minting PeerIDs is cheap, and the store-wide
limits are what hold then.
"""

from __future__ import annotations

import heapq
import math

import attrs

from .._errors import ConfigError
from ._records import (
    ACCEPTED,
    DEFAULT_MAX_VALUE_BYTES,
    Entry,
    Record,
    StoredValue,
    StoreRefusal,
    StoreResult,
    authorship_problem,
    rank,
)

__all__ = ["RecordStore", "RecordStoreStatistics"]


@attrs.frozen
class RecordStoreStatistics:
    keys: int
    records: int
    #: Bytes counted against ``max_total_bytes``: keys, subkeys, values, signers and signatures.
    stored_bytes: int
    #: Peers holding records here (our own stores not counted).
    peers: int


@attrs.define
class _Held:
    key: str
    subkey: str | None
    entry: Entry
    from_peer: str | None
    footprint: int
    sequence: int


@attrs.define
class _Usage:
    records: int = 0
    bytes: int = 0


def _footprint(record: Record) -> int:
    return (
        len(record.key.encode())
        + len((record.subkey or "").encode())
        + len(record.value)
        + len(record.signer or b"")
        + len(record.signature or b"")
    )


def check_positive_number(name: str, value: object) -> None:
    """A finite number > 0 (not a bool), or ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")


class RecordStore:
    """One node's records, with the rules of the module docstring.  Sans-IO: pass ``now``."""

    def __init__(
        self,
        *,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_expiration_s: float = 24 * 3600.0,
        max_records: int = 100_000,
        max_total_bytes: int = 64 << 20,
        max_records_per_peer: int = 2048,
        max_bytes_per_peer: int = 4 << 20,
        max_subkeys_per_key: int = 1024,
    ) -> None:
        for name, value in [
            ("max_value_bytes", max_value_bytes),
            ("max_expiration_s", max_expiration_s),
            ("max_records", max_records),
            ("max_total_bytes", max_total_bytes),
            ("max_records_per_peer", max_records_per_peer),
            ("max_bytes_per_peer", max_bytes_per_peer),
            ("max_subkeys_per_key", max_subkeys_per_key),
        ]:
            check_positive_number(name, value)
        self._max_value_bytes = max_value_bytes
        self._max_expiration_s = max_expiration_s
        self._max_records = max_records
        self._max_total_bytes = max_total_bytes
        self._max_records_per_peer = max_records_per_peer
        self._max_bytes_per_peer = max_bytes_per_peer
        self._max_subkeys_per_key = max_subkeys_per_key
        self._keys: dict[str, dict[str | None, _Held]] = {}
        self._records = 0
        self._bytes = 0
        self._usage: dict[str, _Usage] = {}
        # (expiration, sequence, key, subkey) of every entry, soonest first; an item whose
        # sequence no longer matches the held entry is stale and skipped when it surfaces.
        self._heap: list[tuple[float, int, str, str | None]] = []
        # The same for unsigned entries only: those a newcomer may push out (see _make_room).
        self._evictable: list[tuple[float, int, str, str | None]] = []
        self._sequence = 0

    def store(self, record: Record, now: float, *, from_peer: str | None = None) -> StoreResult:
        """Store ``record`` received from ``from_peer`` (None: our own), or say why not."""
        if record.expiration <= now:
            return StoreResult(StoreRefusal.EXPIRED, f"expired at {record.expiration}, now {now}")
        if record.expiration > now + self._max_expiration_s:
            return StoreResult(
                StoreRefusal.EXPIRATION_TOO_FAR,
                f"expires {record.expiration - now:.0f} s from now, more than the "
                f"{self._max_expiration_s:.0f} s allowed",
            )
        if len(record.value) > self._max_value_bytes:
            return StoreResult(
                StoreRefusal.VALUE_TOO_LARGE,
                f"a value of {len(record.value)} bytes exceeds {self._max_value_bytes}",
            )
        problem = authorship_problem(record)
        if problem is not None:
            return problem

        held = self._live(record.key, now)
        new = record.entry
        displaced: list[_Held] = []
        if held:
            if record.subkey is None and None not in held:
                return StoreResult(
                    StoreRefusal.KEY_HOLDS_DICTIONARY,
                    f"key {record.key!r} holds a dictionary, which a single value cannot replace",
                )
            current = held.get(record.subkey)
            if current is not None:
                if rank(new) < rank(current.entry):
                    return StoreResult(
                        StoreRefusal.OLDER,
                        f"we hold a newer entry (expiring at {current.entry.expiration}) for key "
                        f"{record.key!r} / subkey {record.subkey!r}",
                    )
                if new == current.entry:
                    return ACCEPTED
                displaced.append(current)
            elif None in held:  # a dictionary entry replaces a single value
                displaced.append(held[None])
            elif len(held) >= self._max_subkeys_per_key:
                # A full key takes a new subkey only in place of an unsigned entry, and only a
                # signed one: entries signed by their peers are never pushed out by newcomers
                # (who could otherwise sign up a thousand keys, expiring later, and take the
                # key from every server announced under it).
                unsigned = [entry for entry in held.values() if entry.entry.signer is None]
                if new.signer is None or not unsigned:
                    return StoreResult(
                        StoreRefusal.KEY_FULL,
                        f"key {record.key!r} holds {len(held)} subkeys, its most",
                    )
                displaced.append(min(unsigned, key=lambda entry: rank(entry.entry)))

        footprint = _footprint(record)
        if from_peer is not None:
            usage = self._peer_usage(from_peer, footprint, displaced)
            if self._over_quota(usage):
                self.expire(now)  # expired entries no longer count
                usage = self._peer_usage(from_peer, footprint, displaced)
            if self._over_quota(usage):
                return StoreResult(
                    StoreRefusal.PEER_QUOTA,
                    f"peer {from_peer} would hold {usage.records} records and {usage.bytes} "
                    f"bytes here, beyond its quota of {self._max_records_per_peer} and "
                    f"{self._max_bytes_per_peer}",
                )

        victims = self._make_room(new.expiration, footprint, displaced, now)
        if victims is None:
            return StoreResult(
                StoreRefusal.STORE_FULL,
                f"the store is full of entries expiring no sooner than {new.expiration}",
            )
        for gone in victims:
            self._remove(gone)
        for gone in displaced:
            self._remove(gone)
        self._insert(record, from_peer, footprint)
        return ACCEPTED

    def get(self, key: str, now: float) -> StoredValue | None:
        """What ``key`` holds at ``now``, or None; expired entries are dropped on the way."""
        held = self._live(key, now)
        if not held:
            return None
        return StoredValue({subkey: entry.entry for subkey, entry in held.items()})

    def expire(self, now: float) -> int:
        """Drop every entry expired at ``now``; return how many were dropped."""
        dropped = 0
        while self._heap and self._heap[0][0] <= now:
            held = self._current(heapq.heappop(self._heap))
            if held is not None:
                self._remove(held)
                dropped += 1
        return dropped

    def keys(self, now: float) -> list[str]:
        """The keys holding unexpired entries at ``now`` (e.g. to hand records to new nodes)."""
        self.expire(now)
        return list(self._keys)

    def statistics(self) -> RecordStoreStatistics:
        return RecordStoreStatistics(
            keys=len(self._keys),
            records=self._records,
            stored_bytes=self._bytes,
            peers=len(self._usage),
        )

    def _live(self, key: str, now: float) -> dict[str | None, _Held] | None:
        held = self._keys.get(key)
        if held is not None:
            for entry in [entry for entry in held.values() if entry.entry.expiration <= now]:
                self._remove(entry)
        return self._keys.get(key)

    def _peer_usage(self, peer: str, footprint: int, displaced: list[_Held]) -> _Usage:
        """What ``peer`` would hold here once its new entry replaced ``displaced``."""
        usage = self._usage.get(peer, _Usage())
        mine = [held for held in displaced if held.from_peer == peer]
        return _Usage(
            records=usage.records + 1 - len(mine),
            bytes=usage.bytes + footprint - sum(held.footprint for held in mine),
        )

    def _over_quota(self, usage: _Usage) -> bool:
        return usage.records > self._max_records_per_peer or usage.bytes > self._max_bytes_per_peer

    def _make_room(
        self, expiration: float, footprint: int, displaced: list[_Held], now: float
    ) -> list[_Held] | None:
        """Entries to evict so that a new entry fits, or None if it cannot; evicts nothing."""
        records = self._records + 1 - len(displaced)
        stored = self._bytes + footprint - sum(held.footprint for held in displaced)
        if records <= self._max_records and stored <= self._max_total_bytes:
            return []
        self.expire(now)
        records = self._records + 1 - len(displaced)
        stored = self._bytes + footprint - sum(held.footprint for held in displaced)
        popped: list[tuple[float, int, str, str | None]] = []
        victims: list[_Held] = []
        heap = self._evictable  # signed entries are never pushed out
        while (records > self._max_records or stored > self._max_total_bytes) and heap:
            if heap[0][0] >= expiration:
                break
            item = heapq.heappop(heap)
            held = self._current(item)
            if held is None:
                continue  # stale: nothing to put back
            popped.append(item)
            if any(held is other for other in displaced):
                continue  # already leaving
            victims.append(held)
            records -= 1
            stored -= held.footprint
        if records > self._max_records or stored > self._max_total_bytes:
            for item in popped:
                heapq.heappush(heap, item)
            return None
        return victims

    def _current(self, item: tuple[float, int, str, str | None]) -> _Held | None:
        _, sequence, key, subkey = item
        held = self._keys.get(key, {}).get(subkey)
        return held if held is not None and held.sequence == sequence else None

    def _insert(self, record: Record, from_peer: str | None, footprint: int) -> None:
        self._sequence += 1
        held = _Held(record.key, record.subkey, record.entry, from_peer, footprint, self._sequence)
        self._keys.setdefault(record.key, {})[record.subkey] = held
        item = (record.expiration, self._sequence, record.key, record.subkey)
        heapq.heappush(self._heap, item)
        if record.signer is None:
            heapq.heappush(self._evictable, item)
        self._records += 1
        self._bytes += footprint
        if from_peer is not None:
            usage = self._usage.setdefault(from_peer, _Usage())
            usage.records += 1
            usage.bytes += footprint
        # Replaced entries leave stale heap items behind; rebuild before they outnumber the live.
        for heap in (self._heap, self._evictable):
            if len(heap) > 2 * self._records + 64:
                heap[:] = [item for item in heap if self._current(item) is not None]
                heapq.heapify(heap)

    def _remove(self, held: _Held) -> None:
        entries = self._keys[held.key]
        del entries[held.subkey]
        if not entries:
            del self._keys[held.key]
        self._records -= 1
        self._bytes -= held.footprint
        if held.from_peer is not None:
            usage = self._usage[held.from_peer]
            usage.records -= 1
            usage.bytes -= held.footprint
            if not usage.records:
                del self._usage[held.from_peer]
