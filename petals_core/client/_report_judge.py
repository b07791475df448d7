"""Judging fraud reports by asking other servers, and the client's report watcher.

A report passes :func:`~petals_core.client._reports.check_report` when the accused did give its
answer to its question.  Whether that answer is wrong, no report can say on its own: the client
asks the question again of a server other than the accused (of its dtype and quantisation).  If
that server's answer agrees with the accused's, the report is about a correct answer and is
refused.  If not, a third server decides: the report is upheld only if the third agrees with the
second and not with the accused, so one lying server cannot frame an honest one by filing a
report and confirming it.  Where too few servers hold the blocks, the report waits for the next
round.  An upheld report bans the accused as a caught server is banned
(:meth:`RemoteSequenceManager.on_caught`).

The watcher (:func:`watch_reports`, run with the manager's network part by :func:`run_manager`)
publishes the client's own reports and, every ``reports_period_s``, reads the model's list and
judges up to :data:`CHECKS_PER_ROUND` new reports about servers in its peer table.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Final

import attrs
import torch
import trio

from .._errors import PetalsError, ReportRefused, TransportError
from ..dht import Listing, ServerInfo, fetch_listings
from ..protocol import BackwardRequest, FraudReport, OpenSession, Signature, Step
from ..routing import MissingBlocksError, RouteSpan
from ._checks import compare, hops_allowance, tolerance
from ._reports import (
    REPORT_TTL_S,
    ReportBook,
    Verdict,
    book_of,
    check_report,
    fetch_report,
    publish,
)
from ._second_opinions import other_route
from ._sequence_manager import RemoteSequenceManager
from ._sequential import _backward_elsewhere, _recompute
from ._session_core import SpanState
from ._span_call import RETRIABLE, SpanCall

__all__ = ["CHECKS_PER_ROUND", "judge", "judge_listed", "run_manager", "watch_reports"]

logger = logging.getLogger(__name__)

#: New reports a client judges per round (each costs the swarm two recomputations).
CHECKS_PER_ROUND: Final = 4
#: Rounds a report may stay undecided (too few servers could recompute it) before it is refused.
MAX_UNDECIDED: Final = 3


@attrs.frozen
class _Answer:
    """Other servers' answer to a report's question: its tensors, the signature of the last
    server's answer, who computed it, and what compression between them may have changed."""

    tensors: dict[str, torch.Tensor]
    signature: Signature | None
    checkers: set[str]
    allowance: float = 0.0


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
) -> _Answer | None:
    """The report's question answered by servers not in ``exclude`` (of the accused's dtype and
    quantisation), and who answered; None where none can now."""
    start, end = report.blocks
    # The evidence travels as it is: compressing it again would change the question.
    sub = RemoteSequenceManager(
        attrs.evolve(manager.config, active_adapter=report.adapter, compression=None),
        manager.num_blocks,
        block_indices=range(start, end),
        state=manager.state,
    )
    span = RouteSpan(start=start, end=end, peer_id=report.accused)
    try:
        if report.kind == "step":
            return await _replay_session(sub, span, report, exclude, like)
        if report.kind == "forward":
            output, _, evidence = await _recompute(
                sub,
                span,
                report.asked["hidden_states"],
                report.asked.get("prompts"),
                False,
                exclude,
                like,
            )
            signatures = [answer.signature for answer in evidence]
            return _Answer(
                {"hidden_states": output},
                signatures[-1],
                {answer.accused for answer in evidence},
                hops_allowance(signatures),
            )
        request = BackwardRequest(
            blocks=(start, end),
            active_adapter=report.adapter,
            hidden_states=report.asked["hidden_states"],
            grad_outputs=report.asked["grad_outputs"],
            prompts=report.asked.get("prompts"),
        )
        found = await _backward_elsewhere(sub, span, request, exclude, like)
    except (MissingBlocksError, *RETRIABLE) as exc:
        logger.info("could not judge a report against %s now: %r", report.accused, exc)
        return None
    if found is None:
        return None
    reply, answer = found
    tensors = {name: t for name, t in reply.tensors().items() if t is not None}
    return _Answer(tensors, answer.signature, {answer.accused})


