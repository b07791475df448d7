"""Kademlia routing table, sans-IO: node IDs, the XOR metric, k-buckets with replacement caches.

Node IDs are 160 bits: the first 20 bytes of sha2-256 over a PeerID's multihash bytes, or over a
record key, so nodes and keys share one space.  160 bits is what Kademlia and hivemind use; its
80-bit birthday bound is far beyond any swarm, and nothing rests on IDs being hard to choose (a
PeerID is as cheap to mint as a key), so a wider ID would only lengthen the table and the wire.

Layout: one bucket per distance bit.  Bucket ``i`` holds the contacts whose XOR distance from our
own ID lies in ``[2**i, 2**(i + 1))``, that is those sharing exactly ``159 - i`` leading bits with
us.  This is the table that Kademlia's split-on-full ends in, allocated up front: it never needs
restructuring, and "which bucket" is ``distance.bit_length() - 1``.

The rules, all here:

- We add only nodes we heard from directly (``observe``: a reply or a request).  A known node is
  refreshed: it moves to the most-recently-seen end and takes its new address.
- A newcomer joins its bucket while the bucket holds fewer than ``k``.  Otherwise it goes to the
  front of the bucket's replacement cache (freshest first, bounded; the stalest falls off) and the
  table asks the driver to ping the bucket's least-recently-seen contact (``PingOldest``).  Old
  nodes that still answer are the most likely to stay, so they are never evicted for a newcomer.
- One ping per bucket is outstanding at a time; newcomers arriving meanwhile only join the cache.
  The ping is settled by ``ping_result``, by ``failed`` or by hearing from that node.
- A node that failed (a query timed out, a ping went unanswered) leaves the table at once, and the
  freshest replacement of its bucket takes its place.  So a bucket with room has an empty cache.
- One host (an IPv4 address, an IPv6 /56: a host can answer from every address of the prefix
  it was given, commonly a /64 or a /56) holds at most ``max_per_host_per_bucket`` places in a
  bucket and ``max_per_host`` in the table, replacement caches included: PeerIDs cost nothing,
  and one host under many of them could otherwise fill the buckets near a key and answer every
  lookup for it.  A newcomer beyond that is not noted.  Loopback and LAN addresses (RFC 1918,
  IPv6 unique-local, link-local) are not bounded: a swarm on one machine or one LAN is its
  operator's.
- Our own ID is never added.

Nothing here reads a clock, draws global randomness or does I/O: ``now`` and a ``random.Random``
come in, a ``PingOldest`` action comes out, and the driver carries it out.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import ipaddress
import random
from collections import Counter
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Final

import attrs

from .._errors import ConfigError
from .._ip import ip_of, network_of

if TYPE_CHECKING:
    # Type only: importing the transport package at run time would pull in trio and aioquic.
    from ..transport import PeerID

__all__ = [
    "NODE_ID_BITS",
    "Contact",
    "NodeID",
    "PingOldest",
    "RoutingTable",
    "RoutingTableStatistics",
    "bucket_index",
    "host_of",
    "xor_distance",
]

NODE_ID_BITS: Final = 160
_NODE_ID_BYTES: Final = NODE_ID_BITS // 8
_NODE_ID_LIMIT: Final = 1 << NODE_ID_BITS


#: Private networks, whose contacts are not bounded per host (see the module).
_PRIVATE: Final = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7")
)


@functools.lru_cache(maxsize=4096)
def host_of(address: str) -> str | None:
    """The host a contact's multiaddr names, for the per-host bounds: an IPv4 address, or an
    IPv6 /56 (what a home line or a cloud network is commonly given); None for loopback, LAN
    and DNS addresses, which are not bounded."""
    parts = address.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return None
    try:
        ip = ip_of(parts[2])
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or any(ip in net for net in _PRIVATE):
        return None
    return network_of(ip, 56)


def _check_node_id_value(instance: NodeID, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"NodeID wraps an int, got {type(value).__name__}")
    if not 0 <= value < _NODE_ID_LIMIT:
        raise ConfigError(f"a NodeID is a {NODE_ID_BITS}-bit unsigned integer, got {value:#x}")


def _hash_to_id(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:_NODE_ID_BYTES], "big")


@attrs.frozen(order=True, repr=False)
class NodeID:
    """A point in the 160-bit Kademlia space: a node's ID or a record key's.

    Compares, orders and hashes by its integer value; ``str()`` gives 40 hex digits.
    """

    value: int = attrs.field(validator=_check_node_id_value)

    @classmethod
    def from_peer_id(cls, peer_id: PeerID) -> NodeID:
        """The node ID of a peer: sha2-256 of its PeerID's multihash bytes, cut to 160 bits."""
        return cls(_hash_to_id(peer_id.to_bytes()))

    @classmethod
    def from_key(cls, key: bytes | str) -> NodeID:
        """Where a record key lives: sha2-256 of its bytes (UTF-8 for ``str``), cut to 160 bits."""
        if isinstance(key, str):
            return cls(_hash_to_id(key.encode()))
        if isinstance(key, bytes):
            return cls(_hash_to_id(key))
        raise TypeError(f"a record key is bytes or str, got {type(key).__name__}")

    @classmethod
    def from_bytes(cls, data: bytes) -> NodeID:
        """The ID in its 20-byte big-endian form, as ``to_bytes`` writes it."""
        if not isinstance(data, bytes):
            raise TypeError(f"expected bytes, got {type(data).__name__}")
        if len(data) != _NODE_ID_BYTES:
            raise ConfigError(f"a NodeID is {_NODE_ID_BYTES} bytes, got {len(data)}")
        return cls(int.from_bytes(data, "big"))

    @classmethod
    def random(cls, rng: random.Random) -> NodeID:
        return cls(rng.getrandbits(NODE_ID_BITS))

    def to_bytes(self) -> bytes:
        return self.value.to_bytes(_NODE_ID_BYTES, "big")

    def __str__(self) -> str:
        return f"{self.value:040x}"

    def __repr__(self) -> str:
        return f"NodeID(0x{self.value:040x})"


