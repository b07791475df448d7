"""A followed model: gossip of its servers' announcements, fed by the DHT too, and the peer table
snapshot that routing reads.

:meth:`DHTNode.follow` returns a :class:`Topic` and runs two loops for it in the node's nursery:

- every ``update_period_s`` it reads every block's announcements from the DHT (one attempt; the
  next period tries again), which is how a node that just joined, or one the gossip missed,
  learns the swarm;
- every ``gossip_interval_s`` (with jitter) it sends digests to ``fanout`` random members and
  answers what comes back; our own announcements go out by push at once (:meth:`publish`).

Members are the servers of the topic that announce ``addresses``: whoever the snapshot lists
(joining or online), minus ourselves.  A client-mode node gossips by pulling: its digests are
answered in the reply (``pushes`` for what it lacks, ``wants`` for what it has newer), since no
one can dial it.

On the wire a gossip call is ``dht.gossip`` with ``{"prefix", "kind": "digest" | "want" |
"push", "entries": [[key, subkey, expiration], ...] | "records": [...], "ttl"}``; the reply
carries ``{"pushes": [...], "wants": [...]}`` meant for the caller (``ttl`` 0: not forwarded).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import trio

from .._errors import CodecError, ConfigError
from ..transport import Multiaddr
from ._gossip import (
    Action,
    Digest,
    DigestEntry,
    Gossip,
    PeerTableSnapshot,
    Push,
    Want,
    build_snapshot,
)
from ._record_store import RecordStore
from ._records import Record, decode_record_untrusted, encode_record

if TYPE_CHECKING:
    from ._node import DHTNode

__all__ = ["Topic"]

logger = logging.getLogger(__name__)

#: Entries of a digest or want we read from one message.
MAX_GOSSIP_ENTRIES: Final = 4096
#: Records of a push we read from one message.
MAX_GOSSIP_RECORDS: Final = 256
# A snapshot older than this is rebuilt on read even when nothing arrived, so that expired
# announcements leave it.
_SNAPSHOT_MAX_AGE_S: Final = 1.0


def encode_entries(entries: Sequence[DigestEntry]) -> list[list[Any]]:
    return [[entry.key, entry.subkey, entry.expiration] for entry in entries]


def decode_entries_untrusted(obj: object) -> list[DigestEntry]:
    """Digest entries a peer sent; raises only :class:`CodecError`."""
    if not isinstance(obj, list) or len(obj) > MAX_GOSSIP_ENTRIES:
        raise CodecError(f"'entries' is a list of at most {MAX_GOSSIP_ENTRIES} entries")
    entries = []
    for item in obj:
        if not isinstance(item, list) or len(item) != 3:
            raise CodecError("a digest entry is [key, subkey, expiration]")
        key, subkey, expiration = item
        if (
            not isinstance(key, str)
            or not (subkey is None or isinstance(subkey, str))
            or isinstance(expiration, bool)
            or not isinstance(expiration, int | float)
            or not math.isfinite(expiration)
        ):
            raise CodecError("a digest entry is [str, str | null, finite number]")
        entries.append(DigestEntry(key, subkey, float(expiration)))
    return entries


def decode_records_untrusted(obj: object) -> list[Record]:
    if not isinstance(obj, list) or len(obj) > MAX_GOSSIP_RECORDS:
        raise CodecError(f"'records' is a list of at most {MAX_GOSSIP_RECORDS} records")
    return [decode_record_untrusted(item) for item in obj]


class Topic:
    """One followed ``prefix`` of ``num_blocks`` blocks: its records, gossip and snapshot.

    Build it with :meth:`DHTNode.follow`; it lives until the node closes or
    :meth:`DHTNode.unfollow`.
    """

    def __init__(
        self,
        dht: DHTNode,
        nursery: trio.Nursery,
        *,
        prefix: str,
        num_blocks: int,
        gossip: Gossip,
        store: RecordStore,
        clock: Callable[[], float],
        rng: random.Random,
    ) -> None:
        self._dht = dht
        self._nursery = nursery
        self._rng = rng
        self.prefix = prefix
        self.num_blocks = num_blocks
        #: Read it, don't drive it: the topic does.
        self.gossip: Final = gossip
        self._store = store
        self._clock = clock
        self._snapshot = build_snapshot(store, prefix, clock(), version=0)
        self._built_at = -math.inf
        self._dirty = True
        self._changed = trio.Event()
        self._addresses: dict[str, list[Multiaddr]] = {}
        self._refreshes = 0
        self._limited_read_at = -math.inf
        self._reading: trio.Event | None = None

    @property
    def refreshes(self) -> int:
        """DHT reads of the whole topic finished so far."""
        return self._refreshes

    def snapshot(self) -> PeerTableSnapshot:
        """The servers of this model now; rebuilt when something arrived or it got old."""
        now = self._clock()
        if self._dirty or now - self._built_at > _SNAPSHOT_MAX_AGE_S:
            self._snapshot = build_snapshot(
                self._store, self.prefix, now, version=self._snapshot.version + 1
            )
            self._built_at = now
            self._dirty = False
            self._update_members()
        return self._snapshot

    async def wait_snapshot(
        self, predicate: Callable[[PeerTableSnapshot], bool]
    ) -> PeerTableSnapshot:
        """Wait until the snapshot satisfies ``predicate``; returns that snapshot.

        It is checked whenever records arrive and at least every second (announcements also
        leave by expiring).  Bound it with a trio deadline.
        """
        while True:
            snapshot = self.snapshot()
            if predicate(snapshot):
                return snapshot
            with trio.move_on_after(_SNAPSHOT_MAX_AGE_S):
                await self._changed.wait()

    def address_of(self, peer_id: str) -> Multiaddr | None:
        """The first address the server ``peer_id`` announced (its best), if known."""
        addresses = self.addresses_of(peer_id)
        return addresses[0] if addresses else None

    def addresses_of(self, peer_id: str) -> list[Multiaddr]:
        """Where the server ``peer_id`` said it can be dialled, best first (from its
        announcements; to dial with ``Node.connect_any``); empty if unknown."""
        self.snapshot()
        return self._addresses.get(peer_id, [])

    async def refresh(self, *, min_interval_s: float = 0.0) -> None:
        """Read every block's announcements from the DHT now (one attempt: a failure is logged
        and the table stays as it was).  Callers meanwhile wait for the read in progress instead
        of starting another.  With ``min_interval_s``, a read asked for less than that after the
        last one asked for with it is skipped, so that asking often (e.g. for a peer nobody
        announced) costs at most one read per ``min_interval_s``."""
        if self._reading is not None:
            await self._reading.wait()
            return
        now = self._clock()
        if min_interval_s > 0:
            if now - self._limited_read_at < min_interval_s:
                return
            self._limited_read_at = now
        self._reading = reading = trio.Event()
        try:
            # What each node answers counts at once: a route can be planned from the first
            # answers while the read goes on to the rest of the nodes nearest each block.
            records = await self._dht._fetch_records(
                self.prefix, range(self.num_blocks), on_records=self._take
            )
        except Exception:
            logger.warning("reading the servers of %r failed", self.prefix, exc_info=True)
        else:
            self.add_records(records)
        finally:
            self._reading = None
            reading.set()

    # -- what the node calls ---------------------------------------------------------------------

    def publish(self, record: Record) -> list[Push]:
        pushes = self.gossip.publish(record, self._clock())
        self._mark_changed()
        return pushes

    def add_records(self, records: Sequence[Record]) -> None:
        """Records of a whole read of the topic from the DHT (whose signatures the store checks
        once more)."""
        self._take(records)
        self._refreshes += 1

    def _take(self, records: Sequence[Record]) -> None:
        """Records from the DHT, of a whole read or of one node's answer during one."""
        now = self._clock()
        changed = False
        for record in records:
            if self.gossip.is_announcement(record):
                changed |= self._store.store(record, now).accepted
        if changed:
            self._mark_changed()
        else:
            self._update_members()

    def on_message(self, from_peer: str, request: dict[str, Any]) -> list[Action]:
        """A gossip message from ``from_peer``; returns the actions it causes."""
        kind = request.get("kind")
        now = self._clock()
        before = self.gossip.statistics().records_new
        actions: list[Action]
        if kind == "digest":
            actions = self.gossip.on_digest(
                from_peer, decode_entries_untrusted(request.get("entries")), now
            )
        elif kind == "want":
            actions = list(
                self.gossip.on_want(
                    from_peer, decode_entries_untrusted(request.get("entries")), now
                )
            )
        elif kind == "push":
            ttl = request.get("ttl")
            if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 0:
                raise CodecError("'ttl' is an integer >= 0")
            actions = list(
                self.gossip.on_push(
                    from_peer, decode_records_untrusted(request.get("records")), now, ttl=ttl
                )
            )
        else:
            raise CodecError(f"unknown gossip kind {kind!r}; expected digest, want or push")
        if self.gossip.statistics().records_new != before:
            self._mark_changed()
        return actions

    def digest_round(self) -> list[Digest]:
        self.snapshot()  # members follow the table
        return self.gossip.digest_round(self._clock())

    async def refresh_forever(self, period_s: float) -> None:
        while True:
            await self.refresh()
            await trio.sleep(period_s)

    async def gossip_forever(self, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s * self._rng.uniform(0.75, 1.25))
            for digest in self.digest_round():
                self.send_soon(digest)

    def send_soon(self, action: Action) -> None:
        """Carry ``action`` to its peer in the background."""
        self._nursery.start_soon(self._send, action)

    # -- helpers ---------------------------------------------------------------------------------

    async def _send(self, action: Action) -> None:
        """Carry ``action`` to its peer and act on the reply (pushes for us, wants from us)."""
        addresses = self.addresses_of(action.peer)
        if not addresses:
            return
        reply = await self._dht._call(addresses, "dht.gossip", encode_action(self.prefix, action))
        if reply is None:
            return
        try:
            pushes = reply.get("pushes", [])
            if pushes:
                self.on_message(action.peer, {"kind": "push", "ttl": 0, "records": pushes})
            wants = decode_entries_untrusted(reply.get("wants", []))
            if wants:
                for push in self.on_message(
                    action.peer, {"kind": "want", "entries": reply["wants"]}
                ):
                    self.send_soon(push)
        except CodecError as exc:
            logger.debug("a bad gossip reply from %s: %s", action.peer, exc)

    def _mark_changed(self) -> None:
        self._dirty = True
        self._changed.set()
        self._changed = trio.Event()

    def _update_members(self) -> None:
        addresses: dict[str, list[Multiaddr]] = {}
        for servers in self._snapshot.blocks.values():
            for peer_id, info in servers.items():
                if peer_id in addresses or not info.addresses:
                    continue
                usable = []
                for text in info.addresses:
                    try:
                        address = Multiaddr.parse(text)
                    except ConfigError:
                        continue
                    if address.peer_id is not None and str(address.peer_id) == peer_id:
                        usable.append(address)
                if usable:
                    addresses[peer_id] = usable
        own = str(self._dht.peer_id)
        addresses.pop(own, None)
        for peer_id in self.gossip.peers - addresses.keys():
            self.gossip.remove_peer(peer_id)
        for peer_id in addresses:
            self.gossip.add_peer(peer_id)
        self._addresses = addresses


def encode_action(prefix: str, action: Action) -> dict[str, Any]:
    """The ``dht.gossip`` request that carries ``action`` to its peer."""
    if isinstance(action, Push):
        return {
            "prefix": prefix,
            "kind": "push",
            "ttl": action.ttl,
            "records": [encode_record(record) for record in action.records],
        }
    kind = "digest" if isinstance(action, Digest) else "want"
    return {"prefix": prefix, "kind": kind, "entries": encode_entries(action.entries)}


def reply_for(caller: str, actions: Sequence[Action]) -> tuple[dict[str, Any], list[Action]]:
    """Split ``actions`` into the reply to ``caller`` and the ones to send to others."""
    pushes: list[dict[str, Any]] = []
    wants: list[list[Any]] = []
    others: list[Action] = []
    for action in actions:
        if action.peer != caller or isinstance(action, Digest):
            others.append(action)
        elif isinstance(action, Push):
            pushes.extend(encode_record(record) for record in action.records)
        elif isinstance(action, Want):
            wants.extend(encode_entries(action.entries))
    return {"pushes": pushes, "wants": wants}, others
