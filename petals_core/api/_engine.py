"""Generation behind the endpoint: each request runs in one inference session of its own, as a
task of the endpoint's trio program, and the decode steps of the running requests go together.

A request's task embeds its prompt, sends it through the servers in its session, and then
repeats the decode step: the last position's hidden states go through the final norm and the LM
head, a token is chosen for each row, and its embedding is the next step. The requests do their
steps in the same program, and :class:`_Lineup` lines them up: a request whose step came back
waits for the other running requests' steps, then the LM head runs once for all of them (a CPU
reads the whole ``(vocab, hidden)`` weight once instead of once per request), each request picks
its tokens, and all of them send their next step at the same moment. The servers see those steps
arrive together and run them as one batch. A request alone never waits; one whose step is late
(a server being replaced) holds the others up for at most about one step's time, then goes on in
a later batch.

What a request produces reaches the HTTP side as :class:`Chunk` events through a trio channel,
one per new token and row, as it is generated:

- each row's new token goes to :meth:`_Job.on_tokens`, which decodes the row's text, holds back
  what could be the start of a stop sequence, cuts the text at one, and stops the row there, at
  an end-of-sequence token, or at ``max_tokens``;
- sampling draws from the request's own ``torch.Generator`` (seeded by ``seed``), after
  temperature and top-p (transformers' warpers), so that concurrent requests do not share the
  global generator and a seed gives the same text again. ``temperature`` 0 is plain greedy
  decoding, the tokens of ``model.generate(do_sample=False)``;
- log-probabilities are the model's own (before temperature and top-p).

Rows of one request (several prompts, ``n``) are one batch of its session, left-padded as
``generate()`` pads them; a row that finished is fed the pad token until the others finish.

With ``speculative="prompt_lookup"`` a decode step also sends draft tokens after each row's
newest one, and the tokens it keeps go to :meth:`_Job.on_tokens` one position at a time (see
:mod:`._speculative`).

When the HTTP side goes away (the client disconnected) or the endpoint shuts down, the request
stops at its next token and its session closes, which frees the servers' caches.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import statistics
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import attrs
import torch
import trio
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from .. import PetalsError
from ..routing import MissingBlocksError
from ._detokenize import UNFINISHED, IncrementalText, TokenTexts
from ._errors import ApiError
from ._records import Chunk, Event, Limits, PromptLogprobs, TokenLogprob, Usage
from ._requests import Message, Sampling
from ._speculative import (
    PROMPT_LOOKUP_NUM_TOKENS,
    SpeculationCounts,
    check_speculative,
    prompt_lookup,
)

__all__ = ["GREEDY_BELOW", "Engine"]

#: Temperatures below this decode greedily: dividing logits by less overflows float32, and the
#: distribution is its argmax to within float precision long before.
GREEDY_BELOW: Final = 1e-6

#: How long the requests that are ready wait for a late one, at most: one step of the usual
#: length, within these bounds (seconds).
_HOLD_MIN_S: Final = 0.002
_HOLD_MAX_S: Final = 1.0
#: Steps the hold's "usual length" is the median of.
_STEP_SAMPLES: Final = 32
#: Prompt positions whose logits are computed at once (for a prompt's log-probabilities).
_PROMPT_LOGITS_CHUNK: Final = 64

logger = logging.getLogger(__name__)


class _Row:
    """One choice being generated: its tokens, its text, and what was sent of it."""

    def __init__(self, limit: int, decode: Callable[[Sequence[int]], str]) -> None:
        self.limit = limit
        self.text = IncrementalText(decode)
        self.tokens = self.text.tokens
        self.sent = 0  # characters of the text sent so far
        self.pending: list[TokenLogprob] = []
        self.finish_reason: str | None = None


class _Job:
    """One request: what to generate, and what of it was generated and sent."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        max_new_tokens: int,
        send: trio.MemorySendChannel[Event],
        *,
        prompt_logprobs: bool = False,
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.prompt_logprobs = prompt_logprobs
        #: Set when nobody waits for the rest (the HTTP side left, the endpoint shuts down).
        self.cancelled = False
        #: Where the job waits for its turn (see :meth:`Engine._run`), whether it got one, and
        #: whether it stopped counting towards the queue's limit.
        self.waiting = trio.CancelScope()
        self.started = False
        self.left = False
        self._send = send
        self._logprobs: torch.Tensor | None = None
        #: Its speculative steps, when it decodes speculatively (set by the engine).
        self.speculation: SpeculationCounts | None = None
        self.rows = [
            _Row(max_new_tokens, engine.decode) for prompt in prompts for _ in range(sampling.n)
        ]

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the HTTP side (the channel is unbounded: no waiting)."""
        try:
            self._send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.cancelled = True  # nobody listens any more

    async def run(self) -> None:
        if self.max_new_tokens == 0 and not self.prompt_logprobs:
            self.finish_empty()
        else:
            await self.engine.decode_job(self)
        self.emit(
            Usage(
                prompt_tokens=sum(len(prompt) for prompt in self.prompts),
                completion_tokens=sum(len(row.tokens) for row in self.rows),
                speculation=self.speculation,
            )
        )

    def finish_empty(self) -> None:
        """End every row with no token (``max_tokens`` 0)."""
        for index, row in enumerate(self.rows):
            row.finish_reason = "length"
            self.emit(Chunk(row=index, text="", finish_reason="length"))

    @property
    def interrupted(self) -> bool:
        """Whether some row was stopped by a cancellation rather than finishing."""
        return any(row.finish_reason == "cancelled" for row in self.rows)

    def on_tokens(self, new_tokens: torch.Tensor, logprobs: torch.Tensor | None = None) -> bool:
        """Take the newest token of each row (``logprobs``: the model's, ``(rows, vocab)``,
        when the request asked for them); returns whether every row is done."""
        self._logprobs = logprobs
        cancelled = self.cancelled
        done = True
        for index, row in enumerate(self.rows):
            if row.finish_reason is not None:
                continue
            chunk = self._advance(index, row, int(new_tokens[index]))
            if cancelled and row.finish_reason is None:
                row.finish_reason = "cancelled"
            if chunk is not None:
                self.emit(chunk)
            done = done and row.finish_reason is not None
        return done

    def _advance(self, index: int, row: _Row, token: int) -> Chunk | None:
        engine = self.engine
        offset = len(row.text.text)
        if token in engine.eos_token_ids:
            row.finish_reason = "stop"
            text = row.text.text
            if self._logprobs is not None:  # a scorer reads the end's logprob too
                row.pending.append(self._token_logprob(index, token, offset, end=True))
        else:
            text = row.text.add(token)
            if self._logprobs is not None:
                row.pending.append(self._token_logprob(index, token, offset))
            if len(row.tokens) >= row.limit:
                row.finish_reason = "length"
        end = len(text)
        stops = self.sampling.stop
        if stops:
            start = max(0, row.sent - max(len(s) for s in stops))
            found = [i for i in (text.find(s, start) for s in stops) if i >= 0]
            if found:
                end = min(found)
                row.finish_reason = "stop"
        if row.finish_reason is None:
            # Hold back an unfinished character and what may become a stop sequence.
            whole = text.rstrip(UNFINISHED)
            end = min(len(whole), _stop_prefix_start(whole, stops))
        new_text = text[row.sent : max(end, row.sent)]
        if not new_text and not row.pending and row.finish_reason is None:
            return None
        row.sent = max(end, row.sent)
        pending, row.pending = tuple(row.pending), []
        return Chunk(row=index, text=new_text, logprobs=pending, finish_reason=row.finish_reason)

    def _token_logprob(
        self, index: int, token: int, offset: int, *, end: bool = False
    ) -> TokenLogprob:
        assert self._logprobs is not None
        count = self.sampling.logprobs or 0
        return _scored(
            self._logprobs[index], token, count, self.engine.token_text, offset=offset, end=end
        )


def _scored(
    logprobs: torch.Tensor,
    token: int,
    count: int,
    piece: Callable[[int], str],
    *,
    offset: int,
    end: bool = False,
) -> TokenLogprob:
    """``token`` with its log-probability in ``logprobs`` ``(vocab,)``, and the ``count``
    likeliest tokens there; ``piece`` gives a token's text."""
    top: tuple[tuple[str, float], ...] = ()
    if count:
        values, ids = torch.topk(logprobs, count)
        top = tuple((piece(int(i)), float(v)) for v, i in zip(values, ids, strict=True))
    return TokenLogprob(
        token=piece(token), logprob=float(logprobs[token]), top=top, offset=offset, end=end
    )


