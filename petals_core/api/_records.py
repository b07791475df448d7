"""What the endpoint's generation takes and gives: its limits (:class:`Limits`), and the events
a request yields (:data:`Event`): each prompt's log-probabilities (:class:`PromptLogprobs`) when
they were asked, then :class:`Chunk` events, one per new token and row as it is generated, then
:class:`Usage` (or an :class:`~._errors.ApiError` when the generation failed)."""

from __future__ import annotations

from typing import Any

import attrs

from ._errors import ApiError
from ._speculative import SpeculationCounts

__all__ = ["Chunk", "Event", "Limits", "PromptLogprobs", "TokenLogprob", "Usage"]


@attrs.frozen(kw_only=True)
class Limits:
    """What one endpoint accepts: requests generating at once (more wait, for a turn or for the
    tokenizer, up to ``max_queued_requests``; beyond, 429), tokens of one row (prompt plus
    completion), and rows of one request (prompts times ``n``)."""

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
    """A token's text and log-probability, with the likeliest alternatives (``logprob`` None:
    a prompt's first token, which nothing predicts).  ``offset``: where the token's text
    starts in the text it belongs to (the answer's or the prompt's), in characters; ``end``:
    the end-of-sequence token that stopped an answer, which its text leaves out."""

    token: str
    logprob: float | None
    top: tuple[tuple[str, float], ...] = ()
    offset: int = 0
    end: bool = False


@attrs.frozen(kw_only=True)
class PromptLogprobs:
    """The tokens of prompt ``prompt`` (an index into the request's prompts) with their
    log-probabilities under the model: sent before any :class:`Chunk` when they were asked."""

    prompt: int
    logprobs: tuple[TokenLogprob, ...]


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
    """The request's last event: tokens read (each prompt once) and generated (all rows), and
    when it decoded speculatively, its steps and draft tokens (``usage.speculation``)."""

    prompt_tokens: int
    completion_tokens: int
    speculation: SpeculationCounts | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_json(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.speculation is not None:
            usage["speculation"] = self.speculation.to_json()
        return usage


Event = Chunk | PromptLogprobs | Usage | ApiError
