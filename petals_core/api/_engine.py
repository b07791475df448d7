"""Generation behind the endpoint: each request runs in one inference session of its own, as a
task of the endpoint's trio program, and the decode steps of the running requests go together.

A request's task embeds its prompt, sends it through the servers in its session, and then
repeats the decode step: the last position's hidden states go through the final norm and the LM
head, a token is chosen for each row (:mod:`._sampling`), and its embedding is the next step.
The requests do their steps in the same program, and :class:`~._lineup.Lineup` lines them up,
so that the LM head runs once for all of them and the servers see their steps arrive together
(see :mod:`._lineup`).

What a request generated is kept by its :class:`~._job.Job`, which takes each step's tokens and
says what to send; the request's task sends it to the HTTP side as events (:mod:`._records`)
through a trio channel, one :class:`Chunk` per new token and row as it is generated.

The channel holds :data:`EVENTS_PER_ROW` events per row at most, and the task never waits for
room in it: a request's steps go on at the pace of its servers and of the requests lined up
with it, whatever its client's.  A reader that falls that far behind (a client that stops
reading its stream: the HTTP side's writes to it wait) is given up on: the request stops at its
next token, its session closes, the events not yet read are dropped at once, the engine counts
it in :attr:`Engine.abandoned`, and the reader gets :class:`SlowReader` when it asks for its
next event.  Waiting instead would hold the request's turn and the servers' caches for a
client that may never read again, and keep the requests lined up with it waiting at each step.

When the HTTP side goes away (the client disconnected) or the endpoint shuts down, the request
stops at its next token and its session closes, which frees the servers' caches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Final, TypeVar

import torch
import trio

from .. import PetalsError
from ..routing import MissingBlocksError
from ._errors import ApiError
from ._job import Job
from ._lineup import Entry, Lineup
from ._records import Event, Limits, PromptLogprobs, TokenLogprob, Usage
from ._requests import Sampling
from ._sampling import Chooser, Drafts, follow_drafts, prompt_logprobs
from ._speculative import PROMPT_LOOKUP_NUM_TOKENS, SpeculationCounts, check_speculative
from ._tokenizing import Tokenizing

__all__ = ["EVENTS_PER_ROW", "Engine", "SlowReader"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: Events a request's channel holds per row (see the module): many more than one step adds, even
#: with draft tokens, so that a reader that keeps up never sees the bound.
EVENTS_PER_ROW: Final = 128


class SlowReader(Exception):
    """Raised to the reader of a request's events that fell :data:`EVENTS_PER_ROW` events per
    row behind, at its next read: the request was given up on, and its unread events dropped."""


class _Request:
    """A request as the engine runs it: its :class:`~._job.Job`, the channel its events go to,
    and its place in the queue."""

    def __init__(
        self,
        job: Job,
        send: trio.MemorySendChannel[Event],
        receive: trio.MemoryReceiveChannel[Event],
    ) -> None:
        self.job = job
        #: Where the request waits for its turn (see :meth:`Engine._run`), whether it got one,
        #: and whether it stopped counting towards the queue's limit.
        self.waiting = trio.CancelScope()
        self.started = False
        self.left = False
        #: Whether the reader fell so far behind that the request was given up on.
        self.overrun = False
        self._send = send
        self._receive = receive

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the HTTP side, without waiting: where the channel is full, the
        reader is given up on (see the module)."""
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self._give_up()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.job.cancelled = True  # nobody listens any more

    def emit_all(self, events: Sequence[Event]) -> None:
        """:meth:`emit` each of ``events``, in order."""
        for event in events:
            self.emit(event)

    def _give_up(self) -> None:
        """The reader fell too far behind: the request stops, nothing more goes to the reader,
        and what it has not read is dropped now (its client may keep its connection, and
        its response waiting, for long)."""
        self.overrun = True
        self.job.cancelled = True
        self._send.close()
        with contextlib.suppress(trio.EndOfChannel):
            while True:
                self._receive.receive_nowait()