def xor_distance(a: NodeID, b: NodeID) -> int:
    """Kademlia's metric: symmetric, zero only from a point to itself, and unidirectional (for any
    point and distance there is exactly one point at that distance), so no two distinct IDs are
    equally far from a target."""
    return a.value ^ b.value


def bucket_index(own: NodeID, other: NodeID) -> int:
    """The bucket ``other`` belongs in, in a table owned by ``own``: the index of the highest bit
    of their distance, 0 (nearest, one possible ID) to 159 (half the space)."""
    distance = own.value ^ other.value
    if distance == 0:
        raise ValueError(f"{other!r} is the table's own ID, which belongs in no bucket")
    return distance.bit_length() - 1


@attrs.frozen
class Contact:
    """A node as the routing table knows it.

    ``node_id`` must be ``NodeID.from_peer_id(peer_id)``; build contacts with ``from_peer_id``.
    ``address`` is the multiaddr we reach it at; ``last_seen`` is when we last heard from it, on
    the driver's clock.
    """

    node_id: NodeID
    peer_id: PeerID
    address: str
    last_seen: float

    @classmethod
    def from_peer_id(cls, peer_id: PeerID, address: str, *, last_seen: float) -> Contact:
        return cls(NodeID.from_peer_id(peer_id), peer_id, address, last_seen)


@attrs.frozen
class PingOldest:
    """Ping ``contact`` and report with ``ping_result`` (or ``failed``).

    Its bucket is full and a newcomer waits in the replacement cache: if the oldest contact does
    not answer, the freshest replacement takes its place.
    """

    contact: Contact


@attrs.frozen(kw_only=True)
class RoutingTableStatistics:
    contacts: int
    #: Buckets holding at least one contact.
    buckets_used: int
    #: Contacts waiting in replacement caches, all buckets together.
    replacements: int
    #: Buckets whose oldest contact is being pinged.
    pings_outstanding: int
    #: Per bucket, indexed by bucket number (0 nearest).
    contacts_per_bucket: tuple[int, ...]
    replacements_per_bucket: tuple[int, ...]
    #: Newcomers not noted because their host held its share already.
    crowded_out: int = 0


class _Bucket:
    __slots__ = ("contacts", "last_lookup", "pinging", "replacements")

    def __init__(self) -> None:
        # Insertion order is the order of being seen: least recently seen first.
        self.contacts: dict[NodeID, Contact] = {}
        # Insertion order again, so the freshest replacement is last.
        self.replacements: dict[NodeID, Contact] = {}
        # The contact a PingOldest was issued for and not yet settled.
        self.pinging: NodeID | None = None
        # None: no lookup has targeted this bucket yet, so it is due for refresh.
        self.last_lookup: float | None = None

    def insert_by_last_seen(self, contact: Contact) -> None:
        """Add ``contact`` where its ``last_seen`` puts it in the least-recently-seen order."""
        ordered = list(self.contacts.values())
        position = len(ordered)
        while position > 0 and ordered[position - 1].last_seen > contact.last_seen:
            position -= 1
        ordered.insert(position, contact)
        self.contacts = {c.node_id: c for c in ordered}


