"""Judging fraud reports by asking other servers, and the client's report watcher.

A report passes :func:`~petals_core.client._reports.check_report` when the accused did give its
answer to its question.  Whether that answer is wrong, no report can say on its own: the client
asks the question again of a server other than the accused, computing in the dtype and
quantisation the accused signed.  If that server's answer agrees with the accused's, the report
is about a correct answer and is refused.  If not, a third server decides: the report is upheld
only if the third agrees with the second and not with the accused, so one lying server cannot
frame an honest one by filing a report and confirming it.  The servers asked are drawn by a
keyed hash of this client's (:meth:`ReportBook.checkers_rank`), never by what servers announce:
servers that claim much throughput are not asked more, and listing reports about a server again
draws the same ones.  Where too few servers hold the blocks, the report waits for the next round.
An upheld report bans the accused as a caught server is banned
(:meth:`RemoteSequenceManager.on_caught`).

The watcher (:func:`watch_reports`, run with the manager's network part by :func:`run_manager`)
publishes the client's own reports and, every ``reports_period_s``, reads the model's list and
judges up to :data:`CHECKS_PER_ROUND` new reports about servers in its peer table.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Final

import attrs
import torch
import trio

from .._errors import PetalsError, ReportRefused, TransportError
from ..dht import Listing, ListingKey, ServerInfo, fetch_listings
from ..protocol import BackwardRequest, FraudReport, OpenSession, Signature, Step
from ..routing import MissingBlocksError, RouteSpan
from ._checks import TOLERANCE, compare, hops_allowance, tolerance
from ._reports import (
    REPORT_TTL_S,
    ReportBook,
    Verdict,
    book_of,
    check_report,
    fetch_report,
    publish,
)
from ._sequence_manager import RemoteSequenceManager
from ._sequential import _backward_span, _forward_along
from ._session_core import SpanState
from ._span_call import RETRIABLE, SpanCall

__all__ = ["CHECKS_PER_ROUND", "judge", "judge_listed", "run_manager", "watch_reports"]

logger = logging.getLogger(__name__)

#: New reports a client judges per round (each costs the swarm two recomputations).
CHECKS_PER_ROUND: Final = 4
#: Tries, one per ``reports_period_s``, that may leave a report undecided (too few servers could
#: recompute it, its evidence not found) before it is refused.
MAX_UNDECIDED: Final = 3
#: Servers drawn in turn for one opinion on a report when those drawn before fail.
_TRIES: Final = 3
#: How soon a round follows one that left new reports for it: a flood of listings is judged
#: at most :data:`CHECKS_PER_ROUND` a second.
_NEXT_ROUND_S: Final = 1.0


@attrs.frozen
class _Answer:
    """Other servers' answer to a report's question: its tensors, the signature of the last
    server's answer, who computed it, and what compression between them may have changed."""

    tensors: dict[str, torch.Tensor]
    signature: Signature | None
    checkers: set[str]
    allowance: float = 0.0


class _Undecided(Exception):
    """Why a report cannot be decided now (too few servers, its evidence not found)."""


def _too_few(report: FraudReport, like: ServerInfo) -> str:
    start, end = report.blocks
    return (
        f"no server but the accused that holds blocks {start}:{end} in {like.torch_dtype} "
        f"({like.quant_type} quantisation) could recompute it"
    )


def _off(
    a: Mapping[str, torch.Tensor],
    a_signature: Signature | None,
    b: Mapping[str, torch.Tensor],
    b_signature: Signature | None,
) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(compare(a[name], a_signature, b[name], b_signature) for name in a)


