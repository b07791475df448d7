"""Inference sessions over a chain of servers, that survive the failure of any of them.

An :class:`InferenceSession` covers the blocks of its sequence manager.  On the first step it
plans a min-latency route and opens one ``petals.inference`` stream per span of it (see
:mod:`petals_core.protocol` for the messages).  Each step goes through the spans in turn: the
output of one is the input of the next (activations return through the client).

The client keeps, for every span, the inputs it sent (``history``: ``(B, position, hidden)``).
When a server fails, stalls past ``request_timeout_s`` or refuses a step it should have taken, the
session bans it, plans a new route for that span's blocks (it may take several servers), replays
the history through the replacements so that they rebuild their caches, and carries on from the
same step.  Rolling back (setting ``position`` lower) cuts every history; reordering rows for beam
search (``hypo_ids``) reorders them.  Deep prompts given at position 0 are kept, and replayed.

What can fail is retried with exponential backoff up to ``max_retries``; after that the error
names the last cause.  Steps are checked here before anything is sent, so that a server is never
banned for the client's own mistake.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from contextlib import AsyncExitStack
from typing import Any

import torch
import trio

from .._errors import CodecError, PetalsError, RemoteError, ServerError, TransportError
from ..protocol import INFERENCE, OpenSession, PushTarget, SessionReady, Step, StepResult
from ..routing import RemoteSequenceManager, RouteSpan
from ..transport import Call, open_call
from ._placement import describe, like, to_wire

__all__ = ["InferenceSession"]

logger = logging.getLogger(__name__)

#: What a server failing looks like from here: network trouble, a remote exception, a stall.
RETRIABLE = (TransportError, RemoteError, ServerError, trio.TooSlowError)


class _SpanSession:
    """One server's part of an inference session."""

    def __init__(self, span: RouteSpan) -> None:
        self.span = span
        self.stack = AsyncExitStack()
        self.call: Call | None = None
        self.session_id = uuid.uuid4().hex

    @property
    def peer(self) -> str:
        return self.span.peer_id

    async def open(
        self,
        manager: RemoteSequenceManager,
        *,
        max_length: int,
        batch: int,
        alloc_timeout: float,
        padding: list[int] | None,
    ) -> None:
        connection = await manager.connect(self.peer)
        self.call = await self.stack.enter_async_context(open_call(connection, INFERENCE))
        opening = OpenSession(
            session_id=self.session_id,
            blocks=(self.span.start, self.span.end),
            max_length=max_length,
            batch_size=batch,
            alloc_timeout=alloc_timeout,
            active_adapter=manager.config.active_adapter,
            points=0.0,
            left_padding=tuple(padding) if padding is not None and any(padding) else None,
        )
        await self.call.send(opening.to_wire())
        reply = await self.call.receive()
        try:
            SessionReady.from_wire_untrusted(reply)
        except CodecError:
            raise ServerError(f"server {self.peer} did not open the session: {reply!r}") from None

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        *,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        step_id: int,
        push: tuple[PushTarget, ...] = (),
    ) -> tuple[torch.Tensor, bool]:
        """Send ``hidden`` at ``position`` and wait for the answer: the output and whether the
        server pushed it on to the next server (``push``: their sessions, see the server)."""
        assert self.call is not None
        # The position is always explicit: after a pushed step that failed half-way, what the
        # server holds is not known here, and resending from the position is always right.
        step = Step(
            hidden_states=hidden,
            start_from_position=position,
            step_id=step_id,
            prompts=prompts,
            hypo_ids=hypo_ids,
            push=push,
        )
        await self.call.send(step.to_wire())
        return await self.answer(hidden, position, step_id)

    async def answer(
        self, hidden: torch.Tensor, position: int, step_id: int
    ) -> tuple[torch.Tensor, bool]:
        """The answer to step ``step_id`` (``hidden`` at ``position``), sent to this server by
        us or pushed to it by the previous one.  Answers to other steps are stale (pushed steps
        we resent ourselves since) and skipped."""
        assert self.call is not None
        while True:
            reply = await self.call.receive()
            try:
                result = StepResult.from_wire_untrusted(reply)
            except CodecError as exc:
                raise ServerError(
                    f"server {self.peer} sent a malformed step result: {exc}"
                ) from None
            if result.step_id == step_id:
                break
        output = result.hidden_states
        expected = position + hidden.shape[1]
        if output.shape != hidden.shape or result.position != expected:
            raise ServerError(
                f"server {self.peer} answered a step with {describe(output)} at position "
                f"{result.position}; expected {tuple(hidden.shape)} at {expected}"
            )
        return output.to(hidden.dtype), result.pushed is True

    async def close(self) -> None:
        call, self.call = self.call, None
        if call is not None:
            try:
                await call.send_eof()
            except TransportError:
                pass
        try:
            await self.stack.aclose()
        except TransportError:
            pass


