"""Fraud reports: publishing the evidence of a caught server, and reading others'.

A client that catches a server answering wrongly (``_sequential``, ``_inference``: two other servers
agree, and not with it) files the server's signed answer
(:class:`~petals_core.protocol.FraudReport`) in its :class:`ReportBook`; the book's watcher
(``_report_judge``) publishes it in the DHT (the layout is ``petals_core.dht._fraud``'s: a signed
list per reporter, the evidence in chunks checked by their digest).

Reports last :data:`REPORT_TTL_S` from the answer (the receipt's signed time), at most 24 hours
in the DHT (its limit), and are at most ``MAX_EVIDENCE_BYTES`` (4 MiB): a larger one is not
published.  A reader refuses (:class:`ReportRefused`, with the reason) what is oversized,
missing, altered, malformed, forged, about another model, expired or dated in the future
(:func:`check_report`), and then asks other servers whether the answer is wrong
(``_report_judge``).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Callable
from typing import Final

import attrs
import trio

from .._errors import CodecError, ReportRefused
from ..dht import (
    MAX_EVIDENCE_BYTES,
    MAX_LISTED,
    DHTNode,
    Listing,
    ListingKey,
    fetch_evidence,
    store_evidence,
    store_listings,
)
from ..protocol import FraudReport, Receipt
from ..transport import CodecLimits, PeerID, decode_message_untrusted, encode_message
from ._checks import CLOCK_SKEW_S
from ._sequence_manager import RemoteSequenceManager

__all__ = [
    "REPORT_TTL_S",
    "ReportBook",
    "Verdict",
    "book_of",
    "check_report",
    "decode_report",
    "encode_report",
    "fetch_report",
    "publish",
]

#: How long after its answer a report counts.
REPORT_TTL_S: Final = 24 * 3600.0
#: The DHT keeps a value at most this long after it is stored.
_DHT_HORIZON_S: Final = 23 * 3600.0
_REPORT_LIMITS: Final = CodecLimits(
    max_frame_bytes=MAX_EVIDENCE_BYTES,
    max_depth=8,
    max_container_items=1 << 18,
    max_tensor_elements=MAX_EVIDENCE_BYTES,
    max_tensor_dims=8,
    max_string_bytes=4096,
)


def encode_report(report: FraudReport) -> bytes:
    """The report's bytes; :class:`ReportRefused` if it exceeds ``MAX_EVIDENCE_BYTES``."""
    try:
        return encode_message(report.to_wire(), limits=_REPORT_LIMITS)
    except CodecError as exc:
        raise ReportRefused(f"the report is too large to publish: {exc}") from None


def decode_report(data: bytes) -> FraudReport:
    try:
        return FraudReport.from_wire_untrusted(
            decode_message_untrusted(data, limits=_REPORT_LIMITS)
        )
    except CodecError as exc:
        raise ReportRefused(f"malformed: {exc}") from None


def check_report(report: FraudReport, *, model: str, now: float) -> None:
    """Raise :class:`ReportRefused` unless ``report`` is about ``model``, signed by the accused
    over its question and answer, and its answer is at most :data:`REPORT_TTL_S` old at ``now``
    (Unix seconds).  Whether the answer is wrong takes other servers (``_report_judge``)."""
    if report.model != model:
        raise ReportRefused(f"the report is about model {report.model!r}, not {model!r}")
    try:
        signer = str(PeerID.from_public_key(report.signature.signer))
    except ValueError:
        raise ReportRefused("forged: the signer's key is not an Ed25519 key") from None
    if signer != report.accused:
        raise ReportRefused(
            f"forged: the answer is signed by {signer}, not by the accused {report.accused}"
        )
    try:
        receipt = report.receipt
    except ValueError as exc:
        raise ReportRefused(f"malformed: {exc}") from None
    if not receipt.verify(report.signature):
        raise ReportRefused(
            f"forged: {report.accused}'s signature does not cover this question and answer"
        )
    if report.kind == "step":
        _check_steps(report, receipt)
    age = now - report.signature.issued
    if age < -CLOCK_SKEW_S:
        raise ReportRefused(f"the answer is dated {-age:.0f} s in the future")
    if age > REPORT_TTL_S:
        raise ReportRefused(
            f"expired: the answer is {age / 3600:.1f} h old, and reports count for "
            f"{REPORT_TTL_S / 3600:.0f} h"
        )


def _check_steps(report: FraudReport, receipt: Receipt) -> None:
    """A step report's steps make one session on the accused's server, each signed by it
    (``receipt``: the report's own)."""
    assert report.position is not None
    batch = report.asked["hidden_states"].shape[0]
    cache = 0  # positions the server's cache holds before each step
    sequence = [*((step.position, step.asked) for step in report.steps)]
    sequence.append((report.position, report.asked))
    for index, (position, asked) in enumerate(sequence):
        hidden = asked["hidden_states"]
        start = position - hidden.shape[1]
        if hidden.shape[0] != batch or not 0 <= start <= cache or (index == 0 and start != 0):
            raise ReportRefused(
                f"malformed: step {index} (to position {position}) does not follow the steps "
                "before it in one session"
            )
        cache = position
    steps = report.step_receipts()
    for step, signature in steps:
        if signature.signer != report.signature.signer or not step.verify(signature):
            raise ReportRefused(
                f"forged: {report.accused}'s signature does not cover the step to position "
                f"{step.step} of the session"
            )
    if not report.chained([*(step for step, _ in steps), receipt]):
        raise ReportRefused(
            "forged: the steps are not the session's whole chain of receipts (one is missing, "
            "added or out of order)"
        )


