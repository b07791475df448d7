"""An inference session's state on the client, without I/O: fed events, it says what to send.

:class:`SessionCore` holds what a session must remember to survive its servers: the position,
every span's history (the inputs sent to it, ``(B, position, hidden)``, to replay on a
replacement), deep prompts and left padding given at position 0, the step ids, and the chain of
spans (:class:`SpanState`).  The trio driver (``client/_inference.py``) asks it for each message
(:meth:`SessionCore.opening`, :meth:`SessionCore.request`, :meth:`SessionCore.replay`), tells
it what came back (:meth:`SessionCore.answered`) or failed (:meth:`SessionCore.failed`), and
does the I/O, the timeouts and the retries.

A step, as the core sees it: :meth:`SessionCore.begin` checks it (``ValueError`` for the
caller's mistakes, before anything is sent) and applies what it changes first (new padding,
beam reordering of the histories); spans are opened if there are none (:meth:`route_opened`);
then for each span in order, a request (or, when the previous server pushed the step on, just
the answer to wait for), and its answer, whose output is the next span's input.  A span that
fails is replaced: :meth:`SessionCore.take_for_replacement` gives its history, the replacements
(:meth:`route_opened`) are replayed from position 0 (:meth:`replay`, :meth:`replayed`, in
steps of at most :data:`MAX_STEP_BYTES`), and the step goes on from that span.
:meth:`SessionCore.finish` ends the step; a step that fails for good is abandoned
(:meth:`SessionCore.abandon`): it can be sent again as it was.  A step whose hidden states take
more than :data:`MAX_STEP_BYTES` (a long prefill) goes as several, one per range of positions
(:meth:`SessionCore.step_pieces`): each begins ``continued`` from the one before and finishes
with ``more`` to come, and abandoning any of them takes back the whole step.
"""

from __future__ import annotations

import itertools
import secrets
import uuid

import attrs
import torch

from .._errors import ServerError
from ..protocol import (
    PUSH_KEY_BYTES,
    OpenSession,
    PushTarget,
    Step,
    StepResult,
    prompts_fit,
    push_grant,
)
from ..routing import RouteSpan
from ._placement import describe

__all__ = ["MAX_STEP_BYTES", "SessionCore", "SpanState"]

#: The most bytes of hidden states one step message carries (servers take messages of 128 MiB
#: by default): a long history is replayed, and a long prefill sent, in several steps.
MAX_STEP_BYTES = 32 << 20


@attrs.define(eq=False)
class SpanState:
    """One span of the chain: its server's blocks, and the session id it holds there.
    ``gone``: its server failed and no replacement is open yet (its next step fails)."""

    span: RouteSpan
    session_id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    #: The secret its pushed steps are granted with (see ``protocol._inference``).
    push_key: bytes = attrs.field(factory=lambda: secrets.token_bytes(PUSH_KEY_BYTES), repr=False)
    gone: bool = False
    #: Its session may hold a reorder the client took back (a failed step's): it is replaced
    #: and replayed before its next step, its server not blamed.
    stale: bool = False
    #: The left padding its session was opened with (what its step receipts sign).
    padding: tuple[int, ...] | None = None

    @property
    def peer(self) -> str:
        return self.span.peer_id