class _Chooser:
    """A request's choice of tokens from the model's logits: greedy, or drawn from its own
    generator after temperature and top-p; with the log-probabilities when it asked for them."""

    def __init__(self, sampling: Sampling) -> None:
        self.logprobs = sampling.logprobs is not None
        # top_p 0 keeps only the likeliest token: greedy.
        self.greedy = sampling.temperature < GREEDY_BELOW or sampling.top_p == 0
        self._warpers: list[Any] = []
        if not self.greedy:
            if sampling.temperature != 1.0:
                self._warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(sampling.top_p))
        self._seed = sampling.seed
        self._generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens ``(rows,)`` and log-probabilities ``(rows, vocab)`` or None, on the CPU, for
        float32 ``logits`` ``(rows, vocab)``."""
        logprobs = torch.log_softmax(logits, dim=-1).cpu() if self.logprobs else None
        if self.greedy:
            return torch.argmax(logits, dim=-1).cpu(), logprobs
        scores = logits
        no_ids = torch.empty(logits.shape[0], 0, dtype=torch.long, device=logits.device)
        for warper in self._warpers:
            scores = warper(no_ids, scores)
        probs = torch.softmax(scores, dim=-1)
        if self._generator is None:  # on the device of the logits
            self._generator = torch.Generator(device=logits.device)
            if self._seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self._seed % 2**63)
        drawn = torch.multinomial(probs, 1, generator=self._generator)
        return drawn.squeeze(1).cpu(), logprobs


@attrs.define(eq=False)
class _Drafts:
    """The draft tokens of a speculative step, checked by the lineup's compute after the
    step's first position."""

    hidden: torch.Tensor  # (rows, tokens, hidden): the blocks' output at the draft tokens
    tokens: torch.Tensor  # (rows, tokens)
    rows: list[int]  # the unfinished rows: each must agree for a draft token to be kept
    #: The tokens (and log-probabilities) chosen after each draft token kept, in order.
    chosen: list[tuple[torch.Tensor, torch.Tensor | None]] = attrs.Factory(list)


