"""Generation behind the endpoint: each request is one ``generate()`` call of the distributed
model, in one inference session of its own, run in a worker thread of the endpoint's trio program.

The model's network part runs on that program's loop, so the sync ``generate()`` steps through
it from the worker (``petals_core.client``'s bridge); concurrent requests are concurrent
sessions, which the servers batch. What ``generate()`` produces reaches the HTTP side as
:class:`Chunk` events through a trio channel, one per new token and row, as it is generated:

- a :class:`transformers.StoppingCriteria` sees every new token of every row. It decodes the
  row's text, holds back what could be the start of a stop sequence, cuts the text at one, and
  stops the row there, at an end-of-sequence token, or at ``max_tokens``;
- sampling draws from the request's own ``torch.Generator`` (seeded by ``seed``), so that
  concurrent requests do not share the global generator and a seed gives the same text again.
  It runs as the last logits processor, after temperature and top-p, and leaves only the drawn
  token possible, so ``generate()`` runs its greedy loop. ``temperature`` 0 is plain greedy
  decoding, as ``model.generate(do_sample=False)``;
- log-probabilities are the model's own (before temperature and top-p), taken by the first
  logits processor.

When the HTTP side goes away (the client disconnected) or the endpoint shuts down, the request
is cancelled: the stopping criterion stops every row at the next token, ``generate()`` returns
and its session closes, which frees the servers' caches.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Final

import attrs
import torch
import trio
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from .. import PetalsError
from ..routing import MissingBlocksError
from ._detokenize import UNFINISHED, IncrementalText
from ._errors import ApiError
from ._requests import Message, Sampling

__all__ = ["GREEDY_BELOW", "Chunk", "Engine", "Limits", "TokenLogprob", "Usage"]

#: Temperatures below this decode greedily: dividing logits by less overflows float32, and the
#: distribution is its argmax to within float precision long before.
GREEDY_BELOW: Final = 1e-6

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class Limits:
    """What one endpoint accepts: requests generating at once (more wait, up to
    ``max_queued_requests``; beyond, 429), tokens of one row (prompt plus completion), and rows
    of one request (prompts times ``n``)."""

    max_concurrent_requests: int = 8
    max_queued_requests: int = 64
    max_request_tokens: int = 2048
    max_rows: int = 16

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(Limits):
            value = getattr(self, field.name)
            low = 0 if field.name == "max_queued_requests" else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{field.name} must be an integer >= {low}, got {value!r}")


@attrs.frozen(kw_only=True)
class TokenLogprob:
    """A generated token's text and log-probability, with the likeliest alternatives."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@attrs.frozen(kw_only=True)
class Chunk:
    """New text of choice ``row`` (possibly empty), the tokens it came from when logprobs were
    asked, and ``finish_reason`` ("stop", "length") on the row's last chunk."""

    row: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None