async def _ask(
    manager: RemoteSequenceManager,
    report: FraudReport,
    exclude: set[str],
    like: ServerInfo,
    rank: Callable[[str], bytes],
) -> _Answer:
    """The report's question answered by servers not in ``exclude`` (of the dtype and
    quantisation the accused signed, drawn by ``rank``; those drawn that fail are passed over,
    up to :data:`_TRIES` draws), and who answered; :class:`_Undecided` where none can now."""
    start, end = report.blocks
    # The evidence travels as it is: compressing it again would change the question.
    sub = RemoteSequenceManager(
        attrs.evolve(manager.config, active_adapter=report.adapter, compression=None),
        manager.num_blocks,
        block_indices=range(start, end),
        state=manager.state,
    )
    span = RouteSpan(start=start, end=end, peer_id=report.accused)
    # A step's session is replayed on one server, a backward asked of one: both need all
    # blocks.  A forward goes to whoever comes first in the draw, even where that makes a
    # chain: preferring servers that hold the whole span would let announcing wide spans
    # make a server a judge.
    whole = report.kind != "forward"
    failure: Exception | None = None
    for _ in range(_TRIES):
        try:
            route = await sub.make_sequence(
                start,
                end,
                mode="impartial",
                exclude=exclude,
                like=like,
                wait=False,
                whole=whole,
                rank=rank,
            )
        except MissingBlocksError:
            break
        try:
            return await _answer(sub, route, report)
        except RETRIABLE as exc:
            logger.info("a server recomputing a report against %s failed: %r", span.peer_id, exc)
            failure = exc
            exclude = exclude | {hop.peer_id for hop in route}
    if failure is not None:
        raise _Undecided(f"the servers drawn to recompute it failed ({failure!r})")
    raise _Undecided(_too_few(report, like))


async def _answer(
    manager: RemoteSequenceManager, route: list[RouteSpan], report: FraudReport
) -> _Answer:
    """The answer of ``route``'s servers to the report's question."""
    if report.kind == "step":
        return await _replay_session(manager, route[0], report)
    asked = report.asked
    if report.kind == "forward":
        x, _, evidence = await _forward_along(
            manager, route, asked["hidden_states"], asked.get("prompts"), False
        )
        signatures = [answer.signature for answer in evidence]
        checkers = {answer.accused for answer in evidence}
        return _Answer({"hidden_states": x}, signatures[-1], checkers, hops_allowance(signatures))
    request = BackwardRequest(
        blocks=report.blocks,
        active_adapter=report.adapter,
        hidden_states=asked["hidden_states"],
        grad_outputs=asked["grad_outputs"],
        prompts=asked.get("prompts"),
    )
    reply, answer = await _backward_span(manager, route[0], request)
    tensors = {name: t for name, t in reply.tensors().items() if t is not None}
    return _Answer(tensors, answer.signature, {answer.accused})


async def _replay_session(
    manager: RemoteSequenceManager, span: RouteSpan, report: FraudReport
) -> _Answer:
    """A step report's session replayed step by step on ``span``'s server (opened with the same
    padding; each step given ``request_timeout_s``): its answer to the last step."""
    state = SpanState(span)
    call = SpanCall(state, [])
    steps = [*((step.position, step.asked) for step in report.steps)]
    steps.append((report.position or 0, report.asked))
    batch = report.asked["hidden_states"].shape[0]
    state.padding = report.padding
    try:
        opening = OpenSession(
            session_id=state.session_id,
            blocks=(span.start, span.end),
            max_length=max([*(position for position, _ in steps), *(report.padding or ())]),
            batch_size=batch,
            alloc_timeout=manager.config.request_timeout_s,
            active_adapter=report.adapter,
            points=0.0,
            left_padding=report.padding,
        )
        messages = [
            Step(
                hidden_states=asked["hidden_states"],
                start_from_position=position - asked["hidden_states"].shape[1],
                step_id=step_id,
                prompts=asked.get("prompts"),
                hypo_ids=asked.get("hypo_ids"),
            )
            for step_id, (position, asked) in enumerate(steps)
        ]
    except (ValueError, PetalsError) as exc:
        raise ReportRefused(f"malformed: a step cannot be sent again: {exc}") from None
    timeout = manager.config.request_timeout_s
    try:
        with trio.fail_after(timeout):
            await call.open(manager, opening)
        for step in messages:
            with trio.fail_after(timeout):
                await call.send(step, manager.config.compression)
                result = await call.result(manager)
    finally:
        with trio.CancelScope(shield=True):
            await call.close()
    return _Answer({"hidden_states": result.hidden_states}, result.receipt, {state.peer})