@attrs.define(eq=False)
class _Entry:
    """A request's rows waiting in the lineup, and what comes back for them."""

    hidden: torch.Tensor  # (rows, hidden): the last position's output of the blocks
    chooser: _Chooser
    drafts: _Drafts | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    error: BaseException | None = None


class _Lineup:
    """Lines up the decode steps of the running requests (see the module's docstring).

    A request's task calls :meth:`choose` with its step's output once the step is back, and
    decodes from then until it calls :meth:`leave`. A task of the lineup's own (running while
    some request decodes) takes the first arrival's batch, waits until every decoding request
    has arrived (or left) or until about one step's time has passed, runs ``compute`` (the
    final norm, the LM head and each request's choice) for the batch in a worker thread, and
    releases its requests together."""

    def __init__(
        self,
        compute: Callable[[list[_Entry]], None],
        nursery: trio.Nursery,
        *,
        run_sync: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync,
    ) -> None:
        self._compute = compute
        #: How ``compute`` is run (a worker thread; the lineup's own tests run it inline).
        self._run_sync = run_sync
        self._nursery = nursery
        self._running = False
        self._members: set[object] = set()
        self._batch: dict[object, _Entry] = {}
        self._arrived = trio.Event()  # the batch has its first request
        self._complete = trio.Event()  # every decoding request is in the batch
        #: When each request was last released, and how long its steps took since (recent).
        self._released: dict[object, float] = {}
        self._steps_s: collections.deque[float] = collections.deque(maxlen=_STEP_SAMPLES)
        #: Requests that decode in this group, or will once their prompt is through.
        self.assigned = 0
        #: Batches computed, and requests in them (a ratio above 1: requests went together).
        self.batches = 0
        self.requests = 0

    async def choose(
        self,
        member: object,
        hidden: torch.Tensor,
        chooser: _Chooser,
        drafts: _Drafts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens (and log-probabilities) that ``chooser`` picks from ``hidden``'s logits,
        computed with those of the requests that arrive meanwhile (and ``drafts`` checked
        after them)."""
        released = self._released.pop(member, None)
        if released is not None:
            self._steps_s.append(time.monotonic() - released)
        self._members.add(member)
        entry = _Entry(hidden, chooser, drafts)
        self._batch[member] = entry
        self._arrived.set()
        if len(self._batch) >= len(self._members):
            self._complete.set()
        if not self._running:
            self._running = True
            self._nursery.start_soon(self._run)
        await entry.done.wait()
        if entry.error is not None:
            raise entry.error
        assert entry.tokens is not None
        return entry.tokens, entry.logprobs

    def leave(self, member: object) -> None:
        """``member`` decodes no more (it finished, failed, or was cancelled)."""
        self._members.discard(member)
        self._released.pop(member, None)
        self._batch.pop(member, None)
        if len(self._batch) >= len(self._members):
            self._complete.set()
            self._arrived.set()  # wakes the lineup's task to leave, when nobody decodes

    def _hold_s(self) -> float:
        """How long a batch waits for late requests: about one step (the recent median)."""
        if not self._steps_s:
            return _HOLD_MIN_S
        median = statistics.median(self._steps_s)
        return min(_HOLD_MAX_S, max(_HOLD_MIN_S, median))

    async def _run(self) -> None:
        try:
            while self._members:
                await self._arrived.wait()
                if len(self._batch) < len(self._members):
                    with trio.move_on_after(self._hold_s()):
                        await self._complete.wait()
                batch, self._batch = self._batch, {}
                self._arrived, self._complete = trio.Event(), trio.Event()
                if batch:
                    await self._release(batch)
        finally:
            self._running = False

    async def _release(self, batch: dict[object, _Entry]) -> None:
        entries = list(batch.values())
        try:
            await self._run_sync(self._compute, entries)
        except Exception as exc:  # compute failed as a whole: every request in it fails
            for entry in entries:
                entry.error = exc
        finally:
            self.batches += 1
            self.requests += len(entries)
            released = time.monotonic()
            for member, entry in batch.items():
                if member in self._members:
                    self._released[member] = released
                entry.done.set()


def _stop_prefix_start(text: str, stops: Sequence[str]) -> int:
    """Where the longest end of ``text`` that begins some stop sequence starts (or its end)."""
    start = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                start = min(start, len(text) - size)
                break
    return start


class Engine:
    """Runs generation requests against ``model`` (a distributed causal LM whose network part
    runs in this trio program) with ``tokenizer``, within ``limits``; jobs run in ``nursery``.

    The decoding requests are split into ``decode_groups`` groups, each lined up on its own
    (see the module's docstring; a new request joins the smallest). One group batches the most:
    every decode step of the servers carries every request. Two or more let the groups' steps
    overlap along the chain, one group at a server while another is at the next, which pays
    where the servers' compute is the bound and their hosts have cores to spare.
    ``decode_groups`` may be changed at any time; it applies to requests that start after.

    ``speculative="prompt_lookup"`` drafts up to ``prompt_lookup_num_tokens`` tokens per step
    by prompt lookup (see :mod:`._speculative`); :attr:`speculation` counts the steps and
    draft tokens of every request. Both may be changed at any time, for requests that start
    after.

    Use :meth:`generate`, an async context manager yielding the request's events."""

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
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.limits = limits
        self._nursery = nursery
        self._slots = trio.Semaphore(limits.max_concurrent_requests)
        self._waiting = 0
        # Prompts are tokenized in worker threads, one at a time, by a copy of the tokenizer of
        # their own: a long one never holds up the answers' decoding on the event loop.
        self._encoder = copy.deepcopy(tokenizer)
        self._encoder_lock = threading.Lock()
        #: The worker threads prompts are tokenized in: one (they take turns on the encoder),
        #: so that prompts waiting for it hold no thread the answers' steps need.
        self.encode_limiter = trio.CapacityLimiter(1)
        #: One token's own text, for log-probabilities.
        self.token_text = TokenTexts(tokenizer)
        #: Characters a token can stand for, at most (see :meth:`_encode`).
        self._longest_token = self.token_text.longest()
        #: Requests generating now, and the most that ever did at once.
        self.running = 0
        self.peak_running = 0
        #: Requests that generated to the end, stopped early (the client left), or failed.
        self.completed = 0
        self.interrupted = 0
        self.failed = 0
        eos = model.generation_config.eos_token_id
        ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(int(i) for i in ids)
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(self.eos_token_ids) if self.eos_token_ids else 0
        self.pad_token_id = int(pad)
        self._base = model.distributed_base
        self._head = model.get_output_embeddings()
        self._device = self._base.local_device  # where the embeddings and the LM head are
        self.decode_groups = decode_groups
        self._speculative = speculative
        self._prompt_lookup_num_tokens = prompt_lookup_num_tokens
        #: Steps and draft tokens of the requests that decoded speculatively, all together.
        self.speculation = SpeculationCounts()
        self._lineups: list[_Lineup] = []
        self.context_length = int(
            getattr(model.config, "max_position_embeddings", None) or limits.max_request_tokens
        )

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

    def _lineup(self) -> _Lineup:
        """The group a new request decodes in: of the first ``decode_groups``, the one with the
        fewest requests (groups are made as they are first needed)."""
        while len(self._lineups) < self.decode_groups:
            self._lineups.append(_Lineup(self._choose, self._nursery))
        return min(self._lineups[: self.decode_groups], key=lambda lineup: lineup.assigned)

    @property
    def max_request_tokens(self) -> int:
        return min(self.limits.max_request_tokens, self.context_length)

    def decode(self, tokens: Sequence[int]) -> str:
        """``tokens``' text.  Decoding only reads the tokenizer: the event loop and worker
        threads may decode at once (prompts are tokenized by another tokenizer)."""
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def _encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """``text``'s token ids, in a worker thread. A text that is surely more tokens than any
        request may hold is refused before tokenizing: no token stands for more characters
        than the longest in the vocabulary, and a normalizer (that may merge characters before
        the vocabulary sees them) is given a factor of 4."""
        limit = self.max_request_tokens
        if len(text) > self._longest_token * limit:
            raise ApiError(
                400,
                f"This endpoint's maximum context length is {limit} tokens. However, the "
                f"prompt's {len(text)} characters are more tokens than that. Please reduce the "
                "prompt.",
                param=param,
                code="context_length_exceeded",
            )
        with self._encoder_lock:
            ids = self._encoder.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in ids]

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion prompt's token ids (token ids are checked against the vocabulary), in a
        worker thread."""
        if isinstance(prompt, str):
            ids = self._encode(prompt, add_special_tokens=True, param="prompt")
            if not ids and self.tokenizer.bos_token_id is not None:
                ids = [int(self.tokenizer.bos_token_id)]
            if not ids:
                raise ApiError.bad_request("prompt is empty", param="prompt")
            return ids
        vocab = int(self.model.config.vocab_size)
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise ApiError.bad_request(
                f"prompt token ids must be from 0 to {vocab - 1}; got {bad[0]}", param="prompt"
            )
        return list(prompt)

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The chat's token ids through the tokenizer's chat template, ready for the answer, in a
        worker thread (the template's text, tokenized with no special tokens added, as
        ``apply_chat_template`` does)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError.bad_request(
                f"{self.name}'s tokenizer has no chat template: use /v1/completions",
                param="messages",
            )
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:  # rendering the template reads the tokenizer and changes nothing: no lock
            text = self._encoder.apply_chat_template(
                chat, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # the template's own checks (jinja2 raise_exception)
            raise ApiError.bad_request(
                f"the chat template refused these messages: {exc}", param="messages"
            ) from None
        return self._encode(str(text), add_special_tokens=False, param="messages")

    def check_rows(self, prompts: int, sampling: Sampling) -> None:
        """Refuse a request for more choices (prompts times ``n``) than the limit."""
        rows = prompts * sampling.n
        if rows > self.limits.max_rows:
            raise ApiError.bad_request(
                f"this endpoint generates at most {self.limits.max_rows} choices per request "
                f"(prompts x n); this request asks for {rows}",
                param="n",
            )

    def plan(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, prompt_param: str = "prompt"
    ) -> int:
        """Check a request against the limits; returns how many tokens each row may generate."""
        self.check_rows(len(prompts), sampling)
        longest = max(len(prompt) for prompt in prompts)
        limit = self.max_request_tokens
        wanted = sampling.max_tokens if sampling.max_tokens is not None else 0
        if longest + wanted > limit or longest >= limit:
            asked = f"{longest + wanted} tokens ({longest} in the prompt"
            asked += f", {wanted} in the completion)" if wanted else ")"
            raise ApiError(
                400,
                f"This endpoint's maximum context length is {limit} tokens. However, you "
                f"requested {asked}. Please reduce the prompt or the completion length.",
                param=prompt_param if longest >= limit or not wanted else "max_tokens",
                code="context_length_exceeded",
            )
        return sampling.max_tokens if sampling.max_tokens is not None else limit - longest

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
        if self._waiting >= self.limits.max_queued_requests + self.limits.max_concurrent_requests:
            raise ApiError(
                429,
                "Too many requests are waiting; try again shortly.",
                code="too_many_requests",
            )
        return _Generation(self, prompts, sampling, max_new_tokens, prompt_logprobs)

    async def _run(self, job: _Job, send: trio.MemorySendChannel[Event]) -> None:
        error: Exception | None = None
        async with send:
            try:
                with job.waiting:  # cancelled when the HTTP side leaves before the job's turn
                    await self._slots.acquire()
                    job.started = True
                if job.waiting.cancelled_caught or job.cancelled:
                    if not job.waiting.cancelled_caught:
                        self._slots.release()
                    self.interrupted += 1
                    return
                try:
                    self.running += 1
                    self.peak_running = max(self.peak_running, self.running)
                    try:
                        try:
                            await job.run()
                        except Exception as exc:
                            error = exc
                    finally:
                        self.running -= 1
                        if error is not None:
                            self.failed += 1
                        elif job.interrupted:
                            self.interrupted += 1
                        else:
                            self.completed += 1
                finally:
                    self._slots.release()
                if error is not None:
                    with contextlib.suppress(trio.BrokenResourceError):
                        send.send_nowait(_api_error(error))
            finally:
                self._leave(job)

    def _leave(self, job: _Job) -> None:
        """``job`` no longer counts towards the queue's limit (once, whoever says so first)."""
        if not job.left:
            job.left = True
            self._waiting -= 1

    async def decode_job(self, job: _Job) -> None:
        """Generate ``job``'s rows in a session of its own, its decode steps lined up with
        those of the other running requests."""
        base = self._base
        rows = [list(prompt) for prompt in job.prompts for _ in range(job.sampling.n)]
        width = max(len(ids) for ids in rows)
        pads = [width - len(ids) for ids in rows]
        padding = torch.tensor(pads) if any(pads) else None
        if padding is not None and base.tuning_mode is not None:
            raise ApiError.bad_request(
                f"{self.name} has trainable prompts, so the prompts of one request must have "
                "the same number of tokens",
                param="prompt",
            )
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * count + ids for count, ids in zip(pads, rows, strict=True)])
        chooser = _Chooser(job.sampling)
        draft_tokens = self._prompt_lookup_num_tokens if self._speculative is not None else 0
        if draft_tokens:
            job.speculation = SpeculationCounts()
        length = width + job.max_new_tokens + base.pre_seq_len
        lineup = self._lineup()
        lineup.assigned += 1
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
                        if not await self._send_prompt_logprobs(job, output):
                            break
                        if job.max_new_tokens == 0:
                            job.finish_empty()
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
                        done = job.on_tokens(tokens, logprobs)
                        if done:
                            break
                    if done:
                        break
                    # A row that finished goes on with the pad token, as in generate().
                    following = [
                        pad if row.finish_reason is not None else int(token)
                        for row, token in zip(job.rows, tokens.tolist(), strict=True)
                    ]
                    step = torch.tensor(following).unsqueeze(1)
                    drafts = self._draft(job, draft_tokens) if draft_tokens else None
                    if drafts is not None:
                        step = torch.cat([step, drafts], dim=1)
                    with torch.no_grad():
                        hidden, _ = self._embed(step)
            finally:
                lineup.leave(job)
                lineup.assigned -= 1

    def _draft(self, job: _Job, count: int) -> torch.Tensor | None:
        """Draft tokens ``(rows, tokens)`` to send after each row's newest token, by prompt
        lookup in the row's prompt and answer: as many as the unfinished row with the fewest
        has, and fewer than any of them may still generate (finished rows get pad tokens), or
        None where that is none."""
        per_prompt = job.sampling.n
        found: dict[int, list[int]] = {}
        for index, row in enumerate(job.rows):
            if row.finish_reason is not None:
                continue
            count = min(count, row.limit - len(row.tokens) - 1)
            if count < 1:
                return None
            sequence = [*job.prompts[index // per_prompt], *row.tokens]
            found[index] = prompt_lookup(sequence, count, end_tokens=self.eos_token_ids)
            count = min(count, len(found[index]))
            if count < 1:
                return None
        drafts = torch.full((len(job.rows), count), self.pad_token_id, dtype=torch.long)
        for index, tokens in found.items():
            drafts[index] = torch.tensor(tokens[:count])
        return drafts

    async def _check_drafts(
        self,
        job: _Job,
        session: Any,
        lineup: _Lineup,
        chooser: _Chooser,
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
        checked = _Drafts(hidden=output[:, -count:], tokens=drafts, rows=open_rows)
        first = await lineup.choose(job, output[:, -count - 1], chooser, checked)
        kept = len(checked.chosen)
        if kept < count:
            session.position -= count - kept
        job.speculation.add(count, kept)
        self.speculation.add(count, kept)
        return [first, *checked.chosen]

    async def _send_prompt_logprobs(self, job: _Job, output: torch.Tensor) -> bool:
        """Each prompt's tokens with their log-probabilities, from the blocks' ``output`` over
        the prompts (its first row of each prompt; the prompt is its last positions).  False
        if the request was cancelled meanwhile (its rows are then ended)."""
        firsts = output[:: job.sampling.n]
        count = job.sampling.logprobs or 0
        per_prompt = await trio.to_thread.run_sync(
            self._prompt_logprobs, firsts, job.prompts, count, lambda: job.cancelled
        )
        if per_prompt is None or job.cancelled:
            for row in job.rows:
                row.finish_reason = "cancelled"
            return False
        for index, logprobs in enumerate(per_prompt):
            job.emit(PromptLogprobs(prompt=index, logprobs=logprobs))
        return True

    def _prompt_logprobs(
        self,
        outputs: torch.Tensor,
        prompts: Sequence[Sequence[int]],
        count: int,
        cancelled: Callable[[], bool],
    ) -> list[tuple[TokenLogprob, ...]] | None:
        """In a worker thread: the final norm and the LM head over every prompt position but
        the last, a few positions at a time; each token's log-probability is read off the
        position before it (the first token's is None).  None once ``cancelled()``."""
        piece = self.token_text
        per_prompt = []
        with torch.no_grad():
            for output, prompt in zip(outputs, prompts, strict=True):
                text = IncrementalText(self.decode)  # the echoed text, for the offsets
                offsets = []
                for token in prompt:
                    offsets.append(len(text.text))
                    text.add(token)
                states = output[output.shape[0] - len(prompt) : -1]
                tokens = [TokenLogprob(token=piece(prompt[0]), logprob=None)]
                for start in range(0, states.shape[0], _PROMPT_LOGITS_CHUNK):
                    if cancelled():
                        return None
                    chunk = states[start : start + _PROMPT_LOGITS_CHUNK]
                    logprobs = torch.log_softmax(
                        self._head(self._base.final_norm(chunk)).float(), dim=-1
                    ).cpu()
                    targets = prompt[start + 1 : start + 1 + chunk.shape[0]]
                    tokens += [
                        _scored(row, target, count, piece, offset=offsets[start + 1 + position])
                        for position, (row, target) in enumerate(
                            zip(logprobs, targets, strict=True)
                        )
                    ]
                per_prompt.append(tuple(tokens))
        return per_prompt

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

    def _choose(self, entries: list[_Entry]) -> None:
        """The final norm and the LM head over every entry's rows at once, then each request's
        choice of tokens (in a worker thread)."""
        with torch.no_grad():
            hidden = torch.cat([entry.hidden for entry in entries])
            logits = self._head(self._base.final_norm(hidden)).float()
            start = 0
            for entry in entries:
                rows = entry.hidden.shape[0]
                try:
                    entry.tokens, entry.logprobs = entry.chooser(logits[start : start + rows])
                    if entry.drafts is not None:
                        self._follow_drafts(entry.tokens, entry.drafts, entry.chooser)
                except Exception as exc:  # this request's own failure (say, NaN logits)
                    entry.error = exc
                start += rows

    def _follow_drafts(self, tokens: torch.Tensor, drafts: _Drafts, chooser: _Chooser) -> None:
        """Keep the leading draft tokens that equal the token chosen before each, and choose
        the token after each one kept (into ``drafts.chosen``).  The LM head runs over the draft
        tokens' positions only once the first draft token is kept, and then over all of them
        at once: a draft that is turned down at once costs no more of it than a plain step."""
        rows = drafts.rows
        if not bool((tokens[rows] == drafts.tokens[rows, 0]).all()):
            return
        count, width = drafts.tokens.shape[1], drafts.hidden.shape[-1]
        hidden = drafts.hidden.reshape(-1, width)
        chosen, logprobs = chooser(self._head(self._base.final_norm(hidden)).float())
        chosen = chosen.reshape(-1, count)
        if logprobs is not None:
            logprobs = logprobs.reshape(chosen.shape[0], count, -1)
        before = tokens
        for index in range(count):
            if not bool((before[rows] == drafts.tokens[rows, index]).all()):
                break
            before = chosen[:, index]
            drafts.chosen.append((before, None if logprobs is None else logprobs[:, index]))


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
        self._job: _Job | None = None
        self._receive: trio.MemoryReceiveChannel[Event] | None = None

    async def __aenter__(self) -> AsyncIterator[Event]:
        engine = self._engine
        send, receive = trio.open_memory_channel[Event](math.inf)
        prompts, sampling, limit = self._args
        job = _Job(engine, prompts, sampling, limit, send, prompt_logprobs=self._prompt_logprobs)
        engine._waiting += 1
        engine._nursery.start_soon(engine._run, job, send)
        self._job, self._receive = job, receive
        return _events(receive)

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._job is not None and self._receive is not None
        job = self._job
        job.cancelled = True
        job.waiting.cancel()  # a job still waiting for its turn leaves the queue now
        if not job.started:
            self._engine._leave(job)
        await self._receive.aclose()


async def _events(receive: trio.MemoryReceiveChannel[Event]) -> AsyncIterator[Event]:
    async for event in receive:
        yield event
        if isinstance(event, Usage | ApiError):
            return


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
    return ApiError(500, f"Generation failed: {type(exc).__name__}: {exc}")
