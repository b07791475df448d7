"""Speculative decoding at the endpoint: drafts found by prompt lookup, checked in one step.

With ``speculative="prompt_lookup"`` a request's decode step sends, after each row's newest
token, up to ``prompt_lookup_num_tokens`` draft tokens: what followed the row's last n-gram
(two tokens, else one) where it first occurs earlier in the row's prompt and answer, cut at an
end-of-sequence token, as transformers' ``PromptLookupCandidateGenerator`` proposes them.  The
servers compute every position of the step at once; the endpoint chooses a token at each of
them (greedy, or drawn from the request's generator after temperature and top-p), keeps the
leading draft tokens that equal the tokens chosen before them, and the chosen token after the
last one kept.  The servers' caches drop the positions of the rest (the session's position goes
back) with the next step.  The LM head runs over the draft tokens' positions only where the
first draft token is kept: a draft turned down at once costs the endpoint a plain step.

A draft token is kept only where the token chosen at its position, from the model's logits
given everything before it, is that token, so greedy answers are the tokens of plain greedy
decoding; a sampled row draws each position from the model's distribution and keeps a draft
token only if it is the one drawn, which is speculative sampling's rule for a draft that is one
fixed token (kept with the probability the model gives it), so sampled answers follow the
model's distribution too.  A seed gives the same answer again, though not the one the same seed
gives without speculation: the draws fall differently.

The rows of one request share a session, whose position goes back by one count for all: a step
keeps the draft tokens every unfinished row agrees with, and drafts as many tokens as the row
with the fewest has (a step of no draft is a plain one).  A step never drafts past ``max_tokens``
(what it could keep stays within the answer's length), and what it keeps goes through the same
checks as plain steps' tokens, one position at a time: stop sequences, the end token and
``max_tokens`` end a row where they would have.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Final

import attrs

__all__ = [
    "MAX_MATCHING_NGRAM",
    "PROMPT_LOOKUP_NUM_TOKENS",
    "SPECULATIVE_METHODS",
    "SpeculationCounts",
    "check_speculative",
    "prompt_lookup",
]

#: The ways of drafting the endpoint knows (``--speculative``).
SPECULATIVE_METHODS: Final = ("prompt_lookup",)
#: Draft tokens a step sends at most, by default (transformers' ``num_output_tokens``).
PROMPT_LOOKUP_NUM_TOKENS: Final = 10
#: The longest n-gram prompt lookup matches (transformers' ``max_matching_ngram_size``).
MAX_MATCHING_NGRAM: Final = 2


def check_speculative(method: str | None, num_tokens: int) -> None:
    """Refuse an unknown speculative method or a draft length below 1."""
    if method is not None and method not in SPECULATIVE_METHODS:
        known = ", ".join(SPECULATIVE_METHODS)
        raise ValueError(f"speculative must be None or one of: {known}; got {method!r}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"prompt_lookup_num_tokens must be an integer >= 1, got {num_tokens!r}")


@attrs.define(kw_only=True)
class SpeculationCounts:
    """Decode steps of speculating requests (the prompt's step not counted), draft tokens they
    sent and draft tokens kept, each counted once per step whatever the rows: a step gives every
    row its kept draft tokens plus one."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def to_json(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
        }


def prompt_lookup(
    tokens: Sequence[int],
    count: int,
    *,
    end_tokens: Collection[int] = (),
    max_ngram: int = MAX_MATCHING_NGRAM,
) -> list[int]:
    """Up to ``count`` tokens to draft after ``tokens``: for the longest n-gram (``max_ngram``
    down to 1) that ends ``tokens`` and occurs earlier in them, the tokens that followed its
    first occurrence, up to the first of ``end_tokens``; none if nothing matches."""
    length = len(tokens)
    if count < 1 or length < 2:
        return []
    sequence = list(tokens)
    for size in range(min(max_ngram, length - 1), 0, -1):
        tail = sequence[-size:]
        # An occurrence must have something after it: it starts before length - size.
        start = 0
        while True:
            try:
                start = sequence.index(tail[0], start, length - size)
            except ValueError:
                break
            if sequence[start : start + size] == tail:
                follow = sequence[start + size : start + size + count]
                for index, token in enumerate(follow):
                    if token in end_tokens:
                        return follow[:index]
                return follow
            start += 1
    return []