@attrs.frozen(kw_only=True)
class Usage:
    """The request's last event: tokens read (each prompt once) and generated (all rows)."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }


Event = Chunk | Usage | ApiError


class _Row:
    """One choice being generated: its tokens, its text, and what was sent of it."""

    def __init__(
        self, prompt_length: int, limit: int, decode: Callable[[Sequence[int]], str]
    ) -> None:
        self.prompt_length = prompt_length
        self.limit = limit
        self.text = IncrementalText(decode)
        self.tokens = self.text.tokens
        self.sent = 0  # characters of the text sent so far
        self.pending: list[TokenLogprob] = []
        self.finish_reason: str | None = None


class _Job:
    """One request: what to generate, and the thread-side hooks into ``generate()``."""

    def __init__(
        self,
        engine: Engine,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        max_new_tokens: int,
        send: trio.MemorySendChannel[Event],
    ) -> None:
        self.engine = engine
        self.prompts = prompts
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.cancelled = threading.Event()
        #: Where the job waits for its turn (see :meth:`Engine._run`), whether it got one, and
        #: whether it stopped counting towards the queue's limit.
        self.waiting = trio.CancelScope()
        self.started = False
        self.left = False
        self._send = send
        self._token = trio.lowlevel.current_trio_token()
        self._logprobs: torch.Tensor | None = None
        self.rows = [
            _Row(len(prompt), max_new_tokens, engine.decode)
            for prompt in prompts
            for _ in range(sampling.n)
        ]

    # -- thread side -----------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        """Hand ``event`` to the HTTP side without waiting for it (the next step goes on)."""
        try:
            self._token.run_sync_soon(self._deliver, event)
        except trio.RunFinishedError:
            self.cancelled.set()

    def emit_last(self, event: Event) -> None:
        """Hand over the last event and wait until it (and so every one before it: the loop
        runs them in order) is in the channel, before the job ends and closes it."""
        try:
            trio.from_thread.run_sync(self._deliver, event, trio_token=self._token)
        except trio.RunFinishedError:
            self.cancelled.set()

    def _deliver(self, event: Event) -> None:
        try:
            self._send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.cancelled.set()  # nobody listens any more

    def run(self) -> None:
        engine = self.engine
        rows = [list(prompt) for prompt in self.prompts for _ in range(self.sampling.n)]
        if self.max_new_tokens == 0:
            for index, row in enumerate(self.rows):
                row.finish_reason = "length"
                self.emit(Chunk(row=index, text="", finish_reason="length"))
        else:
            width = max(len(ids) for ids in rows)
            pad = engine.pad_token_id
            device = engine.model.device  # where its embeddings and LM head are
            input_ids = torch.tensor(
                [[pad] * (width - len(ids)) + ids for ids in rows], device=device
            )
            mask = torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=device
            )
            engine.run_generate(self, input_ids, mask)
        self.emit_last(
            Usage(
                prompt_tokens=sum(len(prompt) for prompt in self.prompts),
                completion_tokens=sum(len(row.tokens) for row in self.rows),
            )
        )

    @property
    def interrupted(self) -> bool:
        """Whether some row was stopped by a cancellation rather than finishing."""
        return any(row.finish_reason == "cancelled" for row in self.rows)

    def record_logprobs(self, scores: torch.Tensor) -> None:
        if self.sampling.logprobs is not None:
            self._logprobs = torch.log_softmax(scores.float(), dim=-1)

    def on_tokens(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """Take the newest token of each row; returns which rows are done."""
        done = torch.ones(len(self.rows), dtype=torch.bool)
        cancelled = self.cancelled.is_set()
        for index, row in enumerate(self.rows):
            if row.finish_reason is not None:
                continue
            token = int(new_tokens[index])
            chunk = self._advance(index, row, token)
            if cancelled and row.finish_reason is None:
                row.finish_reason = "cancelled"
            if chunk is not None:
                self.emit(chunk)
            done[index] = row.finish_reason is not None
        return done

    def _advance(self, index: int, row: _Row, token: int) -> Chunk | None:
        engine = self.engine
        if token in engine.eos_token_ids:
            row.finish_reason = "stop"
            text = row.text.text
        else:
            text = row.text.add(token)
            if self._logprobs is not None:
                row.pending.append(self._token_logprob(index, token))
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

    def _token_logprob(self, index: int, token: int) -> TokenLogprob:
        assert self._logprobs is not None
        logprobs = self._logprobs[index]
        decode = self.engine.decode
        top: tuple[tuple[str, float], ...] = ()
        count = self.sampling.logprobs or 0
        if count:
            values, ids = torch.topk(logprobs, count)
            top = tuple((decode([int(i)]), float(v)) for v, i in zip(values, ids, strict=True))
        return TokenLogprob(token=decode([token]), logprob=float(logprobs[token]), top=top)


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

    Use :meth:`generate`, an async context manager yielding the request's events."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        name: str,
        limits: Limits,
        nursery: trio.Nursery,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.limits = limits
        self._nursery = nursery
        self._slots = trio.Semaphore(limits.max_concurrent_requests)
        self._threads = trio.CapacityLimiter(limits.max_concurrent_requests)
        self._waiting = 0
        # Requests are tokenized on the event loop and decoded in workers, one at a time.
        self._tokenizer_lock = threading.Lock()
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
        head = model.get_output_embeddings()
        if hasattr(head, "share_across_threads"):
            # Concurrent requests' decode steps read the LM head's weight once between them.
            head.share_across_threads()
        self.context_length = int(
            getattr(model.config, "max_position_embeddings", None) or limits.max_request_tokens
        )

    @property
    def max_request_tokens(self) -> int:
        return min(self.limits.max_request_tokens, self.context_length)

    def decode(self, tokens: Sequence[int]) -> str:
        with self._tokenizer_lock:
            return str(self.tokenizer.decode(list(tokens), skip_special_tokens=True))

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion prompt's token ids (token ids are checked against the vocabulary)."""
        if isinstance(prompt, str):
            with self._tokenizer_lock:
                ids = [int(i) for i in self.tokenizer.encode(prompt)]
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
        """The chat's token ids through the tokenizer's chat template, ready for the answer."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError.bad_request(
                f"{self.name}'s tokenizer has no chat template: use /v1/completions",
                param="messages",
            )
        chat = [{"role": m.role, "content": m.content} for m in messages]
        try:
            with self._tokenizer_lock:
                encoded = self.tokenizer.apply_chat_template(
                    chat, add_generation_prompt=True, tokenize=True
                )
        except Exception as exc:  # the template's own checks (jinja2 raise_exception)
            raise ApiError.bad_request(
                f"the chat template refused these messages: {exc}", param="messages"
            ) from None
        if isinstance(encoded, Mapping):
            encoded = encoded["input_ids"]
        return [int(i) for i in encoded]

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
                param="max_tokens" if wanted else prompt_param,
                code="context_length_exceeded",
            )
        return sampling.max_tokens if sampling.max_tokens is not None else limit - longest

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, prompt_param: str = "prompt"
    ) -> _Generation:
        """``async with engine.generate(prompts, sampling) as events: async for event in
        events`` (:class:`Chunk` ..., then :class:`Usage`, or an :class:`ApiError`).

        Raises :class:`ApiError` at once for a request over the limits, or 429 when too many
        wait. Leaving the block early cancels the generation."""
        max_new_tokens = self.plan(prompts, sampling, prompt_param=prompt_param)
        if self._waiting >= self.limits.max_queued_requests + self.limits.max_concurrent_requests:
            raise ApiError(
                429,
                "Too many requests are waiting; try again shortly.",
                code="too_many_requests",
            )
        return _Generation(self, prompts, sampling, max_new_tokens)

    async def _run(self, job: _Job, send: trio.MemorySendChannel[Event]) -> None:
        error: Exception | None = None
        async with send:
            try:
                with job.waiting:  # cancelled when the HTTP side leaves before the job's turn
                    await self._slots.acquire()
                    job.started = True
                if job.waiting.cancelled_caught or job.cancelled.is_set():
                    if not job.waiting.cancelled_caught:
                        self._slots.release()
                    self.interrupted += 1
                    return
                try:
                    self.running += 1
                    self.peak_running = max(self.peak_running, self.running)
                    try:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(_cancel_on_cancel, job)
                            try:
                                await trio.to_thread.run_sync(job.run, limiter=self._threads)
                            except Exception as exc:
                                error = exc
                            nursery.cancel_scope.cancel()
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

    def run_generate(self, job: _Job, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        """``generate()`` for ``job`` (in its worker thread)."""
        sampling = job.sampling
        processors: list[Any] = [_Recorder(job)]
        if sampling.temperature >= GREEDY_BELOW:
            if sampling.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_p < 1.0:
                processors.append(TopPLogitsWarper(sampling.top_p))
            processors.append(_Sampler(sampling.seed))
        with torch.no_grad():
            self.model.generate(
                input_ids,
                attention_mask=mask,
                max_new_tokens=job.max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(self.eos_token_ids) or None,
                pad_token_id=self.pad_token_id,
                logits_processor=LogitsProcessorList(processors),
                stopping_criteria=StoppingCriteriaList([_Criterion(job)]),
            )


class _Generation:
    """The async context manager :meth:`Engine.generate` returns."""

    def __init__(
        self, engine: Engine, prompts: Sequence[Sequence[int]], sampling: Sampling, limit: int
    ) -> None:
        self._engine = engine
        self._args = (prompts, sampling, limit)
        self._job: _Job | None = None
        self._receive: trio.MemoryReceiveChannel[Event] | None = None

    async def __aenter__(self) -> AsyncIterator[Event]:
        engine = self._engine
        send, receive = trio.open_memory_channel[Event](math.inf)
        prompts, sampling, limit = self._args
        job = _Job(engine, prompts, sampling, limit, send)
        engine._waiting += 1
        engine._nursery.start_soon(engine._run, job, send)
        self._job, self._receive = job, receive
        return _events(receive)

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._job is not None and self._receive is not None
        job = self._job
        job.cancelled.set()
        job.waiting.cancel()  # a job still waiting for its turn leaves the queue now
        if not job.started:
            self._engine._leave(job)
        await self._receive.aclose()


async def _events(receive: trio.MemoryReceiveChannel[Event]) -> AsyncIterator[Event]:
    async for event in receive:
        yield event
        if isinstance(event, Usage | ApiError):
            return


async def _cancel_on_cancel(job: _Job) -> None:
    try:
        await trio.sleep_forever()
    finally:
        job.cancelled.set()


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


class _Recorder(LogitsProcessor):
    """First logits processor: the model's log-probabilities, before anything changes them."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._job.record_logprobs(scores)
        return scores


class _Sampler(LogitsProcessor):
    """Last logits processor: draws each row's token from the request's own generator and
    leaves only that token possible, so greedy decoding takes it."""

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._generator: torch.Generator | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float(), dim=-1)
        if self._generator is None:  # on the device of the logits
            self._generator = torch.Generator(device=scores.device)
            if self._seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self._seed % 2**63)
        drawn = torch.multinomial(probs, 1, generator=self._generator)
        only = torch.full_like(scores, -math.inf)
        return only.scatter_(1, drawn, 0.0)


class _Criterion(StoppingCriteria):
    """The stopping criterion: each row's new token goes to the job, which says what is done."""

    def __init__(self, job: _Job) -> None:
        self._job = job

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        return self._job.on_tokens(input_ids[:, -1]).to(input_ids.device)