async def judge(manager: RemoteSequenceManager, report: FraudReport) -> str:
    """Whether ``report``'s answer is wrong, asking other servers (see the module; drawn by
    :meth:`ReportBook.checkers_rank`): the reason to uphold it; :class:`ReportRefused` if it is
    about a correct answer; :class:`_Undecided` if too few servers can tell now."""
    start, end = report.blocks
    if end > manager.num_blocks:
        raise ReportRefused(f"the report names blocks {start}:{end} of a {manager.num_blocks}")
    announced = manager.server_info(report.accused)
    if announced is None:
        raise _Undecided(f"{report.accused} is not in the peer table")
    # Checkers compute in the dtype and quantisation the accused signed, whatever it runs now.
    signed = report.signature
    if signed.torch_dtype not in TOLERANCE:
        raise ReportRefused(
            f"the answer is signed as computed in {signed.torch_dtype!r}, a dtype no check knows"
        )
    like = attrs.evolve(announced, torch_dtype=signed.torch_dtype, quant_type=signed.quant_type)
    rank = book_of(manager).checkers_rank(report.accused)
    bound = tolerance(like)
    second = await _ask(manager, report, {report.accused}, like, rank)
    checkers = second.checkers
    off = _off(report.answered, report.signature, second.tensors, second.signature)
    if off <= bound + second.allowance:
        raise ReportRefused(
            f"about a correct answer: {', '.join(sorted(checkers))} computed the same "
            f"(relative difference {off:.3g}, bound {bound + second.allowance:.3g})"
        )
    third = await _ask(manager, report, {report.accused} | checkers, like, rank)
    both = bound + second.allowance + third.allowance
    if _off(third.tensors, third.signature, report.answered, report.signature) <= both:
        raise ReportRefused(
            f"about a correct answer: {', '.join(sorted(third.checkers))} computed the same, "
            f"{', '.join(sorted(checkers))} did not"
        )
    if _off(third.tensors, third.signature, second.tensors, second.signature) > both:
        raise _Undecided("three servers computed three different answers")
    return (
        f"blocks {start}:{end} off by {off:.3g} (bound {bound:.3g}) against "
        f"{', '.join(sorted(checkers | third.checkers))}"
    )


async def judge_listed(manager: RemoteSequenceManager) -> int:
    """One round: read the model's reports and try up to :data:`CHECKS_PER_ROUND` new ones
    about servers in the peer table; how many were decided (``ReportBook.more``: whether others
    wait for the next round).  Each listing is judged by its :attr:`~Listing.key`, so a listing
    that names a report wrongly is refused on its own, never in the right one's place.  Those
    about servers not in the table are left for later (``ReportBook.waiting``); one no server
    could decide is tried again once each ``reports_period_s``, and refused after
    :data:`MAX_UNDECIDED` tries.  A
    verdict lasts as long as its report counts (from the time the accused signed), a refusal
    :data:`REPORT_TTL_S` from now: nothing a listing says makes either shorter or longer.
    Rounds on one book (the watcher's, a caller's) run one at a time."""
    book = book_of(manager)
    async with book.judging:
        return await _judge_round(manager, book)


async def _judge_round(manager: RemoteSequenceManager, book: ReportBook) -> int:
    dht, prefix = manager.state.dht, manager.config.dht_prefix
    assert dht is not None and prefix is not None
    now = time.time()
    book.forget_expired(now)
    by_key: dict[ListingKey, list[Listing]] = {}
    for listing in await fetch_listings(dht, prefix):
        by_key.setdefault(listing.key, []).append(listing)
    # A report no longer listed before it was decided is forgotten with its tries.
    book.undecided = {key: tries for key, tries in book.undecided.items() if key in by_key}
    tried = decided = 0
    book.waiting, book.more = set(), False
    for key, listings in by_key.items():
        reporters = frozenset(listing.reporter for listing in listings)
        known = book.verdicts.get(key)
        if known is not None:
            book.verdicts[key] = attrs.evolve(known, reporters=known.reporters | reporters)
            continue
        accused = listings[0].accused
        if manager.server_info(accused) is None:
            book.waiting.add(accused)
            continue
        if accused in manager.state.caught:
            continue
        tries, last = book.undecided.get(key, (0, -math.inf))
        if now - last < manager.config.reports_period_s:
            continue  # undecided this period: tried again in the next
        if tried >= CHECKS_PER_ROUND:
            book.more = True
            continue
        tried += 1
        outcome = await _try(manager, prefix, listings[0], reporters, now)
        if isinstance(outcome, _Undecided):
            tries += 1
            book.undecided[key] = (tries, now)
            if tries < MAX_UNDECIDED:
                continue
            outcome = Verdict(
                accused=accused,
                reporters=reporters,
                upheld=False,
                reason=f"undecided in {tries} tries: {outcome}",
                expires=now + REPORT_TTL_S,
            )
        book.verdicts[key] = outcome
        book.undecided.pop(key, None)
        decided += 1
        if outcome.upheld:
            manager.on_caught(
                accused, f"reported by {', '.join(sorted(reporters))}: {outcome.reason}"
            )
        else:
            logger.info(
                "refused a report against %s by %s: %s",
                accused,
                ", ".join(sorted(reporters)),
                outcome.reason,
            )
    return decided


