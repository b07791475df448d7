"""Inference sessions over a chain of servers, that survive the failure of any of them.

An :class:`InferenceSession` covers the blocks of its sequence manager.  On the first step it
plans a min-latency route and opens one ``petals.inference`` stream per span of it (see
:mod:`petals_core.protocol` for the messages).  Each step goes through the spans in turn: the
output of one is the input of the next (activations return through the client).

The client keeps, for every span, the inputs it sent (``history``: ``(B, position, hidden)``).
When a server fails, stalls past the step's timeout (:meth:`RemoteSequenceManager.answer_timeout`)
or refuses a step it should have taken, the session bans it, plans a new route for that span's
blocks (it may take several servers), replays the history through the replacements so that they
rebuild their caches, and carries on from the same step.  Rolling back (setting ``position``
lower) cuts every history; reordering rows for beam search (``hypo_ids``) reorders them.  Deep
prompts given at position 0 are kept, and replayed.

What can fail is retried with exponential backoff up to ``max_retries`` failures per step of
the caller's (the pieces of a long prefill share them); after that the error names the last
cause.  Steps are checked here before anything is sent, so that a server is never
banned for the client's own mistake.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import attrs
import torch
import trio

from .._errors import PetalsError, SessionTooLarge, WrongAnswer
from .._groups import run_concurrently
from ..dht import ServerInfo
from ..protocol import FraudReport, SignedReceipt, StepResult
from ..routing import MissingBlocksError, RouteSpan
from ._checks import compare, majority, slice_allowance, tolerance
from ._placement import like, to_wire
from ._reports import book_of
from ._second_opinions import Follower, Opinion, opinion_of, other_route
from ._sequence_manager import RemoteSequenceManager
from ._session_core import SessionCore, SpanState
from ._span_call import RETRIABLE, SpanCall

__all__ = ["FirstStepTimes", "InferenceSession"]

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class FirstStepTimes:
    """Where the first step of a session spent its time, in seconds of wall clock.

    What is left of ``total_s`` after ``route_s`` and ``open_s`` is the step itself: sending the
    inputs, the servers' compute, the answers coming back.  Retries count where they happened.
    """

    #: Planning the route: reading the peer table (waiting for it, on a client just started).
    route_s: float
    #: Sending the openings of the sessions to the route's servers, all at once (connecting
    #: included); the servers open them while the step is on its way.
    open_s: float
    #: The longest any one connection to a server of the route took to set up (0.0: all were
    #: open already).
    connect_s: float
    #: The whole first step.
    total_s: float


class InferenceSession:
    """A session of up to ``max_length`` positions through ``manager``'s blocks (async API).

    Use ``async with`` (or call :meth:`close`): it releases the servers' caches.  The session's
    state is a :class:`SessionCore`; this class does its I/O: streams, timeouts, retries.
    """

    def __init__(
        self, manager: RemoteSequenceManager, max_length: int, *, alloc_timeout: float = 30.0
    ) -> None:
        self.manager = manager
        self.max_length = max_length
        self.alloc_timeout = alloc_timeout
        self._core = SessionCore(
            blocks=manager.block_indices, max_length=max_length, hidden_size=manager.hidden_size
        )
        self._calls: dict[SpanState, SpanCall] = {}
        #: Every answer's receipt (its signature checked), kept while the session lives: the
        #: evidence of what each server answered.
        self.receipts: list[SignedReceipt] = []
        #: Per span (by identity), the follower checking it, or None once decided against.
        self._followers: dict[SpanState, Follower | None] = {}
        #: Spans that no single other server can follow: their answers are checked, as the
        #: policy samples them, by replaying the span's inputs on other servers.
        self._unfollowable: set[SpanState] = set()
        #: Servers that refused this session as larger than they take, and why: not used for
        #: it again, and not blamed.
        self._refused: dict[str, str] = {}
        #: Why the last recomputation for a check found no server, or failed.
        self._check_failure: BaseException | None = None
        self._closed = False
        self.retries = 0
        #: Where the first step spent its time (None until it is done).
        self.first_step: FirstStepTimes | None = None
        # Seconds the first step spent so far on planning routes, opening spans, connecting.
        self._setup = {"route": 0.0, "open": 0.0, "connect": 0.0}

    @property
    def _keep_evidence(self) -> bool:
        """Whether its spans keep the evidence a fraud report needs (only checks catch)."""
        return self.manager.config.verify != "none"

    async def __aenter__(self) -> InferenceSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def position(self) -> int:
        """Positions processed so far; set it lower to resend from there."""
        return self._core.position

    @position.setter
    def position(self, value: int) -> None:
        self._core.rollback(value)

    @property
    def route(self) -> list[RouteSpan]:
        return [state.span for state in self._core.spans]

    async def close(self) -> None:
        self._closed = True
        await self._close_calls()

    def _check_open(self) -> None:
        """:class:`PetalsError` once the session is closed (its step, if one runs, ends: its
        streams failing then are the close's doing, not their servers')."""
        if self._closed:
            raise PetalsError("the inference session was closed during a step")

    async def _close_calls(self, keep: frozenset[SpanState] = frozenset()) -> None:
        for state in [state for state in self._calls if state not in keep]:
            call = self._calls.pop(state, None)  # a failing step may have closed it meanwhile
            if call is not None:
                await call.close()
        for key in [key for key in self._followers if key not in keep]:
            await self._drop_follower(key)

    async def _drop_follower(self, key: SpanState) -> None:
        follower = self._followers.pop(key, None)
        self._unfollowable.discard(key)
        if follower is not None:
            with trio.CancelScope(shield=True):
                await follower.call.close()

    async def step(
        self,
        hidden: torch.Tensor,
        *,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``(B, T, hidden)`` new positions through every block; returns the last block's
        output.  ``prompts`` (``(blocks, B or 1, P, hidden)``) only at position 0; ``hypo_ids``
        (``(B,)``) reorders the rows of everything so far before the step.  ``padding``
        (``(B,)``, only at position 0) says how many leading positions of each row are left
        padding, hidden from the row's real tokens (batched generation of prompts of different
        lengths).

        The tensors may live on any device, in any floating-point dtype (see
        ``petals_core.client._placement``); the output is on the device and in the dtype of
        ``hidden``."""
        if self._closed:
            raise PetalsError("the inference session is closed")
        pieces = self._core.step_pieces(hidden, prompts=prompts)
        started = trio.current_time()
        try:
            if len(pieces) == 1:
                output, _ = await self._step(hidden, prompts, hypo_ids, padding, started=started)
                return output
            # A long prefill goes in several steps, none beyond what servers take; their
            # failures count against one retry budget, the caller's step's.
            outputs, attempt = [], 0
            for start, end in pieces:
                first = start == 0
                output, attempt = await self._step(
                    hidden[:, start:end],
                    prompts if first else None,
                    hypo_ids if first else None,
                    padding if first else None,
                    started=started,
                    attempt=attempt,
                    continued=not first,
                    length=hidden.shape[1],
                    more=end < hidden.shape[1],
                )
                outputs.append(output)
            return torch.cat(outputs, dim=1)
        except BaseException as exc:
            # A step refused as the caller's mistake sent nothing.  Any other that did not finish
            # (cancelled, or failed for good) may have left part of a message sent, or answers
            # unread: those streams are not used again, and the spans are replayed anew at the
            # next step, nobody blamed.
            interrupted = not isinstance(exc, ValueError)
            for state in self._core.abandon(interrupted=interrupted):
                await self._drop_follower(state)
                call = self._calls.pop(state, None)
                if call is not None:
                    await call.close()
            if interrupted:
                await self._close_calls()
            raise

    async def _step(
        self,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        padding: torch.Tensor | None,
        *,
        started: float,
        attempt: int = 0,
        continued: bool = False,
        length: int | None = None,
        more: bool = False,
    ) -> tuple[torch.Tensor, int]:
        """One step message through the chain (``started`` then: its caller's step, which
        failed ``attempt`` times so far); its output, and the failures so far.  The others, see
        :meth:`SessionCore.begin` and :meth:`SessionCore.finish`."""
        home = hidden
        hidden = to_wire(hidden, "hidden states")
        if prompts is not None:
            prompts = to_wire(prompts, "deep prompts")
        core = self._core
        if core.begin(
            hidden,
            prompts=prompts,
            hypo_ids=hypo_ids,
            padding=padding,
            continued=continued,
            length=length,
        ):
            await self._close_calls()
        if not core.spans:
            attempt = await self._retrying(attempt, self._open_route)
        # Server-to-server: a plain step goes to the first server, which pushes its output on
        # to the next, and so on; each answers us too (we keep every span's inputs for replay).
        # A server that could not push says so, and we send the step on ourselves.
        core.start_chain(
            server_to_server=self.manager.config.use_server_to_server
            and all(self.manager.knows_push_grants(state.span) for state in core.spans)
        )
        x = hidden
        index = 0
        while index < len(core.spans):
            state = core.spans[index]
            if state.stale:  # it may hold a reorder taken back: replayed anew, nobody blamed
                await self._drop_follower(state)
                core.failed()
                attempt = await self._retrying(attempt, functools.partial(self._replace, index))
                continue
            follower = None if state.gone else await self._follower(state)
            self._check_open()  # (closed while the follower was being opened)
            try:
                # (ServerError for a span whose replacement failed in an earlier step: it is
                # replaced again now.)
                request = core.request(index, x)
                span_call = self._calls[state]
                timeout = self.manager.answer_timeout(state.span, x, span_call.unconfirmed)
                if follower is not None:
                    # Outside the span's step timeout: the follower's pace is not the span's.
                    await self._follow(state, follower, x)
                with trio.fail_after(timeout):
                    if request is not None:
                        await span_call.send(request, self.manager.config.compression)
                    else:
                        span_call.pushed(x)
                    result = await span_call.answer(core, index, self.manager)
                if follower is not None:
                    await self._check(state, follower, x, result)
                elif state in self._unfollowable and self.manager.should_verify(state.peer):
                    await self._verify(state, x, result)
                output = core.answered(index, x, result)
            except RETRIABLE as exc:
                self._check_open()
                await self._drop_follower(state)
                core.failed()
                # (A gone span stands for a server blamed when it failed: not blamed again.)
                attempt = await self._failed(attempt, None if state.gone else state, exc)

                async def replace(at: int = index) -> None:
                    await self._replace(at)

                attempt = await self._retrying(attempt, replace)
                continue
            self.manager.on_request_success(state.peer)
            x = output
            index += 1
        core.finish(more=more)
        if self.first_step is None and not more:
            setup = self._setup
            self.first_step = FirstStepTimes(
                route_s=setup["route"],
                open_s=setup["open"],
                connect_s=setup["connect"],
                total_s=trio.current_time() - started,
            )
        return like(x, home), attempt

    # -- internals -------------------------------------------------------------------------------

    async def _retrying(self, attempt: int, action: Any) -> int:
        """Run ``action`` until it succeeds, counting failures against the retry budget."""
        while True:
            try:
                await action()
                return attempt
            except RETRIABLE as exc:
                self._check_open()
                attempt = await self._failed(attempt, None, exc)

    def _blame(self, peer: str, exc: BaseException) -> None:
        """``peer`` failed with ``exc``: banned for a while, unless it refused to open this
        session as larger than it takes (noted: this session's routes avoid it from now on)."""
        if isinstance(exc, SessionTooLarge):
            logger.info("server %s does not take this session: %s", peer, exc)
            self._refused[peer] = str(exc)
        else:
            self.manager.on_request_failure(peer)

    async def _failed(self, attempt: int, state: SpanState | None, exc: BaseException) -> int:
        if state is not None:
            self._blame(state.peer, exc)
        if isinstance(exc, SessionTooLarge):
            # Not a failure: the session goes to servers that take it (each refusal rules one
            # out, so this ends), or fails with every server's reason.
            return attempt
        attempt += 1
        self.retries += 1
        if state is not None:
            logger.warning("server %s failed during a step (%r); rerouting", state.peer, exc)
        if not self.manager.may_retry(attempt):
            raise PetalsError(
                f"inference failed after {attempt} attempt(s); last error: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        await trio.sleep(self.manager.retry_delay(attempt))
        return attempt

    async def _open_route(self) -> None:
        assert self._core.batch is not None
        started = trio.current_time()
        try:
            route = await self.manager.make_sequence(
                mode="min_latency",
                cache_tokens_needed=self.max_length * self._core.batch,
                max_length=self.max_length,
                refused=self._refused,
            )
        finally:
            if self.first_step is None:
                self._setup["route"] += trio.current_time() - started
        await self._open_spans(route, 0)

    async def _open_spans(self, route: list[RouteSpan], at: int) -> list[SpanState]:
        """Open sessions for ``route``, on all its servers at once, and put them at index ``at``
        of the chain.  If any fails, all are closed and the first failure is raised (naming the
        others that failed with it).

        Only the openings are sent: the first step follows without waiting for the servers'
        answers, which come before the step's (a server that refuses the opening fails that
        step, as a failing server does)."""
        core = self._core
        opened = core.route_opened(route, at)
        started = trio.current_time()
        connect_s = 0.0

        async def open_span(state: SpanState, span_call: SpanCall) -> None:
            nonlocal connect_s
            opening = core.opening(
                state,
                alloc_timeout=self.alloc_timeout,
                active_adapter=self.manager.config.active_adapter,
            )
            try:
                with trio.fail_after(self.manager.config.request_timeout_s):
                    connected = await span_call.open(self.manager, opening, wait=False)
                    connect_s = max(connect_s, connected)
            except RETRIABLE as exc:
                self._check_open()
                self._blame(state.peer, exc)
                raise

        try:
            calls = []
            for state in opened:
                span_call = self._calls[state] = SpanCall(
                    state, self.receipts, keep_evidence=self._keep_evidence
                )
                calls.append(functools.partial(open_span, state, span_call))
            await run_concurrently(calls)
            self._check_open()  # (closed meanwhile: these sessions are not to stay open)
            if self.first_step is None:
                self._setup["open"] += trio.current_time() - started
                self._setup["connect"] = max(self._setup["connect"], connect_s)
        except BaseException:
            core.route_abandoned(opened)
            for state in opened:
                if state in self._calls:
                    await self._calls.pop(state).close()
            raise
        return opened

    async def _follower(self, state: SpanState) -> Follower | None:
        """The follower checking ``state``'s span, opened at the span's first step if the
        manager's policy asks for one (:meth:`RemoteSequenceManager.should_follow`) and a
        server of the same dtype and quantisation holds all of its blocks; else None."""
        key = state
        if key in self._followers:
            return self._followers[key]
        self._followers[key] = None
        until = self.manager.should_follow(state.peer)
        if until is None:
            return None
        span, info = state.span, self.manager.server_info(state.peer)
        try:
            route = await other_route(
                self.manager,
                span,
                {state.peer},
                info,
                wait=False,
                whole_only=True,
                max_length=self.max_length,
            )
        except MissingBlocksError:
            # Nobody else holds all these blocks: sampled answers are checked by replays.
            self._unfollowable.add(key)
            return None
        call = SpanCall(SpanState(route[0]), self.receipts, keep_evidence=self._keep_evidence)
        opening = self._core.opening(
            call.state,
            alloc_timeout=self.alloc_timeout,
            active_adapter=self.manager.config.active_adapter,
        )
        try:
            with trio.fail_after(self.manager.config.request_timeout_s):
                await call.open(self.manager, opening)
        except RETRIABLE as exc:
            logger.info(
                "could not open a session on %s to check %s: %r", call.state.peer, span, exc
            )
            with trio.CancelScope(shield=True):
                await call.close()
            return None
        if self._closed:  # closed while it opened: it is not to stay open
            await call.close()
            return None
        follower = self._followers[key] = Follower(call=call, until=until)
        return follower

    async def _follow(self, state: SpanState, follower: Follower, x: torch.Tensor) -> None:
        """Send this step's input to ``follower`` (a failure drops the follower, not the step)."""
        steps = self._core.following_steps(state.span, x, opened_now=follower.opened_now)
        call, compression = follower.call, self.manager.config.compression
        try:
            # A long catch-up goes in pieces, each answered before the next; the last one's
            # answer is read with the span's (_check).
            for step in steps[:-1]:
                with trio.fail_after(
                    self.manager.answer_timeout(
                        call.state.span, step.hidden_states, call.unconfirmed
                    )
                ):
                    await call.send(step, compression)
                    self._core.checked_answer(call.state, step, await call.result(self.manager))
            with trio.fail_after(self.manager.config.request_timeout_s):
                await call.send(steps[-1], compression)
        except RETRIABLE as exc:
            logger.info("the follower of %s failed: %r", state.span, exc)
            await self._drop_follower(state)
            return
        follower.sent, follower.tokens, follower.opened_now = steps[-1], x.shape[1], False

    async def _check(
        self, state: SpanState, follower: Follower, x: torch.Tensor, result: StepResult
    ) -> None:
        """Compare ``state``'s answer to this step with its follower's (:meth:`_judge`).  A
        follower that fails, or is outvoted, is dropped; one whose span's server has its first
        answers checked is closed if that is all it was for."""
        if follower.sent is None or self._followers.get(state) is not follower:
            return
        sent, follower.sent = follower.sent, None
        call = follower.call
        try:
            # As long as the span's server would have (it computed meanwhile): a follower
            # slower than it claims is dropped instead of holding the session's steps.
            with trio.fail_after(
                self.manager.answer_timeout(call.state.span, sent.hidden_states, call.unconfirmed)
            ):
                followed = await call.result(self.manager)
        except RETRIABLE as exc:
            logger.info("the follower of %s failed: %r", state.span, exc)
            await self._drop_follower(state)
            return
        full = followed.hidden_states
        second = full[:, full.shape[1] - follower.tokens :]  # (none for a step of none)
        allowance = slice_allowance(followed.receipt) if second.shape != full.shape else 0.0
        opinion = Opinion(second, followed.receipt, {follower.peer}, allowance)
        off = compare(result.hidden_states, result.receipt, second, followed.receipt)
        if off > tolerance(self.manager.server_info(state.peer)) + allowance:
            await self._drop_follower(state)
        await self._judge(state, x, result, opinion, off=off, checker=(follower.call, full))
        verified = self.manager.state.verified.get(state.peer, 0)
        if follower.until == "first" and verified >= self.manager.config.verify_first:
            await self._drop_follower(state)

    async def _verify(self, state: SpanState, x: torch.Tensor, result: StepResult) -> None:
        """Check ``state``'s answer to this step against other servers that replay the span's
        inputs so far (:meth:`_judge`); where none can, it stands unchecked."""
        info = self.manager.server_info(state.peer)
        inputs = self._core.inputs_of(state.span, x)
        second = await self._recompute(state.span, inputs, x.shape[1], {state.peer}, info)
        if second is not None:
            await self._judge(state, x, result, second)

    async def _judge(
        self,
        state: SpanState,
        x: torch.Tensor,
        result: StepResult,
        second: Opinion,
        *,
        off: float | None = None,
        checker: tuple[SpanCall, torch.Tensor] | None = None,
    ) -> None:
        """``state``'s answer (``result``) against other servers' (``second``; ``off``: their
        :func:`compare`, if known; ``checker``: the follower's call and its whole answer, to
        report it if it is the one caught).  The server caught is reported where its
        session's evidence was kept.  If they disagree, a third
        server decides (replaying the span's inputs so far): a server in the minority is never
        used again, and if it is this span's, :class:`WrongAnswer` sends the step to a
        replacement.  With no third server, :class:`PetalsError`."""
        peer, span = state.peer, state.span
        answer, mine, checkers = result.hidden_states, result.receipt, second.checkers
        info = self.manager.server_info(peer)
        bound = tolerance(info)
        off = compare(answer, mine, second.answer, second.signature) if off is None else off
        if off <= bound + second.allowance:
            for verified in {peer} | checkers:
                self.manager.on_verified(verified)
            return
        inputs = self._core.inputs_of(span, x)
        # A disagreement needs a decider: worth waiting for one.
        self._check_failure = None
        third = await self._recompute(span, inputs, x.shape[1], {peer} | checkers, info, wait=True)
        if third is None:
            raise PetalsError(
                f"servers {peer} and {', '.join(sorted(checkers))} computed blocks "
                f"{span.start}:{span.end} differently at position {self.position} (relative "
                f"difference {off:.3g}, bound {bound:.3g}) and no third server could decide "
                f"({self._check_failure!r})"
            )
        side = majority(
            compare(third.answer, third.signature, answer, mine),
            compare(third.answer, third.signature, second.answer, second.signature),
            bound + second.allowance + third.allowance,
        )
        why = f"blocks {span.start}:{span.end} off by {off:.3g} (bound {bound:.3g})"
        if side == "second":
            self.manager.on_caught(peer, f"{why} against two other servers")
            call = self._calls.get(state)
            self._report(None if call is None else call.report(self.manager, answer))
            raise WrongAnswer(f"server {peer} answered a step wrongly: {why}")
        if side == "first":
            if len(checkers) == 1:
                self.manager.on_caught(next(iter(checkers)), f"{why} against two other servers")
                if checker is not None:
                    self._report(checker[0].report(self.manager, checker[1]))
            self.manager.on_verified(peer)
            return
        raise PetalsError(
            f"servers disagree on {why} and no majority decides "
            f"({peer}; {', '.join(sorted(checkers))}; {', '.join(sorted(third.checkers))})"
        )

    def _report(self, report: FraudReport | None) -> None:
        if report is None:
            logger.info("a caught server's session could not be reported (no evidence kept)")
        else:
            book_of(self.manager).report(report)

    async def _recompute(
        self,
        span: RouteSpan,
        inputs: torch.Tensor,
        tokens: int,
        exclude: set[str],
        like: ServerInfo | None,
        *,
        wait: bool = False,
    ) -> Opinion | None:
        """The last ``tokens`` outputs of ``inputs`` (a span's inputs from position 0) through
        ``span``'s blocks on other servers (not ``exclude``; of ``like``'s dtype and
        quantisation), in sessions of their own closed at once; None where there are none
        (waiting for some up to ``missing_blocks_timeout_s`` if ``wait``) or they fail."""
        try:
            route = await other_route(
                self.manager, span, exclude, like, wait=wait, max_length=inputs.shape[1]
            )
        except MissingBlocksError as exc:
            logger.info("could not check %s on blocks %d:%d: %r", span, span.start, span.end, exc)
            self._check_failure = exc
            return None
        calls: list[SpanCall] = []
        try:
            check = functools.partial(opinion_of, self.manager, self._core, route, inputs, tokens)
            return await check(calls, receipts=self.receipts, alloc_timeout=self.alloc_timeout)
        except RETRIABLE as exc:
            logger.info("could not check blocks %d:%d: %r", span.start, span.end, exc)
            self._check_failure = exc
            if calls:  # (the checks after go elsewhere)
                self._blame(calls[-1].state.peer, exc)
            return None

    async def _replace(self, index: int) -> None:
        """Route the blocks of span ``index`` anew and replay its history there.

        If it does not complete, a span whose server is gone stands in the chain (its next
        step fails and replaces it again), so the chain always covers every block."""
        core = self._core
        failed, history = core.take_for_replacement(index)
        if failed in self._calls:
            with trio.CancelScope(shield=True):
                await self._calls.pop(failed).close()
        opened: list[SpanState] = []
        try:
            assert core.batch is not None
            route = await self.manager.make_sequence(
                failed.span.start,
                failed.span.end,
                mode="min_latency",
                cache_tokens_needed=self.max_length * core.batch,
                max_length=self.max_length,
                refused=self._refused,
            )
            opened = await self._open_spans(route, index)
            x = history
            for state in opened:
                if x is None or x.shape[1] == 0:
                    break
                outputs = []
                try:
                    span_call = self._calls[state]
                    for start, end in core.replay_pieces(x):
                        piece = x[:, start:end]
                        timeout = self.manager.answer_timeout(
                            state.span, piece, span_call.unconfirmed
                        )
                        with trio.fail_after(timeout):
                            step = core.replay(state, x, start, end)
                            await span_call.send(step, self.manager.config.compression)
                            at = core.spans.index(state)
                            result = await span_call.answer(core, at, self.manager)
                            outputs.append(core.replayed(state, x, start, end, result))
                except RETRIABLE as exc:
                    self._check_open()
                    self._blame(state.peer, exc)
                    raise
                x = torch.cat(outputs, dim=1)
        except BaseException:
            for state in opened:
                if state in self._calls:
                    with trio.CancelScope(shield=True):
                        await self._calls.pop(state).close()
            core.replacement_failed(index, failed, history, opened)
            raise