class SessionCore:
    """A session of up to ``max_length`` positions through ``blocks`` (see the module)."""

    def __init__(self, *, blocks: range, max_length: int, hidden_size: int | None = None) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.blocks = blocks
        self.max_length = max_length
        self.spans: list[SpanState] = []
        self.position = 0
        self.batch: int | None = None
        #: The size of the model's hidden states if known, else the first step's.
        self.hidden_size = hidden_size
        self.prompts: torch.Tensor | None = None
        self.padding: list[int] | None = None
        #: Each span's inputs so far, by the span's first block.
        self.history: dict[int, torch.Tensor] = {}
        self._buffers: dict[int, torch.Tensor] = {}  # what the histories are views of
        self._drop_spans = False
        self._step_ids = itertools.count()
        # The step under way.
        self._tokens = 0
        self._hypo_ids: torch.Tensor | None = None
        self._fresh: set[int] = set()  # spans opened during it: hypo_ids are not for them
        self._push = False
        self._pushed_id: int | None = None  # the step id pushed to the span to answer next
        self._expected: dict[int, int] = {}  # id(span) -> step id of the answer awaited
        self._undo: _Undo | None = None  # what the step's reorder replaced
        #: The position the caller's step under way began at (its pieces included).
        self._began_at: int | None = None

    # -- position --------------------------------------------------------------------------------

    def rollback(self, position: int) -> None:
        """Forget everything from ``position`` on (the servers are told with the next step)."""
        if not 0 <= position <= self.position:
            raise ValueError(
                f"position can only go back: {position} is not in [0, {self.position}]"
            )
        self.position = position
        for start, history in self.history.items():
            self.history[start] = history[:, :position]
        if position == 0:
            self.prompts = None
            if self.padding is not None:
                # New rows may come: the servers' sessions hold the old padding.
                self.padding = None
                self._drop_spans = True

    # -- a step ----------------------------------------------------------------------------------

    def begin(
        self,
        hidden: torch.Tensor,
        *,
        prompts: torch.Tensor | None,
        hypo_ids: torch.Tensor | None,
        padding: torch.Tensor | None,
        continued: bool = False,
        length: int | None = None,
    ) -> bool:
        """Check a step (``ValueError`` for the caller's mistakes) and apply what comes before
        it.  Returns whether the open spans must be closed first (padding changed: the servers'
        sessions hold the old one); :meth:`spans` is then empty.  ``continued``: the step goes
        on from the one before (finished with ``more``), part of the same step of the caller's
        (:meth:`step_pieces`); ``length``: the positions of that whole step, where the left
        padding lies (by default, this step's)."""
        self._check(hidden, prompts, hypo_ids)
        lengths = None if padding is None else self._check_padding(hidden, padding, length)
        if self.batch is None:
            self.batch, self.hidden_size = hidden.shape[0], hidden.shape[2]
        close = False
        if lengths is not None:
            close = bool(self.spans)
            self.padding = lengths
        if self._drop_spans:
            self._drop_spans = False
            close = close or bool(self.spans)
        if close:
            self.spans = []
            self._free_unused()
        if self.position == 0 and prompts is not None:
            self.prompts = prompts
        if not continued:
            self._undo, self._began_at = None, self.position
        if hypo_ids is not None:
            hypo_ids = hypo_ids.to("cpu", torch.int64)
            self._undo = _Undo(list(self.spans), dict(self.history), self.padding, self.prompts)
            for start, history in self.history.items():
                self.history[start] = history[hypo_ids]
            if self.padding is not None:
                self.padding = [self.padding[i] for i in hypo_ids.tolist()]
            if self.prompts is not None and self.prompts.shape[1] > 1:  # a prompt per row
                self.prompts = self.prompts[:, hypo_ids.to(self.prompts.device)]
        self._tokens = hidden.shape[1]
        self._hypo_ids = hypo_ids
        self._fresh = set()
        self._push = False
        self._pushed_id = None
        self._expected = {}
        return close

    def route_opened(self, route: list[RouteSpan], at: int) -> list[SpanState]:
        """Spans for ``route``, put at index ``at`` of the chain (their sessions are to be
        opened with :meth:`opening`)."""
        opened = [SpanState(span) for span in route]
        self.spans[at:at] = opened
        self._fresh.update(id(state) for state in opened)
        return opened

    def route_abandoned(self, opened: list[SpanState]) -> None:
        """Spans from :meth:`route_opened` whose sessions could not all be opened."""
        for state in opened:
            self.spans.remove(state)

    def opening(
        self, state: SpanState, *, alloc_timeout: float, active_adapter: str | None
    ) -> OpenSession:
        """The message that opens ``state``'s session (which remembers the padding it sends)."""
        assert self.batch is not None
        padding = self.padding
        state.padding = tuple(padding) if padding is not None and any(padding) else None
        return OpenSession(
            session_id=state.session_id,
            blocks=(state.span.start, state.span.end),
            max_length=self.max_length,
            batch_size=self.batch,
            alloc_timeout=alloc_timeout,
            active_adapter=active_adapter,
            points=0.0,
            left_padding=state.padding,
            push_key=state.push_key,
        )

    def start_chain(self, *, server_to_server: bool) -> None:
        """The spans are open: decide whether the step goes from server to server (a plain step
        goes to the first server, which pushes its output on to the next, and so on)."""
        self._push = (
            server_to_server
            and len(self.spans) > 1
            and self._hypo_ids is None
            and (self.prompts is None or self.position >= self.prompts.shape[2])
        )

    def request(self, index: int, x: torch.Tensor) -> Step | None:
        """The step message for span ``index`` with input ``x``, or None when the previous
        server pushed the step on to it (its answer is awaited all the same)."""
        state = self.spans[index]
        if state.gone:
            raise ServerError(f"no server holds blocks {state.span.start}:{state.span.end} yet")
        if self._pushed_id is not None:
            self._expected[id(state)] = self._pushed_id
            return None
        step_id = next(self._step_ids)
        push: tuple[PushTarget, ...] = ()
        if self._push and index + 1 < len(self.spans):
            batch, tokens = x.shape[0], x.shape[1]
            push = tuple(
                PushTarget(
                    peer=later.peer,
                    session_id=later.session_id,
                    grant=push_grant(
                        later.push_key,
                        pusher=before.peer,
                        step_id=step_id,
                        position=self.position,
                        tokens=tokens,
                        batch=batch,
                    ),
                )
                for before, later in itertools.pairwise(self.spans[index:])
            )
        self._expected[id(state)] = step_id
        # The position is always explicit: after a pushed step that failed half-way, what the
        # server holds is not known here, and resending from the position is always right.
        return Step(
            hidden_states=x,
            start_from_position=self.position,
            step_id=step_id,
            prompts=self._step_prompts(state.span, self.position, x.shape[1]),
            hypo_ids=None if id(state) in self._fresh else self._hypo_ids,
            push=push,
        )

    def is_answer(self, index: int, result: StepResult) -> bool:
        """Whether ``result`` answers the step awaited from span ``index`` (others are stale:
        pushed steps that were resent since)."""
        return result.step_id == self._expected.get(id(self.spans[index]))

    def answered(self, index: int, x: torch.Tensor, result: StepResult) -> torch.Tensor:
        """Span ``index`` answered its step (input ``x``): its output, the next span's input.
        Raises :class:`ServerError` for an answer that does not fit the step."""
        state = self.spans[index]
        output = _checked(state, x, result, self.position)
        self._pushed_id = self._expected.pop(id(state)) if result.pushed is True else None
        self._remember(state.span.start, x)
        return output

    def failed(self) -> None:
        """A span failed during the step: from here on, step by step (what the servers after
        it got is unknown; explicit positions and fresh step ids make any of it harmless)."""
        self._push = False
        self._pushed_id = None

    def take_for_replacement(self, index: int) -> tuple[SpanState, torch.Tensor | None]:
        """Span ``index`` is to be replaced: it leaves the chain with its history."""
        state = self.spans.pop(index)
        self._expected.pop(id(state), None)
        return state, self.history.pop(state.span.start, None)

    def replay_pieces(self, x: torch.Tensor, max_bytes: int | None = None) -> list[tuple[int, int]]:
        """The position ranges in which history ``x`` is replayed, one step each: each step's
        hidden states take at most ``max_bytes`` (:data:`MAX_STEP_BYTES` by default: however
        long the history, no message goes beyond what servers take), and the first holds the
        deep prompts' positions (those the history has)."""
        first = 0 if self.prompts is None else self.prompts.shape[2]
        return _pieces(x, first, MAX_STEP_BYTES if max_bytes is None else max_bytes)

    def step_pieces(
        self,
        hidden: torch.Tensor,
        *,
        prompts: torch.Tensor | None,
        max_bytes: int | None = None,
    ) -> list[tuple[int, int]]:
        """The position ranges of ``hidden`` that go as one step each: the whole step unless
        its hidden states take more than ``max_bytes`` (:data:`MAX_STEP_BYTES` by default: a
        long prefill), and then the first range holds the deep prompts' positions (the left
        padding goes with the sessions' openings: the first range gives it, with the whole
        step's ``length``, to :meth:`begin`).  A step that does not fit the session is one
        range, whole (:meth:`begin` refuses it)."""
        max_bytes = MAX_STEP_BYTES if max_bytes is None else max_bytes
        if (
            not isinstance(hidden, torch.Tensor)
            or hidden.dim() != 3
            or hidden.nbytes <= max_bytes
            or self.position + hidden.shape[1] > self.max_length
        ):
            return [(0, hidden.shape[1] if isinstance(hidden, torch.Tensor) else 0)]
        first = 0
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 4:
            first = prompts.shape[2]
        return _pieces(hidden, first, max_bytes)

    def replay(self, state: SpanState, x: torch.Tensor, start: int, end: int) -> Step:
        """The step that rebuilds positions ``start:end`` of a replacement's cache from its
        span's history ``x`` (see :meth:`replay_pieces`)."""
        step_id = next(self._step_ids)
        self._expected[id(state)] = step_id
        return self._piece(state.span, x, start, end, step_id)

    def _piece(self, span: RouteSpan, x: torch.Tensor, start: int, end: int, step_id: int) -> Step:
        """Positions ``start:end`` of ``x``, a span's inputs from position 0, as one step."""
        prompts = self._step_prompts(span, start, end - start)
        return Step(
            hidden_states=x[:, start:end],
            start_from_position=start,
            step_id=step_id,
            prompts=prompts,
        )

    def replayed(
        self, state: SpanState, x: torch.Tensor, start: int, end: int, result: StepResult
    ) -> torch.Tensor:
        """A replacement answered its replay of positions ``start:end`` of history ``x``: its
        output there (the next replacement's history).  Raises :class:`ServerError` for an
        answer that does not fit."""
        output = _checked(state, x[:, start:end], result, start)
        self._expected.pop(id(state), None)
        if end == x.shape[1]:
            self.history[state.span.start] = x
        return output

    def replacement_failed(
        self,
        index: int,
        failed: SpanState,
        history: torch.Tensor | None,
        opened: list[SpanState],
    ) -> None:
        """A replacement did not complete: its spans leave the chain, the failed span's history
        is kept, and a span whose server is gone stands in (its next step replaces it again),
        so that the chain always covers every block."""
        for state in opened:
            if state in self.spans:
                self.spans.remove(state)
            self.history.pop(state.span.start, None)
        if history is not None:
            self.history[failed.span.start] = history
        # A stale span's replacement failing blames nobody: it stays stale.
        self.spans.insert(index, SpanState(failed.span, gone=True, stale=failed.stale))

    def finish(self, *, more: bool = False) -> None:
        """Every span answered: the step's positions are the session's.  ``more``: the
        caller's step goes on in a next step (``continued``), and failing there takes this one
        back too."""
        self.position += self._tokens
        if not more:
            self._undo, self._began_at = None, None
        self._free_unused()

    def abandon(self, *, interrupted: bool = False) -> list[SpanState]:
        """The step failed (or was cancelled): the session is as before it, so that the step
        can be sent again as it was.  Positions that pieces of it finished are taken back; so
        is a reorder it made (``hypo_ids``): the chain, the histories, the padding and the
        prompts are as before the step, and every span is then stale (its server may hold the
        reorder).  ``interrupted``: the step stopped where it was (cancelled, or failed for
        good midway), so what the spans' streams hold is unknown (part of a message, answers
        not read): every span is stale too.  Returns the spans that leave the chain (their
        sessions are to be closed)."""
        undo, self._undo = self._undo, None
        left = []
        if undo is not None:
            left = [state for state in self.spans if state not in undo.spans]
            self.spans = undo.spans
            self.history, self.padding, self.prompts = undo.history, undo.padding, undo.prompts
        if undo is not None or interrupted:
            for state in self.spans:
                state.stale = True
        began_at, self._began_at = self._began_at, None
        if began_at is not None and self.position != began_at:
            self.rollback(began_at)
        self._free_unused()
        return left

    # -- internals -------------------------------------------------------------------------------

    def _check(
        self, hidden: torch.Tensor, prompts: torch.Tensor | None, hypo_ids: torch.Tensor | None
    ) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] < 1:
            raise ValueError(
                f"hidden states must be (batch, tokens, hidden), got {describe(hidden)}"
            )
        if self.hidden_size is not None and hidden.shape[2] != self.hidden_size:
            raise ValueError(
                f"this session's hidden states are of size {self.hidden_size}; "
                f"got {tuple(hidden.shape)}"
            )
        # The first step sets the batch (in begin, once everything of the step is checked).
        batch = hidden.shape[0] if self.batch is None else self.batch
        hidden_size = hidden.shape[2] if self.hidden_size is None else self.hidden_size
        if hidden.shape[0] != batch:
            raise ValueError(f"this session has {batch} rows; got {tuple(hidden.shape)}")
        if self.position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"{self.position} + {hidden.shape[1]} positions exceed the session's "
                f"max_length {self.max_length}"
            )
        if prompts is not None:
            if self.position != 0:
                raise ValueError("deep prompts go with the first step (position 0)")
            blocks, tokens = len(self.blocks), hidden.shape[1]
            if not isinstance(prompts, torch.Tensor) or not prompts_fit(
                prompts, blocks=blocks, batch=batch, tokens=tokens, hidden_size=hidden_size
            ):
                raise ValueError(
                    f"deep prompts must be ({blocks} blocks, 1 or {batch} rows, at most "
                    f"{tokens} positions (this step's), {hidden_size}); "
                    f"got {describe(prompts)}"
                )
        if hypo_ids is not None and (
            not isinstance(hypo_ids, torch.Tensor)
            or hypo_ids.shape != (batch,)
            or hypo_ids.dtype.is_floating_point
            or hypo_ids.dtype == torch.bool
            or not bool(((hypo_ids >= 0) & (hypo_ids < batch)).all())
        ):
            raise ValueError(f"hypo_ids must be ({batch},) integers in [0, {batch})")

    def _check_padding(
        self, hidden: torch.Tensor, padding: torch.Tensor, length: int | None
    ) -> list[int]:
        if self.position != 0:
            raise ValueError("left padding goes with the first step (position 0)")
        if (
            not isinstance(padding, torch.Tensor)
            or padding.shape != (hidden.shape[0],)
            or padding.dtype.is_floating_point
            or padding.dtype == torch.bool
        ):
            raise ValueError(f"padding must be ({hidden.shape[0]},) integers")
        lengths: list[int] = padding.tolist()
        bound = hidden.shape[1] if length is None else length
        if not all(0 <= row <= bound for row in lengths):
            raise ValueError(f"padding must lie in [0, {bound}] (this step's length)")
        return lengths

    def inputs_of(self, span: RouteSpan, x: torch.Tensor) -> torch.Tensor:
        """Everything ``span`` has computed from, up to and with this step's input ``x`` (what
        a check replays on another server)."""
        history = self.history.get(span.start)
        if history is None or self.position == 0:
            return x
        return torch.cat([history[:, : self.position].to(x.dtype), x], dim=1)

    def following_steps(self, span: RouteSpan, x: torch.Tensor, *, opened_now: bool) -> list[Step]:
        """The steps for a server that follows ``span``'s session to check it: this step's
        input ``x`` at this step's position; for a follower opened at this step past position
        0, every input of the span so far from position 0 first: in one step if they fit one
        (the answer's last ``x.shape[1]`` positions are this step's), else in pieces as a
        replay goes (:meth:`checking_steps`) and then ``x`` (the last answer is this step's)."""
        prompts = self._step_prompts(span, self.position, x.shape[1])
        if opened_now and self.position > 0:
            inputs = self.inputs_of(span, x)
            if len(self.replay_pieces(inputs)) == 1:
                return self.checking_steps(span, inputs)
            catch_up = self.checking_steps(span, inputs[:, : self.position])
            step_id = len(catch_up)
            return [
                *catch_up,
                Step(
                    hidden_states=x,
                    start_from_position=self.position,
                    step_id=step_id,
                    prompts=prompts,
                ),
            ]
        step = Step(
            hidden_states=x,
            start_from_position=self.position,
            prompts=prompts,
            hypo_ids=None if opened_now else self._hypo_ids,
        )
        return [step]

    def checking_steps(self, span: RouteSpan, inputs: torch.Tensor) -> list[Step]:
        """The steps that compute ``inputs`` (from position 0) through ``span``'s blocks on a
        server that checks an answer, in pieces as a replay goes (:meth:`replay_pieces`: no
        message beyond what servers take); the first carries the session's deep prompts."""
        pieces = self.replay_pieces(inputs)
        return [self._piece(span, inputs, *piece, step_id) for step_id, piece in enumerate(pieces)]

    @staticmethod
    def checked_answer(state: SpanState, step: Step, result: StepResult) -> torch.Tensor:
        """The output of ``result``, a checking server's answer to ``step`` (in the step's
        dtype).  Raises :class:`ServerError` for an answer that does not fit."""
        return _checked(state, step.hidden_states, result, step.start_from_position or 0)

    def _step_prompts(self, span: RouteSpan, start: int, tokens: int) -> torch.Tensor | None:
        """The deep prompts of ``span``'s blocks for ``tokens`` positions from ``start`` (the
        prompts are of the session's first positions: a step after a rollback inside them
        takes the rest of them, as a replay does)."""
        prompts = self._span_prompts(span)
        if prompts is None or start >= prompts.shape[2]:
            return None
        return prompts[:, :, start : start + tokens]

    def _span_prompts(self, span: RouteSpan) -> torch.Tensor | None:
        if self.prompts is None:
            return None
        base = self.blocks.start
        return self.prompts[span.start - base : span.end - base]

    def _free_unused(self) -> None:
        """Forget the histories, and their buffers, of span starts no longer in the chain (a
        route replaced, or a re-route taken back): no span replays them."""
        starts = {state.span.start for state in self.spans}
        for kept in (self.history, self._buffers):
            for start in [start for start in kept if start not in starts]:
                del kept[start]

    def _remember(self, start: int, inputs: torch.Tensor) -> None:
        # Histories are views of buffers that grow by doubling, so that a step appends in
        # place instead of copying everything sent so far.
        history = self.history.get(start)
        kept = 0 if history is None else min(self.position, history.shape[1])
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
        self.history[start] = buffer[:, :end]


@attrs.frozen
class _Undo:
    spans: list[SpanState]
    history: dict[int, torch.Tensor]
    padding: list[int] | None
    prompts: torch.Tensor | None


def _pieces(x: torch.Tensor, first: int, max_bytes: int) -> list[tuple[int, int]]:
    """Position ranges covering ``x`` ``(B, T, hidden)``, each at most ``max_bytes`` of it but
    the first, which holds at least ``first`` positions."""
    length = x.shape[1]
    per_position = max(1, x.shape[0] * x.shape[2] * x.element_size())
    size = max(1, max_bytes // per_position)
    ends = [min(max(size, first), length)]
    while ends[-1] < length:
        ends.append(min(ends[-1] + size, length))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _checked(state: SpanState, x: torch.Tensor, result: StepResult, position: int) -> torch.Tensor:
    """The output of ``result``, the answer to input ``x`` at ``position``, in ``x``'s dtype."""
    output = result.hidden_states
    expected = position + x.shape[1]
    if output.shape != x.shape or result.position != expected:
        raise ServerError(
            f"server {state.peer} answered a step with {describe(output)} at position "
            f"{result.position}; expected {tuple(x.shape)} at {expected}"
        )
    return output.to(x.dtype)