async def _replay_session(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    report: FraudReport,
    exclude: set[str],
    like: ServerInfo,
) -> _Answer | None:
    """A step report's session replayed step by step on one other server holding all its
    blocks (opened with the same padding): its answer to the last step; None where there is no
    such server."""
    try:
        route = await other_route(
            manager,
            span,
            exclude,
            like,
            wait=False,
            whole_only=True,
        )
    except MissingBlocksError:
        return None
    state = SpanState(route[0])
    call = SpanCall(state, [])
    steps = [*((step.position, step.asked) for step in report.steps)]
    steps.append((report.position or 0, report.asked))
    batch = report.asked["hidden_states"].shape[0]
    state.padding = report.padding
    try:
        opening = OpenSession(
            session_id=state.session_id,
            blocks=(span.start, span.end),
            max_length=max(position for position, _ in steps),
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
    try:
        with trio.fail_after(manager.config.request_timeout_s):
            await call.open(manager, opening)
            for step in messages:
                await call.send(step, manager.config.compression)
                result = await call.result(manager)
    finally:
        with trio.CancelScope(shield=True):
            await call.close()
    return _Answer({"hidden_states": result.hidden_states}, result.receipt, {state.peer})


async def judge(manager: RemoteSequenceManager, report: FraudReport) -> str | None:
    """Whether ``report``'s answer is wrong, asking other servers (see the module): the reason
    to uphold it, :class:`ReportRefused` if it is about a correct answer, None if too few servers
    can tell now."""
    start, end = report.blocks
    if end > manager.num_blocks:
        raise ReportRefused(f"the report names blocks {start}:{end} of a {manager.num_blocks}")
    # Read once: checkers are of the accused's dtype and quantisation as it announced them now.
    like = manager.server_info(report.accused)
    if like is None:
        return None  # gone meanwhile: judged if it comes back
    bound = tolerance(like)
    second = await _ask(manager, report, {report.accused}, like)
    if second is None:
        return None
    checkers = second.checkers
    off = _off(report.answered, report.signature, second.tensors, second.signature)
    if off <= bound + second.allowance:
        raise ReportRefused(
            f"about a correct answer: {', '.join(sorted(checkers))} computed the same "
            f"(relative difference {off:.3g}, bound {bound + second.allowance:.3g})"
        )
    third = await _ask(manager, report, {report.accused} | checkers, like)
    if third is None:
        return None
    both = bound + second.allowance + third.allowance
    if _off(third.tensors, third.signature, report.answered, report.signature) <= both:
        raise ReportRefused(
            f"about a correct answer: {', '.join(sorted(third.checkers))} computed the same, "
            f"{', '.join(sorted(checkers))} did not"
        )
    if _off(third.tensors, third.signature, second.tensors, second.signature) > both:
        return None  # three different answers: nothing decides
    return (
        f"blocks {start}:{end} off by {off:.3g} (bound {bound:.3g}) against "
        f"{', '.join(sorted(checkers | third.checkers))}"
    )


async def judge_listed(manager: RemoteSequenceManager) -> int:
    """One round: read the model's reports and try up to :data:`CHECKS_PER_ROUND` new ones
    about servers in the peer table; how many were decided (``ReportBook.more``: whether others
    wait for the next round).  Those about servers not in the table are left for later
    (``ReportBook.waiting``); one no server could decide is tried again in later rounds, and
    refused after :data:`MAX_UNDECIDED`."""
    dht, prefix = manager.state.dht, manager.config.dht_prefix
    assert dht is not None and prefix is not None
    book = book_of(manager)
    now = time.time()
    book.forget_expired(now)
    by_digest: dict[bytes, list[Listing]] = {}
    for listing in await fetch_listings(dht, prefix):
        by_digest.setdefault(listing.digest, []).append(listing)
    tried = decided = 0
    book.waiting, book.more = set(), False
    for digest, listings in by_digest.items():
        reporters = frozenset(listing.reporter for listing in listings)
        known = book.verdicts.get(digest)
        if known is not None:
            book.verdicts[digest] = attrs.evolve(known, reporters=known.reporters | reporters)
            continue
        accused = listings[0].accused
        if manager.server_info(accused) is None:
            book.waiting.add(accused)
            continue
        if accused in manager.state.caught:
            continue
        if tried >= CHECKS_PER_ROUND:
            book.more = True
            continue
        tried += 1
        expires = listings[0].issued + REPORT_TTL_S
        verdict = await _try(manager, prefix, listings[0], reporters, expires)
        if verdict is None:
            tries = book.undecided[digest] = book.undecided.get(digest, 0) + 1
            if tries < MAX_UNDECIDED:
                continue
            verdict = Verdict(
                accused=accused,
                reporters=reporters,
                upheld=False,
                reason=f"undecided in {tries} rounds: too few servers could recompute it",
                expires=expires,
            )
        book.verdicts[digest] = verdict
        book.undecided.pop(digest, None)
        decided += 1
        if verdict.upheld:
            manager.on_caught(
                accused, f"reported by {', '.join(sorted(reporters))}: {verdict.reason}"
            )
        else:
            logger.info(
                "refused a report against %s by %s: %s",
                accused,
                ", ".join(sorted(reporters)),
                verdict.reason,
            )
    return decided


async def _try(
    manager: RemoteSequenceManager,
    prefix: str,
    listing: Listing,
    reporters: frozenset[str],
    expires: float,
) -> Verdict | None:
    """The verdict on ``listing``'s report, or None where it cannot be decided now (its evidence
    not found, too few servers, the DHT failing)."""
    dht = manager.state.dht
    assert dht is not None

    def verdict(upheld: bool, reason: str) -> Verdict:
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
            return None
        check_report(report, model=prefix, now=time.time())
        reason = await judge(manager, report)
    except ReportRefused as exc:
        return verdict(False, str(exc))
    except PetalsError as exc:
        logger.info("could not judge a report against %s now: %r", listing.accused, exc)
        return None
    except Exception as exc:
        # Whatever else a report makes go wrong, it is the report's fault: never the client's.
        logger.warning("a report against %s could not be judged", listing.accused, exc_info=True)
        return verdict(False, f"malformed: {type(exc).__name__}: {exc}")
    return None if reason is None else verdict(True, reason)


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