async def _try(
    manager: RemoteSequenceManager,
    prefix: str,
    listing: Listing,
    reporters: frozenset[str],
    now: float,
) -> Verdict | _Undecided:
    """The verdict on ``listing``'s report, or why it cannot be decided now (its evidence not
    found, too few servers, the DHT failing)."""
    dht = manager.state.dht
    assert dht is not None

    def verdict(upheld: bool, reason: str, expires: float = now + REPORT_TTL_S) -> Verdict:
        return Verdict(
            accused=listing.accused,
            reporters=reporters,
            upheld=upheld,
            reason=reason,
            expires=expires,
        )

    try:
        report = await fetch_report(dht, prefix, listing)
        if report is None:
            return _Undecided("its evidence is not (all) in the DHT")
        # Checking a session's chain hashes every step: off the event loop.
        await trio.to_thread.run_sync(
            functools.partial(check_report, report, model=prefix, now=time.time())
        )
        reason = await judge(manager, report)
    except ReportRefused as exc:
        return verdict(False, str(exc))
    except _Undecided as exc:
        return exc
    except PetalsError as exc:
        logger.info("could not judge a report against %s now: %r", listing.accused, exc)
        return _Undecided(f"judging it failed: {exc}")
    except Exception as exc:
        # Whatever else a report makes go wrong, it is the report's fault: never the client's.
        logger.warning("a report against %s could not be judged", listing.accused, exc_info=True)
        return verdict(False, f"malformed: {type(exc).__name__}: {exc}")
    return verdict(True, reason, expires=report.signature.issued + REPORT_TTL_S)


async def _publish_outbox(manager: RemoteSequenceManager, book: ReportBook) -> None:
    dht, prefix = manager.state.dht, manager.config.dht_prefix
    assert dht is not None and prefix is not None
    while book.outbox:
        report = book.outbox.pop(0)
        try:
            await publish(dht, prefix, book, report, now=time.time())
        except ReportRefused as exc:
            logger.warning("could not report %s: %s", report.accused, exc)
            continue
        except TransportError as exc:
            logger.warning("could not report %s: %r", report.accused, exc)
            continue
        logger.info("reported %s in the DHT", report.accused)


async def watch_reports(manager: RemoteSequenceManager) -> None:
    """Publish the client's reports as they come, and judge the model's every
    ``reports_period_s`` and as soon as a server they accuse shows in the peer table (until
    cancelled).  Reports still waiting when the manager stops are published then."""
    book = book_of(manager)
    while True:
        await _publish_outbox(manager, book)
        try:
            await judge_listed(manager)
        except PetalsError as exc:
            logger.info("reading fraud reports failed: %r", exc)
        if book.more:
            await trio.sleep(min(_NEXT_ROUND_S, manager.config.reports_period_s))
            continue
        with trio.move_on_after(manager.config.reports_period_s):
            await _next_reason(manager, book)
        book.wake = trio.Event()


async def _next_reason(manager: RemoteSequenceManager, book: ReportBook) -> None:
    """Return once there is a report to publish, or a server some report accuses shows."""
    topic = manager.state.topic
    waiting = set(book.waiting)
    async with trio.open_nursery() as nursery:

        async def woken() -> None:
            await book.wake.wait()
            nursery.cancel_scope.cancel()

        async def shown() -> None:
            assert topic is not None
            await topic.wait_snapshot(
                lambda _: any(manager.server_info(peer) is not None for peer in waiting)
            )
            nursery.cancel_scope.cancel()

        nursery.start_soon(woken)
        if waiting and topic is not None:
            nursery.start_soon(shown)


async def run_manager(
    manager: RemoteSequenceManager, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """``manager``'s network part (:meth:`RemoteSequenceManager.run`) with its report watcher
    as a service (and what is left to publish published when it stops), until
    :meth:`RemoteSequenceManager.close`; for ``nursery.start``."""
    book = book_of(manager)
    if not book.watched:
        manager.state.services.append(functools.partial(watch_reports, manager))
        manager.state.on_stop.append(functools.partial(_publish_outbox, manager, book))
        book.watched = True
    await manager.run(task_status=task_status)