class RoutingTable:
    """The k-buckets of the node ``own``: who we know, closest first for any target.

    ``k`` contacts per bucket; ``replacement_cache_size`` newcomers wait per full bucket (default
    ``k``); one host holds at most ``max_per_host_per_bucket`` places in a bucket and
    ``max_per_host`` in the table.  ``rng`` draws the random IDs that bucket refreshes look up.
    """

    def __init__(
        self,
        own: NodeID,
        *,
        k: int = 20,
        replacement_cache_size: int | None = None,
        max_per_host_per_bucket: int = 2,
        max_per_host: int = 10,
        rng: random.Random,
    ) -> None:
        if not isinstance(own, NodeID):
            raise TypeError(f"own must be a NodeID, got {type(own).__name__}")
        if k < 1:
            raise ConfigError(f"k must be at least 1, got {k}")
        if replacement_cache_size is None:
            replacement_cache_size = k
        if replacement_cache_size < 0:
            raise ConfigError(
                f"replacement_cache_size must be at least 0, got {replacement_cache_size}"
            )
        if not 1 <= max_per_host_per_bucket <= max_per_host:
            raise ConfigError(
                "a host's places are at least 1 per bucket and no fewer in the table than in a "
                f"bucket, got {max_per_host_per_bucket} per bucket and {max_per_host} in all"
            )
        self.own: Final = own
        self.k: Final = k
        self.replacement_cache_size: Final = replacement_cache_size
        self._max_per_host_per_bucket = max_per_host_per_bucket
        self._max_per_host = max_per_host
        self._rng = rng
        self._buckets = [_Bucket() for _ in range(NODE_ID_BITS)]
        self._count = 0
        # Places per bounded host, contacts and replacements together.
        self._hosts: Counter[str] = Counter()
        self._crowded_out = 0

    def observe(self, contact: Contact, now: float) -> PingOldest | None:
        """Note that we heard from ``contact`` (it answered us or asked us something) at ``now``.

        Returns a ``PingOldest`` when the node's bucket is full and its oldest contact should be
        checked before anyone is evicted; the newcomer then waits in the replacement cache.
        """
        node_id = contact.node_id
        if node_id == self.own:
            return None
        bucket = self._bucket_of(node_id)
        seen = attrs.evolve(contact, last_seen=now)
        known = bucket.contacts.pop(node_id, None)
        if known is not None:
            if not self._move(known, seen, bucket):
                # Its new host holds its share: it stays where we knew it.
                seen = attrs.evolve(known, last_seen=now)
            bucket.contacts[node_id] = seen
            if bucket.pinging == node_id:
                bucket.pinging = None
            return None
        waiting = bucket.replacements.pop(node_id, None)
        if waiting is not None:
            self._place(waiting, -1)
        if not self._has_room(seen, bucket):
            self._crowded_out += 1
            return None
        self._place(seen, 1)
        if len(bucket.contacts) < self.k:
            bucket.contacts[node_id] = seen
            self._count += 1
            return None
        bucket.replacements[node_id] = seen
        while len(bucket.replacements) > self.replacement_cache_size:
            self._place(bucket.replacements.pop(next(iter(bucket.replacements))), -1)
        if bucket.pinging is not None:
            return None
        oldest = next(iter(bucket.contacts.values()))
        bucket.pinging = oldest.node_id
        return PingOldest(oldest)

    def failed(self, node_id: NodeID, now: float) -> None:
        """``node_id`` did not answer (a query timed out or a ping went unanswered): drop it, and
        let the freshest replacement of its bucket take its place.

        ``now`` is taken for symmetry with the other events; a failure refreshes nothing.
        """
        if node_id == self.own:
            return
        bucket = self._settled(node_id)
        waiting = bucket.replacements.pop(node_id, None)
        if waiting is not None:
            self._place(waiting, -1)
        gone = bucket.contacts.pop(node_id, None)
        if gone is None:
            return
        self._place(gone, -1)
        self._count -= 1
        if bucket.replacements:
            _, freshest = bucket.replacements.popitem()
            bucket.insert_by_last_seen(freshest)
            self._count += 1

    def ping_result(self, node_id: NodeID, alive: bool, now: float) -> None:
        """The outcome of a ``PingOldest``: a live node is refreshed and keeps its place (the
        newcomer stays in the replacement cache); a dead one is handled as ``failed``."""
        if not alive:
            self.failed(node_id, now)
            return
        if node_id == self.own:
            return
        bucket = self._settled(node_id)
        contact = bucket.contacts.pop(node_id, None)
        if contact is not None:
            bucket.contacts[node_id] = attrs.evolve(contact, last_seen=now)

    def closest(
        self, target: NodeID, count: int, *, exclude: Collection[NodeID] = frozenset()
    ) -> list[Contact]:
        """Up to ``count`` contacts nearest ``target`` by XOR distance, nearest first."""
        if count < 0:
            raise ValueError(f"count must be at least 0, got {count}")
        goal = target.value
        candidates = (
            contact
            for bucket in self._buckets
            for contact in bucket.contacts.values()
            if contact.node_id not in exclude
        )
        # At most 160 * k contacts: one pass with a bounded heap beats anything cleverer.
        return heapq.nsmallest(count, candidates, key=lambda c: c.node_id.value ^ goal)

    def get(self, node_id: NodeID) -> Contact | None:
        if node_id == self.own:
            return None
        return self._bucket_of(node_id).contacts.get(node_id)

    def __contains__(self, node_id: object) -> bool:
        return isinstance(node_id, NodeID) and self.get(node_id) is not None

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Contact]:
        """Every contact, nearest bucket first, least recently seen first within a bucket."""
        for bucket in self._buckets:
            yield from bucket.contacts.values()

    def bucket(self, index: int) -> tuple[Contact, ...]:
        """The contacts of bucket ``index``, least recently seen first."""
        return tuple(self._buckets[self._check_index(index)].contacts.values())

    def replacements(self, index: int) -> tuple[Contact, ...]:
        """The replacement cache of bucket ``index``, freshest first."""
        return tuple(reversed(self._buckets[self._check_index(index)].replacements.values()))

    def pinging(self, index: int) -> NodeID | None:
        """The contact of bucket ``index`` that a ``PingOldest`` is outstanding for, if any."""
        return self._buckets[self._check_index(index)].pinging

    def buckets_needing_refresh(self, now: float, interval: float) -> list[NodeID]:
        """A random target inside each non-empty bucket that no lookup has aimed at for
        ``interval`` seconds, nearest bucket first.

        A bucket never looked up is due at once, which gives Kademlia's refresh on joining.  Call
        ``mark_bucket_used`` as each lookup starts, or the same buckets come back next time.
        """
        if interval < 0:
            raise ValueError(f"interval must be at least 0, got {interval}")
        targets = []
        for index, bucket in enumerate(self._buckets):
            if not bucket.contacts:
                continue
            if bucket.last_lookup is None or now - bucket.last_lookup >= interval:
                distance = (1 << index) | self._rng.getrandbits(index)
                targets.append(NodeID(self.own.value ^ distance))
        return targets

    def mark_bucket_used(self, target: NodeID, now: float) -> None:
        """A lookup for ``target`` started at ``now``: its bucket needs no refresh for a while.

        A lookup of our own ID falls in no bucket and marks none.
        """
        if target == self.own:
            return
        self._bucket_of(target).last_lookup = now

    def statistics(self) -> RoutingTableStatistics:
        return RoutingTableStatistics(
            contacts=self._count,
            buckets_used=sum(1 for b in self._buckets if b.contacts),
            replacements=sum(len(b.replacements) for b in self._buckets),
            pings_outstanding=sum(1 for b in self._buckets if b.pinging is not None),
            contacts_per_bucket=tuple(len(b.contacts) for b in self._buckets),
            replacements_per_bucket=tuple(len(b.replacements) for b in self._buckets),
            crowded_out=self._crowded_out,
        )

    def _has_room(self, contact: Contact, bucket: _Bucket) -> bool:
        """Whether ``contact``'s host may take one more place in ``bucket``."""
        host = host_of(contact.address)
        if host is None:
            return True
        if self._hosts[host] >= self._max_per_host:
            return False
        held = [*bucket.contacts.values(), *bucket.replacements.values()]
        return sum(host_of(c.address) == host for c in held) < self._max_per_host_per_bucket

    def _place(self, contact: Contact, change: int) -> None:
        """Count a place ``contact``'s host takes (``change`` 1) or leaves (-1)."""
        host = host_of(contact.address)
        if host is not None:
            self._hosts[host] += change
            if self._hosts[host] <= 0:
                del self._hosts[host]

    def _move(self, known: Contact, seen: Contact, bucket: _Bucket) -> bool:
        """Move a known contact (out of ``bucket`` for now) to the host of ``seen``, if that host
        has room; False (nothing changed) if not."""
        if host_of(known.address) == host_of(seen.address):
            return True
        self._place(known, -1)
        if self._has_room(seen, bucket):
            self._place(seen, 1)
            return True
        self._place(known, 1)
        return False

    def _bucket_of(self, node_id: NodeID) -> _Bucket:
        return self._buckets[bucket_index(self.own, node_id)]

    def _settled(self, node_id: NodeID) -> _Bucket:
        """The bucket of ``node_id``, with a ping outstanding for it settled."""
        bucket = self._bucket_of(node_id)
        if bucket.pinging == node_id:
            bucket.pinging = None
        return bucket

    @staticmethod
    def _check_index(index: int) -> int:
        if not 0 <= index < NODE_ID_BITS:
            raise IndexError(f"bucket index {index} outside 0..{NODE_ID_BITS - 1}")
        return index