class Engine(Tokenizing):
    """Runs generation requests against ``model`` (a distributed causal LM whose network part
    runs in this trio program) with ``tokenizer``, within ``limits``; jobs run in ``nursery``.

    The decoding requests are split into ``decode_groups`` groups, each lined up on its own
    (see :mod:`._lineup`; a new request joins the smallest). One group batches the most:
    every decode step of the servers carries every request. Two or more let the groups' steps
    overlap along the chain, one group at a server while another is at the next, which pays
    where the servers' compute is the bound and their hosts have cores to spare.
    ``decode_groups`` may be changed at any time; it applies to requests that start after.

    ``speculative="prompt_lookup"`` drafts up to ``prompt_lookup_num_tokens`` tokens per step
    by prompt lookup (see :mod:`._speculative`); :attr:`speculation` counts the steps and
    draft tokens of every request. Both may be changed at any time, for requests that start
    after.

    Prompts and chats become token ids, and requests are checked against the limits, by the
    engine's :class:`~._tokenizing.Tokenizing` side. Use :meth:`generate`, an async context
    manager yielding the request's events."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        limits: Limits,
        nursery: trio.Nursery,
        decode_groups: int = 1,
        speculative: str | None = None,
        prompt_lookup_num_tokens: int = PROMPT_LOOKUP_NUM_TOKENS,
    ) -> None:
        check_speculative(speculative, prompt_lookup_num_tokens)
        if isinstance(decode_groups, bool) or not isinstance(decode_groups, int):
            raise TypeError(f"decode_groups must be an integer, got {decode_groups!r}")
        if decode_groups < 1:
            raise ValueError(f"decode_groups must be >= 1, got {decode_groups}")
        super().__init__(model, tokenizer, name=name, limits=limits)
        self._nursery = nursery
        self._slots = trio.Semaphore(limits.max_concurrent_requests)
        self._waiting = 0
        #: Requests waiting for the tokenizer or in it (:meth:`tokenize`).
        self._tokenizing = 0
        #: Requests generating now, and the most that ever did at once.
        self.running = 0
        self.peak_running = 0
        #: Requests that generated to the end, stopped early (the client left), or failed.
        self.completed = 0
        self.interrupted = 0
        self.failed = 0
        #: Requests given up on because their reader fell :data:`EVENTS_PER_ROW` events per row
        #: behind (each is also counted above, most often as interrupted).
        self.abandoned = 0
        self._base = model.distributed_base
        self._head = model.get_output_embeddings()
        self._device = self._base.local_device  # where the embeddings and the LM head are
        self.decode_groups = decode_groups
        self._speculative = speculative
        self._prompt_lookup_num_tokens = prompt_lookup_num_tokens
        #: Steps and draft tokens of the requests that decoded speculatively, all together.
        self.speculation = SpeculationCounts()
        self._lineups: list[Lineup] = []

    @property
    def speculative(self) -> str | None:
        """How requests draft tokens (``"prompt_lookup"``), or None: they do not."""
        return self._speculative

    @speculative.setter
    def speculative(self, method: str | None) -> None:
        check_speculative(method, self._prompt_lookup_num_tokens)
        self._speculative = method

    @property
    def prompt_lookup_num_tokens(self) -> int:
        """Draft tokens a speculative step sends at most."""
        return self._prompt_lookup_num_tokens

    @prompt_lookup_num_tokens.setter
    def prompt_lookup_num_tokens(self, count: int) -> None:
        check_speculative(self._speculative, count)
        self._prompt_lookup_num_tokens = count

    @property
    def decode_batches(self) -> tuple[int, int]:
        """Decode batches computed so far, and requests in them (over every group)."""
        return (
            sum(lineup.batches for lineup in self._lineups),
            sum(lineup.requests for lineup in self._lineups),
        )

    def _lineup(self) -> Lineup:
        """The group a new request decodes in: of the first ``decode_groups``, the one with the
        fewest requests (groups are made as they are first needed)."""
        while len(self._lineups) < self.decode_groups:
            self._lineups.append(Lineup(self._choose, self._nursery))
        return min(self._lineups[: self.decode_groups], key=lambda lineup: lineup.assigned)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        *,
        prompt_param: str = "prompt",
        prompt_logprobs: bool = False,
    ) -> _Generation:
        """``async with engine.generate(prompts, sampling) as events: async for event in
        events`` (:class:`Chunk` ..., then :class:`Usage`, or an :class:`ApiError`; with
        ``prompt_logprobs``, a :class:`PromptLogprobs` per prompt comes first, and
        ``max_tokens`` may be 0).

        Raises :class:`ApiError` at once for a request over the limits, or 429 when too many
        wait. Leaving the block early cancels the generation."""
        max_new_tokens = self.plan(prompts, sampling, prompt_param=prompt_param)
        if self._base.tuning_mode is not None and len({len(prompt) for prompt in prompts}) > 1:
            # (The trainable prompts go first, where a shorter prompt's left padding would.)
            raise ApiError.bad_request(
                f"{self.name} has trainable prompts, so the prompts of one request must have "
                "the same number of tokens",
                param=prompt_param,
            )
        self._check_queue(self._waiting)
        return _Generation(self, prompts, sampling, max_new_tokens, prompt_logprobs)

    def _check_queue(self, waiting: int) -> None:
        """429 when ``waiting`` requests already wait (for a turn, or for the tokenizer)."""
        if waiting >= self.limits.max_queued_requests + self.limits.max_concurrent_requests:
            raise ApiError(
                429,
                "Too many requests are waiting; try again shortly.",
                code="too_many_requests",
            )

    async def tokenize(self, encode: Callable[[], T]) -> T:
        """``encode()`` in the tokenizer's worker thread (see :class:`Tokenizing`), counted with
        the requests waiting for a turn: 429 when too many wait already."""
        self._check_queue(self._waiting + self._tokenizing)
        self._tokenizing += 1
        try:
            return await trio.to_thread.run_sync(encode, limiter=self.encode_limiter)
        finally:
            self._tokenizing -= 1

    async def _run(self, request: _Request, send: trio.MemorySendChannel[Event]) -> None:
        job = request.job
        error: Exception | None = None
        async with send:
            try:
                with request.waiting:  # cancelled when the HTTP side leaves before its turn
                    await self._slots.acquire()
                    request.started = True
                if request.waiting.cancelled_caught or job.cancelled:
                    if not request.waiting.cancelled_caught:
                        self._slots.release()
                    self.interrupted += 1
                    return
                try:
                    self.running += 1
                    self.peak_running = max(self.peak_running, self.running)
                    answered = False
                    try:
                        try:
                            await self._answer(request)
                            answered = True
                        except Exception as exc:
                            error = exc
                    finally:  # also when cancelled (the endpoint shuts down): interrupted
                        self.running -= 1
                        if error is not None:
                            self.failed += 1
                        elif job.interrupted or not answered:
                            self.interrupted += 1
                        else:
                            self.completed += 1
                finally:
                    self._slots.release()
                if error is not None:
                    request.emit(_api_error(error))
            finally:
                self._leave(request)
                if request.overrun:
                    self.abandoned += 1
                    logger.warning(
                        "gave up on a request whose reader fell %d events per row behind "
                        "(its client stopped reading its stream)",
                        EVENTS_PER_ROW,
                    )

    def _leave(self, request: _Request) -> None:
        """``request`` no longer counts towards the queue's limit (once, whoever says so
        first)."""
        if not request.left:
            request.left = True
            self._waiting -= 1

    async def _answer(self, request: _Request) -> None:
        """Generate ``request``'s rows, then send its usage."""
        job = request.job
        if job.max_new_tokens == 0 and not job.prompt_logprobs:
            request.emit_all(job.finish_empty())
        else:
            await self.decode_job(request)
        request.emit(job.usage())

    async def decode_job(self, request: _Request) -> None:
        """Generate ``request``'s rows in a session of its own, its decode steps lined up with
        those of the other running requests."""
        job = request.job
        base = self._base
        ids, padding = job.inputs()
        chooser = Chooser(job.sampling)
        draft_tokens = self._prompt_lookup_num_tokens if self._speculative is not None else 0
        if draft_tokens:
            job.speculation = SpeculationCounts()
        length = ids.shape[1] + job.max_new_tokens + base.pre_seq_len
        lineup = self._lineup()
        lineup.assigned += 1
        try:
            async with base.remote_blocks.open_inference_session(length) as session:
                with torch.no_grad():
                    hidden, deep = self._embed(ids, first=True)
                try:
                    prefill = True
                    drafts: torch.Tensor | None = None  # (rows, tokens) sent after the newest
                    while True:
                        output = await session.step(hidden, prompts=deep, padding=padding)
                        deep = padding = None
                        if prefill and job.prompt_logprobs:
                            if not await self._send_prompt_logprobs(request, output):
                                break
                            if job.max_new_tokens == 0:
                                request.emit_all(job.finish_empty())
                                break
                        if prefill or job.speculation is None:
                            chosen = [await lineup.choose(job, output[:, -1], chooser)]
                        else:
                            chosen = await self._check_drafts(
                                job, session, lineup, chooser, output, drafts
                            )
                        prefill = False
                        done = False
                        for tokens, logprobs in chosen:  # one position at a time
                            chunks, done = job.on_tokens(tokens, logprobs)
                            request.emit_all(chunks)
                            if done:
                                break
                        if done:
                            break
                        step = job.following(tokens)
                        drafts = job.draft(draft_tokens) if draft_tokens else None
                        if drafts is not None:
                            step = torch.cat([step, drafts], dim=1)
                        with torch.no_grad():
                            hidden, _ = self._embed(step)
                finally:
                    lineup.leave(job)
        finally:
            lineup.assigned -= 1

    async def _check_drafts(
        self,
        job: Job,
        session: Any,
        lineup: Lineup,
        chooser: Chooser,
        output: torch.Tensor,
        drafts: torch.Tensor | None,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The tokens (and log-probabilities) a speculative step keeps, ``(rows,)`` per
        position: the token chosen at its first position, and after each leading draft token
        that every unfinished row's token before it equals, the token chosen there; the
        session goes back over the positions of the draft tokens that are not kept."""
        assert job.speculation is not None
        if drafts is None:  # nothing to draft: a plain step
            job.speculation.add(0, 0)
            self.speculation.add(0, 0)
            return [await lineup.choose(job, output[:, -1], chooser)]
        count = drafts.shape[1]
        open_rows = [i for i, row in enumerate(job.rows) if row.finish_reason is None]
        checked = Drafts(hidden=output[:, -count:], tokens=drafts, rows=open_rows)
        first = await lineup.choose(job, output[:, -count - 1], chooser, checked)
        kept = len(checked.chosen)
        if kept < count:
            session.position -= count - kept
        job.speculation.add(count, kept)
        self.speculation.add(count, kept)
        return [first, *checked.chosen]

    async def _send_prompt_logprobs(self, request: _Request, output: torch.Tensor) -> bool:
        """Each prompt's tokens with their log-probabilities, from the blocks' ``output`` over
        the prompts (its first row of each prompt; the prompt is its last positions).  False
        if the request was cancelled meanwhile (its rows are then ended)."""
        job = request.job
        firsts = output[:: job.sampling.n]
        count = job.sampling.logprobs or 0
        per_prompt = await trio.to_thread.run_sync(
            self._prompt_logprobs, firsts, job.prompts, count, lambda: job.cancelled
        )
        if per_prompt is None or job.cancelled:
            job.end_cancelled()
            return False
        for index, logprobs in enumerate(per_prompt):
            request.emit(PromptLogprobs(prompt=index, logprobs=logprobs))
        return True

    def _prompt_logprobs(
        self,
        outputs: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        count: int,
        cancelled: Callable[[], bool],
    ) -> list[tuple[TokenLogprob, ...]] | None:
        """:func:`~._sampling.prompt_logprobs` with this engine's LM head and tokenizer."""
        return prompt_logprobs(
            outputs,
            prompts,
            count,
            cancelled,
            logits=self._logits,
            decode=self.decode,
            piece=self.token_text,
        )

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head over the blocks' output ``hidden`` ``(..., hidden)``:
        float32 logits ``(..., vocab)``."""
        return self._head(self._base.final_norm(hidden)).float()

    def _embed(
        self, ids: torch.Tensor, *, first: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first block's input for token ``ids`` ``(rows, tokens)``, and the deep prompts
        to send with it: trainable prompts go before the first step's tokens."""
        base = self._base
        embeddings = base.get_input_embeddings()(ids.to(self._device))
        deep = None
        if first and base.tuning_mode is not None:
            shallow, deep = base.prompts(ids.shape[0], embeddings.dtype)
            embeddings = torch.cat([shallow, embeddings], dim=1)
        return base.prepare_hidden(embeddings), deep

    def _choose(self, entries: list[Entry]) -> None:
        """The final norm and the LM head over every entry's rows at once, then each request's
        choice of tokens (in a worker thread)."""
        with torch.no_grad():
            logits = self._logits(torch.cat([entry.hidden for entry in entries]))
            start = 0
            for entry in entries:
                rows = entry.hidden.shape[0]
                try:
                    entry.tokens, entry.logprobs = entry.chooser(logits[start : start + rows])
                    if entry.drafts is not None:
                        follow_drafts(entry.tokens, entry.drafts, entry.chooser, self._logits)
                except Exception as exc:  # this request's own failure (say, NaN logits)
                    entry.error = exc
                start += rows


class _Generation:
    """The async context manager :meth:`Engine.generate` returns."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        limit: int,
        prompt_logprobs: bool,
    ) -> None:
        self._engine = engine
        self._args = (prompts, sampling, limit)
        self._prompt_logprobs = prompt_logprobs
        self._request: _Request | None = None

    async def __aenter__(self) -> AsyncIterator[Event]:
        engine = self._engine
        prompts, sampling, limit = self._args
        job = engine.job(prompts, sampling, limit, prompt_logprobs=self._prompt_logprobs)
        # Room for the prompts' logprobs and the last event too.
        room = EVENTS_PER_ROW * len(job.rows) + len(prompts) + 1
        send, receive = trio.open_memory_channel[Event](room)
        request = _Request(job, send, receive)
        engine._waiting += 1
        engine._nursery.start_soon(engine._run, request, send)
        self._request = request
        return _events(request, receive)

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._request is not None
        request = self._request
        request.job.cancelled = True
        request.waiting.cancel()  # a request still waiting for its turn leaves the queue now
        if not request.started:
            self._engine._leave(request)
        await request._receive.aclose()


async def _events(
    request: _Request, receive: trio.MemoryReceiveChannel[Event]
) -> AsyncIterator[Event]:
    async for event in receive:  # ends early where the request was given up on
        yield event
        if isinstance(event, Usage | ApiError):
            return
    if request.overrun:
        raise SlowReader("the client read its answer too slowly; it was given up on")


def _api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, MissingBlocksError):
        return ApiError(
            503, f"No server holds some of the model's blocks: {exc}", code="missing_blocks"
        )
    if isinstance(exc, PetalsError):
        return ApiError(503, f"The swarm failed this request: {exc}", code="swarm_error")
    logger.exception("generation failed", exc_info=exc)
    return ApiError(500, "Generation failed with an internal error.")  # the details are logged
