"""Where fraud reports live in the DHT, and reading and writing them as bytes (no torch).

For the model ``prefix``:

- ``{prefix}.fraud`` lists reports: one entry per reporter (its PeerID as subkey, signed by it,
  so no one can add to or remove from another's list), holding up to :data:`MAX_LISTED`
  :class:`Listing` s: who is accused, the digest and size of the evidence, when the answer was
  given.
- ``{prefix}.fraud.{digest}.{i}``: the evidence (an encoded report) cut into values of at most
  :data:`CHUNK_BYTES`.  Chunks are unsigned: a reader checks their digest, so altered chunks
  make the evidence unreadable, never different.

What a report holds and how it is judged is the client's (``petals_core.client._reports``).
"""

from __future__ import annotations

import hashlib
import logging
import math
from typing import Any, Final, TypeGuard

import attrs
import trio

from .._errors import CodecError, ReportRefused
from ..transport import CodecLimits, decode_message_untrusted, encode_message
from ._node import DHTNode

__all__ = [
    "CHUNK_BYTES",
    "MAX_EVIDENCE_BYTES",
    "MAX_LISTED",
    "Listing",
    "ListingKey",
    "fetch_evidence",
    "fetch_listings",
    "index_key",
    "store_evidence",
    "store_listings",
]

logger = logging.getLogger(__name__)

#: The largest evidence stored or read.
MAX_EVIDENCE_BYTES: Final = 4 << 20
#: The largest piece of evidence under one key (below the DHT's 64 KiB values).
CHUNK_BYTES: Final = 60 << 10
#: Reports one reporter lists at a time.
MAX_LISTED: Final = 64
_DIGEST_BYTES: Final = 32
_LISTING_LIMITS: Final = CodecLimits(
    max_frame_bytes=64 << 10,
    max_depth=4,
    max_container_items=8 * MAX_LISTED + 8,
    max_string_bytes=1024,
).without_tensors()


def index_key(prefix: str) -> str:
    return f"{prefix}.fraud"


def chunk_key(prefix: str, digest: bytes, index: int) -> str:
    return f"{prefix}.fraud.{digest.hex()}.{index}"


ListingKey = tuple[bytes, str, int]
"""A listed report as readers judge it (:attr:`Listing.key`): digest, accused, size."""


@attrs.frozen(kw_only=True)
class Listing:
    """One report as its reporter lists it."""

    reporter: str
    accused: str
    digest: bytes
    size: int
    issued: int

    @property
    def key(self) -> ListingKey:
        """What a reader judges a listing by: the evidence (digest and size) and whom it is
        listed against.  Listings of one report by several reporters share it; a listing that
        names the evidence wrongly has a key of its own, so it cannot stand for the right one."""
        return self.digest, self.accused, self.size

    def to_wire(self) -> dict[str, Any]:
        return {
            "accused": self.accused,
            "digest": self.digest,
            "size": self.size,
            "issued": self.issued,
        }


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_listings(reporter: str, value: bytes) -> list[Listing]:
    """A reporter's list, as stored (:class:`ReportRefused` if malformed)."""
    try:
        message = decode_message_untrusted(value, limits=_LISTING_LIMITS, tensors="raw")
    except CodecError as exc:
        raise ReportRefused(f"{reporter}'s list of reports is malformed: {exc}") from None
    entries = message.get("reports")
    if not isinstance(entries, list) or len(entries) > MAX_LISTED:
        raise ReportRefused(f"{reporter}'s list of reports is not a list of {MAX_LISTED} at most")
    found = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise ReportRefused(f"{reporter} lists a report that is not a map")
        accused, digest = entry.get("accused"), entry.get("digest")
        size, issued = entry.get("size"), entry.get("issued")
        if (
            not isinstance(accused, str)
            or not isinstance(digest, bytes)
            or len(digest) != _DIGEST_BYTES
            or not _is_count(size)
            or not _is_count(issued)
            or size == 0
        ):
            raise ReportRefused(f"{reporter} lists a malformed report")
        found.append(
            Listing(reporter=reporter, accused=accused, digest=digest, size=size, issued=issued)
        )
    return found


async def fetch_listings(dht: DHTNode, prefix: str) -> list[Listing]:
    """Every report listed for ``prefix`` (malformed lists are skipped, and logged)."""
    stored = await dht.get(index_key(prefix), latest=True)
    if stored is None:
        return []
    found: list[Listing] = []
    for subkey, entry in stored.entries.items():
        if subkey is None:
            continue
        try:
            found.extend(parse_listings(subkey, entry.value))
        except ReportRefused as exc:
            logger.info("skipping reports: %s", exc)
    return found


async def store_listings(
    dht: DHTNode, prefix: str, listings: list[Listing], expiration: float
) -> None:
    """List ``listings`` (at most :data:`MAX_LISTED`) as ours, replacing our earlier list."""
    if len(listings) > MAX_LISTED:
        raise ValueError(f"at most {MAX_LISTED} reports are listed")
    value = encode_message(
        {"reports": [listing.to_wire() for listing in listings]}, limits=_LISTING_LIMITS
    )
    await dht.store(index_key(prefix), value, expiration, signed=True)


async def store_evidence(dht: DHTNode, prefix: str, data: bytes, expiration: float) -> bytes:
    """Store ``data`` (at most :data:`MAX_EVIDENCE_BYTES`) in chunks; its digest."""
    if len(data) > MAX_EVIDENCE_BYTES:
        raise ReportRefused(
            f"oversized: {len(data)} bytes, and reports are at most {MAX_EVIDENCE_BYTES}"
        )
    digest = hashlib.sha256(data).digest()

    async def store(index: int) -> None:
        chunk = data[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
        if await dht.store(chunk_key(prefix, digest, index), chunk, expiration) == 0:
            logger.warning("no DHT node stored part %d of a report", index)

    async with trio.open_nursery() as nursery:
        for index in range(math.ceil(len(data) / CHUNK_BYTES)):
            nursery.start_soon(store, index)
    return digest


async def fetch_evidence(dht: DHTNode, prefix: str, listing: Listing) -> bytes | None:
    """The evidence ``listing`` names, checked against its digest; None if some of it is not
    found (now); :class:`ReportRefused` if it is oversized or altered."""
    if listing.size > MAX_EVIDENCE_BYTES:
        raise ReportRefused(
            f"oversized: {listing.size} bytes, and reports are at most {MAX_EVIDENCE_BYTES}"
        )
    count = math.ceil(listing.size / CHUNK_BYTES)
    chunks: list[bytes | None] = [None] * count

    async def read(index: int) -> None:
        stored = await dht.get(chunk_key(prefix, listing.digest, index))
        entry = None if stored is None else stored.entries.get(None)
        if entry is not None:
            chunks[index] = entry.value

    async with trio.open_nursery() as nursery:
        for index in range(count):
            nursery.start_soon(read, index)
    present = [chunk for chunk in chunks if chunk is not None]
    if len(present) != count:
        logger.info("%d of %d parts of a report are missing", count - len(present), count)
        return None
    data = b"".join(present)
    if len(data) != listing.size or hashlib.sha256(data).digest() != listing.digest:
        raise ReportRefused("the evidence does not match its digest (altered)")
    return data
