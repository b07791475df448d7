"""What the endpoint does with a model's tokenizer: prompts and chats to token ids (in worker
threads, by a copy of the tokenizer of their own), token ids to text, one token's own text for
log-probabilities, the special tokens that end and pad rows, and the checks of a request
against the limits.  :class:`~._engine.Engine` is a :class:`Tokenizing`."""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ._detokenize import TokenTexts
from ._errors import ApiError
from ._job import Job
from ._records import Limits
from ._requests import Message, Sampling

__all__ = ["Echo", "Tokenizing"]


@attrs.frozen
class Echo:
    """A completion prompt's text as its answer echoes it, and where each of its tokens starts in
    that text (None: where decoding the tokens one after another puts them)."""

    text: str
    starts: tuple[int, ...] | None = None


class Tokenizing:
    """``tokenizer`` for ``model`` (served as ``name``), within ``limits``."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str, limits: Limits) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.limits = limits
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
        self.context_length = int(
            getattr(model.config, "max_position_embeddings", None) or limits.max_request_tokens
        )

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
        self._check_length(text, param=param)
        with self._encoder_lock:
            ids = self._encoder.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in ids]

    def _check_length(self, text: str, *, param: str) -> None:
        if len(text) > self._longest_token * self.max_request_tokens:
            raise self._too_long(f"the prompt's {len(text)} characters are", param=param)

    def _too_long(self, what: str, *, param: str) -> ApiError:
        return ApiError(
            400,
            f"This endpoint's maximum context length is {self.max_request_tokens} tokens. "
            f"However, {what} more tokens than that. Please reduce the prompt.",
            param=param,
            code="context_length_exceeded",
        )

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """A completion prompt's token ids (token ids are checked against the vocabulary), in a
        worker thread."""
        if isinstance(prompt, str):
            return self._nonempty(self._encode(prompt, add_special_tokens=True, param="prompt"))
        vocab = int(self.model.config.vocab_size)
        bad = [i for i in prompt if not 0 <= i < vocab]
        if bad:
            raise ApiError.bad_request(
                f"prompt token ids must be from 0 to {vocab - 1}; got {bad[0]}", param="prompt"
            )
        return list(prompt)

    def _nonempty(self, ids: list[int]) -> list[int]:
        """A text prompt's token ids: the start token for an empty one, where there is one."""
        if not ids and self.tokenizer.bos_token_id is not None:
            ids = [int(self.tokenizer.bos_token_id)]
        if not ids:
            raise ApiError.bad_request("prompt is empty", param="prompt")
        return ids

    def encode_echoed(self, prompt: str | Sequence[int]) -> tuple[list[int], Echo]:
        """A completion prompt's token ids (as :meth:`encode_prompt`) and its :class:`Echo`: the
        prompt as it was sent, or for token ids their text; in a worker thread.  The starts of
        a text's tokens are where the tokenizer read them (decoding may not give the text back:
        special tokens, normalization, cleaned up spaces); a tokenizer that cannot say that
        echoes the tokens' text."""
        if not isinstance(prompt, str) or not getattr(self._encoder, "is_fast", False):
            ids = self.encode_prompt(prompt)
            return ids, Echo(self.decode(ids))
        self._check_length(prompt, param="prompt")
        with self._encoder_lock:
            encoding = self._encoder(prompt, return_offsets_mapping=True)
        ids = [int(i) for i in encoding["input_ids"]]
        if not ids:
            return self._nonempty(ids), Echo(prompt, (0,))
        return ids, Echo(prompt, token_starts(encoding["offset_mapping"]))

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The chat's token ids through the tokenizer's chat template, ready for the answer, in a
        worker thread (the template's text, tokenized with no special tokens added, as
        ``apply_chat_template`` does)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError.bad_request(
                f"{self.name}'s tokenizer has no chat template: use /v1/completions",
                param="messages",
            )
        # Each message is a token at least, and no token stands for more characters than the
        # longest: a chat surely too long is refused before its template is rendered.
        characters = sum(len(m.content) for m in messages)
        if len(messages) > self.max_request_tokens:
            raise self._too_long(f"the {len(messages)} messages are", param="messages")
        if characters > self._longest_token * self.max_request_tokens:
            raise self._too_long(f"the messages' {characters} characters are", param="messages")
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

    def job(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        max_new_tokens: int,
        *,
        prompt_logprobs: bool = False,
    ) -> Job:
        """A request's state (see :mod:`._job`), its text read by this tokenizer."""
        return Job(
            prompts,
            sampling,
            max_new_tokens,
            decode=self.decode,
            token_text=self.token_text,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            prompt_logprobs=prompt_logprobs,
        )


def token_starts(spans: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """Where each token starts in the text it was read from, given the span of the text each
    stands for (a tokenizer's offsets), so that the starts run along the text: a token that
    stands for none of it (a special token the tokenizer added) starts where the tokens before
    end, and so does one whose span leaves out text before it (a leading space trimmed)."""
    starts = []
    start = end = 0
    for first, last in spans:
        start = max(start, end if first >= last else min(first, end))
        starts.append(start)
        end = max(end, last)
    return tuple(starts)