@attrs.frozen(kw_only=True)
class Verdict:
    """What a client concluded of one report: ``upheld`` (the accused answered wrongly: it is
    no longer used) or refused, and why."""

    accused: str
    reporters: frozenset[str]
    upheld: bool
    reason: str
    #: When the report stops counting (Unix seconds): the verdict is forgotten then.
    expires: float = math.inf


@attrs.define(eq=False)
class ReportBook:
    """A client's reports: those to publish, those it published, and its verdicts on everyone's
    (by :attr:`Listing.key`: the evidence and whom it is listed against)."""

    outbox: list[FraudReport] = attrs.field(factory=list)
    #: Servers that listed reports accuse but the peer table does not show (yet): judged when
    #: they appear.
    waiting: set[str] = attrs.field(factory=set)
    #: Per listed report, the tries that could not decide it (too few servers answered), and
    #: when the last was (Unix seconds).
    undecided: dict[ListingKey, tuple[int, float]] = attrs.field(factory=dict)
    #: Whether the last round left new reports for the next one.
    more: bool = False
    published: dict[bytes, Listing] = attrs.field(factory=dict)
    verdicts: dict[ListingKey, Verdict] = attrs.field(factory=dict)
    #: This client's key for drawing the servers that recompute reported answers
    #: (:meth:`checkers_rank`): nobody else can tell which servers it will ask.
    _secret: bytes = attrs.field(factory=lambda: secrets.token_bytes(16))
    #: Set when there is something to publish.
    wake: trio.Event = attrs.field(factory=trio.Event)
    #: Whether the manager runs the book's watcher, and publishes what is left when it stops.
    watched: bool = False
    #: Set (and replaced) each time a report is published.
    _published_now: trio.Event = attrs.field(factory=trio.Event)
    #: Held by a round of judging (``judge_listed``): two rounds at once (the watcher's and a
    #: caller's) would try the same listing, and the one left undecided would undo the other's
    #: verdict.
    judging: trio.Lock = attrs.field(factory=trio.Lock)

    def report(self, report: FraudReport) -> None:
        """File ``report`` for publication (by the book's watcher)."""
        self.outbox.append(report)
        self.wake.set()

    def on_published(self) -> None:
        self._published_now.set()
        self._published_now = trio.Event()

    async def wait_published(self, count: int) -> None:
        """Wait until ``count`` of this client's reports are listed."""
        while len(self.published) < count:
            await self._published_now.wait()

    def forget_expired(self, now: float) -> None:
        """Drop the verdicts on reports that no longer count."""
        for key in [k for k, verdict in self.verdicts.items() if verdict.expires <= now]:
            del self.verdicts[key]

    def checkers_rank(self, accused: str) -> Callable[[str], bytes]:
        """The order in which this client asks servers to recompute answers of ``accused``'s
        (see ``RemoteSequenceManager.make_sequence``): a keyed hash, the same for every report
        about that server, so that listing reports again draws no other servers."""
        prefix = accused.encode() + b"\0"
        return lambda peer: hashlib.blake2b(prefix + peer.encode(), key=self._secret).digest()


def book_of(manager: RemoteSequenceManager) -> ReportBook:
    """The book of ``manager``'s client (shared with its slices)."""
    state = manager.state
    if state.reports is None:
        state.reports = ReportBook()
    book = state.reports
    assert isinstance(book, ReportBook)
    return book


async def publish(
    dht: DHTNode, prefix: str, book: ReportBook, report: FraudReport, *, now: float
) -> bytes:
    """Store ``report``'s evidence and list it with ours; its digest (:class:`ReportRefused` if
    it cannot be published: too large, or expired)."""
    data = encode_report(report)
    issued = report.signature.issued
    expiration = min(issued + REPORT_TTL_S, now + _DHT_HORIZON_S)
    if expiration <= now:
        raise ReportRefused("expired: the answer is older than reports last")
    digest = await store_evidence(dht, prefix, data, expiration)
    reporter = str(dht.peer_id)
    listing = Listing(
        reporter=reporter, accused=report.accused, digest=digest, size=len(data), issued=issued
    )
    book.verdicts[listing.key] = Verdict(
        accused=report.accused,
        reporters=frozenset({reporter}),
        upheld=True,
        reason="caught by this client",
        expires=issued + REPORT_TTL_S,
    )
    book.published[digest] = listing
    live = sorted(
        (listing for listing in book.published.values() if listing.issued + REPORT_TTL_S > now),
        key=lambda listing: listing.issued,
    )[-MAX_LISTED:]
    book.published = {listing.digest: listing for listing in live}
    last = min(max(listing.issued for listing in live) + REPORT_TTL_S, now + _DHT_HORIZON_S)
    await store_listings(dht, prefix, live, last)
    book.on_published()
    return digest


async def fetch_report(dht: DHTNode, prefix: str, listing: Listing) -> FraudReport | None:
    """The report ``listing`` names, read from the DHT and checked against its digest; None if
    its evidence is not found (now); :class:`ReportRefused` if it is oversized, altered,
    malformed or about another server than listed."""
    data = await fetch_evidence(dht, prefix, listing)
    if data is None:
        return None
    report = await trio.to_thread.run_sync(decode_report, data)
    if report.accused != listing.accused:
        raise ReportRefused(
            f"the evidence is about {report.accused}, but listed against {listing.accused}"
        )
    return report