class InferenceSession:
    """A session of up to ``max_length`` positions through ``manager``'s blocks (async API).

    Use ``async with`` (or call :meth:`close`): it releases the servers' caches.
    """

    def __init__(
        self, manager: RemoteSequenceManager, max_length: int, *, alloc_timeout: float = 30.0
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.manager = manager
        self.max_length = max_length
        self.alloc_timeout = alloc_timeout
        self._spans: list[_SpanSession] = []
        self._history: dict[int, torch.Tensor] = {}  # span start block -> inputs sent so far
        self._buffers: dict[int, torch.Tensor] = {}  # what the histories are views of
        self._prompts: torch.Tensor | None = None
        self._padding: list[int] | None = None
        self._position = 0
        self._batch: int | None = None
        self._hidden_size: int | None = None
        self._closed = False
        self._drop_spans = False
        self._step_ids = itertools.count()
        self.retries = 0

    async def __aenter__(self) -> InferenceSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def position(self) -> int:
        """Positions processed so far; set it lower to resend from there."""
        return self._position

    @position.setter
    def position(self, value: int) -> None:
        if not 0 <= value <= self._position:
            raise ValueError(f"position can only go back: {value} is not in [0, {self._position}]")
        self._position = value
        for start, history in self._history.items():
            self._history[start] = history[:, :value]
        if value == 0:
            self._prompts = None
            if self._padding is not None:
                # New rows may come: the servers' sessions hold the old padding.
                self._padding = None
                self._drop_spans = True

    @property
    def route(self) -> list[RouteSpan]:
        return [span.span for span in self._spans]

    async def close(self) -> None:
        self._closed = True
        await self._close_spans()

    async def _close_spans(self) -> None:
        spans, self._spans = self._spans, []
        for span in spans:
            await span.close()

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
        home = hidden
        hidden = to_wire(hidden, "hidden states")
        if prompts is not None:
            prompts = to_wire(prompts, "deep prompts")
        self._check(hidden, prompts, hypo_ids)
        if hypo_ids is not None:
            hypo_ids = hypo_ids.to("cpu", torch.int64)
        if padding is not None:
            if self._position != 0:
                raise ValueError("left padding goes with the first step (position 0)")
            if (
                not isinstance(padding, torch.Tensor)
                or padding.shape != (hidden.shape[0],)
                or padding.dtype.is_floating_point
                or padding.dtype == torch.bool
            ):
                raise ValueError(f"padding must be ({hidden.shape[0]},) integers")
            lengths = padding.tolist()
            if not all(0 <= length <= hidden.shape[1] for length in lengths):
                raise ValueError(f"padding must lie in [0, {hidden.shape[1]}] (this step's length)")
            if self._spans:
                await self._close_spans()
            self._padding = lengths
        if self._drop_spans:
            self._drop_spans = False
            await self._close_spans()
        if self._position == 0 and prompts is not None:
            self._prompts = prompts
        if hypo_ids is not None:
            for start, history in self._history.items():
                self._history[start] = history[hypo_ids]
            if self._padding is not None:
                self._padding = [self._padding[i] for i in hypo_ids.tolist()]
        attempt = 0
        # Sessions opened during this step have their caches built from the (already reordered)
        # history: hypo_ids are not for them.
        fresh: set[int] = set()
        if not self._spans:
            attempt = await self._retrying(attempt, self._open_route)
            fresh.update(id(span) for span in self._spans)
        # Server-to-server: a plain step goes to the first server, which pushes its output on
        # to the next, and so on; each answers us too (we keep every span's inputs for replay).
        # A server that could not push says so, and we send the step on ourselves.
        push = (
            self.manager.config.use_server_to_server
            and len(self._spans) > 1
            and hypo_ids is None
            and (self._position > 0 or self._prompts is None)
        )
        x = hidden
        index = 0
        pushed_id: int | None = None  # the step id span ``index`` got pushed, if it was
        while index < len(self._spans):
            span = self._spans[index]
            try:
                with trio.fail_after(self.manager.config.request_timeout_s):
                    if pushed_id is not None:
                        output, pushed = await span.answer(x, self._position, pushed_id)
                    else:
                        step_id = next(self._step_ids)
                        chain: tuple[PushTarget, ...] = ()
                        if push and index + 1 < len(self._spans):
                            chain = tuple(
                                PushTarget(peer=later.peer, session_id=later.session_id)
                                for later in self._spans[index + 1 :]
                            )
                        output, pushed = await span.step(
                            x,
                            self._position,
                            prompts=self._span_prompts(span.span) if self._position == 0 else None,
                            hypo_ids=None if id(span) in fresh else hypo_ids,
                            step_id=step_id,
                            push=chain,
                        )
                        pushed_id = step_id
            except RETRIABLE as exc:
                # From here on, step by step: what the servers after this one got is unknown,
                # and our explicit positions and fresh step ids make any of it harmless.
                push, pushed_id = False, None
                attempt = await self._failed(attempt, span, exc)

                async def replace(at: int = index) -> None:
                    fresh.update(id(new) for new in await self._replace(at))

                attempt = await self._retrying(attempt, replace)
                continue
            if not pushed:
                pushed_id = None
            self.manager.on_request_success(span.peer)
            self._remember(span.span.start, x)
            x = output
            index += 1
        self._position += hidden.shape[1]
        return like(x, home)

    # -- internals -------------------------------------------------------------------------------

    def _check(
        self, hidden: torch.Tensor, prompts: torch.Tensor | None, hypo_ids: torch.Tensor | None
    ) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] < 1:
            raise ValueError(
                f"hidden states must be (batch, tokens, hidden), got {describe(hidden)}"
            )
        if self._batch is None:
            self._batch, self._hidden_size = hidden.shape[0], hidden.shape[2]
        if (hidden.shape[0], hidden.shape[2]) != (self._batch, self._hidden_size):
            raise ValueError(
                f"this session has {self._batch} rows of size {self._hidden_size}; "
                f"got {tuple(hidden.shape)}"
            )
        if self._position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"{self._position} + {hidden.shape[1]} positions exceed the session's "
                f"max_length {self.max_length}"
            )
        if prompts is not None and self._position != 0:
            raise ValueError("deep prompts go with the first step (position 0)")
        if hypo_ids is not None and (
            not isinstance(hypo_ids, torch.Tensor)
            or hypo_ids.shape != (self._batch,)
            or hypo_ids.dtype.is_floating_point
            or hypo_ids.dtype == torch.bool
            or not bool(((hypo_ids >= 0) & (hypo_ids < self._batch)).all())
        ):
            raise ValueError(f"hypo_ids must be ({self._batch},) integers in [0, {self._batch})")

    def _span_prompts(self, span: RouteSpan) -> torch.Tensor | None:
        if self._prompts is None:
            return None
        base = self.manager.block_indices.start
        return self._prompts[span.start - base : span.end - base]

    def _remember(self, start: int, inputs: torch.Tensor) -> None:
        # Histories are views of buffers that grow by doubling, so that a step appends in
        # place instead of copying everything sent so far.
        history = self._history.get(start)
        kept = 0 if history is None else min(self._position, history.shape[1])
        end = kept + inputs.shape[1]
        buffer = self._buffers.get(start)
        if (
            buffer is None
            or history is None
            or buffer.shape[0] != inputs.shape[0]
            or buffer.shape[1] < end
            or buffer.dtype != inputs.dtype
            or history.data_ptr() != buffer.data_ptr()
        ):
            capacity = min(max(2 * end, 16), max(self.max_length, end))
            grown = inputs.new_empty((inputs.shape[0], capacity, inputs.shape[2]))
            if history is not None and kept:
                grown[:, :kept] = history[:, :kept]
            buffer = self._buffers[start] = grown
        buffer[:, kept:end] = inputs.detach()
        self._history[start] = buffer[:, :end]

    async def _retrying(self, attempt: int, action: Any) -> int:
        """Run ``action`` until it succeeds, counting failures against the retry budget."""
        while True:
            try:
                await action()
                return attempt
            except RETRIABLE as exc:
                attempt = await self._failed(attempt, None, exc)

    async def _failed(self, attempt: int, span: _SpanSession | None, exc: BaseException) -> int:
        attempt += 1
        self.retries += 1
        if span is not None:
            logger.warning("server %s failed during a step (%r); rerouting", span.peer, exc)
            self.manager.on_request_failure(span.peer)
        if not self.manager.may_retry(attempt):
            raise PetalsError(
                f"inference failed after {attempt} attempt(s); last error: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        await trio.sleep(self.manager.retry_delay(attempt))
        return attempt

    async def _open_route(self) -> None:
        assert self._batch is not None
        route = await self.manager.make_sequence(
            mode="min_latency", cache_tokens_needed=self.max_length * self._batch
        )
        await self._open_spans(route, 0)

    async def _open_spans(self, route: list[RouteSpan], at: int) -> list[_SpanSession]:
        """Open sessions for ``route`` and put them at index ``at`` of the chain."""
        assert self._batch is not None
        opened: list[_SpanSession] = []
        try:
            for span in route:
                session = _SpanSession(span)
                opened.append(session)
                try:
                    with trio.fail_after(self.manager.config.request_timeout_s):
                        await session.open(
                            self.manager,
                            max_length=self.max_length,
                            batch=self._batch,
                            alloc_timeout=self.alloc_timeout,
                            padding=self._padding,
                        )
                except RETRIABLE:
                    self.manager.on_request_failure(span.peer_id)
                    raise
        except BaseException:
            for session in opened:
                await session.close()
            raise
        self._spans[at:at] = opened
        return opened

    async def _replace(self, index: int) -> list[_SpanSession]:
        """Route the blocks of span ``index`` anew and replay its history there.

        If it does not complete, a placeholder stands in the chain (its next step fails and
        replaces it again), so the chain always covers every block."""
        failed = self._spans.pop(index)
        with trio.CancelScope(shield=True):
            await failed.close()
        history = self._history.pop(failed.span.start, None)
        opened: list[_SpanSession] = []
        try:
            assert self._batch is not None
            route = await self.manager.make_sequence(
                failed.span.start,
                failed.span.end,
                mode="min_latency",
                cache_tokens_needed=self.max_length * self._batch,
            )
            opened = await self._open_spans(route, index)
            x = history
            for session in opened:
                if x is None or x.shape[1] == 0:
                    break
                try:
                    with trio.fail_after(self.manager.config.request_timeout_s):
                        output, _ = await session.step(
                            x,
                            0,
                            prompts=self._span_prompts(session.span),
                            hypo_ids=None,
                            step_id=next(self._step_ids),
                        )
                except RETRIABLE:
                    self.manager.on_request_failure(session.peer)
                    raise
                self._history[session.span.start] = x
                x = output
        except BaseException:
            for other in opened:
                self._spans.remove(other)
                with trio.CancelScope(shield=True):
                    await other.close()
            for session in opened:
                self._history.pop(session.span.start, None)
            if history is not None:
                self._history[failed.span.start] = history
            self._spans.insert(index, _Placeholder(failed.span))
            raise
        return opened


class _Placeholder(_SpanSession):
    """A span whose server is gone: its first step fails, which replaces it."""

    async def step(
        self,
        hidden: torch.Tensor,
        position: int,
        *,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        step_id: int,
        push: tuple[PushTarget, ...] = (),
    ) -> tuple[torch.Tensor, bool]:
        raise ServerError(f"no server holds blocks {self.span.start}:{self.span.end} yet")

    async def answer(
        self, hidden: torch.Tensor, position: int, step_id: int
    ) -> tuple[torch.Tensor, bool]:
        raise ServerError(f"no server holds blocks {self.span.start}:{self.span.end} yet")

    async def close(self) -> None:
        return None
