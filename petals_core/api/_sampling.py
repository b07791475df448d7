"""Choosing a request's tokens from the model's logits, and their log-probabilities.

Sampling draws from the request's own ``torch.Generator`` (seeded by ``seed``), after
temperature and top-p (transformers' warpers), so that concurrent requests do not share the
global generator and a seed gives the same text again. ``temperature`` 0 is plain greedy
decoding, the tokens of ``model.generate(do_sample=False)``. Log-probabilities are the model's
own (before temperature and top-p).

The final norm and the LM head are the caller's: each function here that needs logits takes
``logits``, which gives float32 logits ``(rows, vocab)`` for the blocks' output ``(rows,
hidden)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import torch

from ._detokenize import IncrementalText
from ._records import TokenLogprob
from ._requests import Sampling

__all__ = [
    "GREEDY_BELOW",
    "Chooser",
    "Drafts",
    "follow_drafts",
    "prompt_logprobs",
    "scored",
]

#: Temperatures below this decode greedily: dividing logits by less overflows float32, and the
#: distribution is its argmax to within float precision long before.
GREEDY_BELOW: Final = 1e-6
#: Prompt positions whose logits are computed at once (for a prompt's log-probabilities).
_PROMPT_LOGITS_CHUNK: Final = 64


def scored(
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


class Chooser:
    """A request's choice of tokens from the model's logits: greedy, or drawn from its own
    generator after temperature and top-p; with the log-probabilities when it asked for them."""

    def __init__(self, sampling: Sampling) -> None:
        self.logprobs = sampling.logprobs is not None
        # top_p 0 keeps only the likeliest token: greedy.
        self.greedy = sampling.temperature < GREEDY_BELOW or sampling.top_p == 0
        self._warpers: list[Any] = []
        if not self.greedy:
            # Imported here, not at the top: importing transformers loads trio (through its
            # HTTP client), and ._job, which scores tokens with this module, loads no event loop.
            from transformers import TemperatureLogitsWarper, TopPLogitsWarper

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
class Drafts:
    """The draft tokens of a speculative step, checked by the lineup's compute after the
    step's first position."""

    hidden: torch.Tensor  # (rows, tokens, hidden): the blocks' output at the draft tokens
    tokens: torch.Tensor  # (rows, tokens)
    rows: list[int]  # the unfinished rows: each must agree for a draft token to be kept
    #: The tokens (and log-probabilities) chosen after each draft token kept, in order.
    chosen: list[tuple[torch.Tensor, torch.Tensor | None]] = attrs.Factory(list)


def follow_drafts(
    tokens: torch.Tensor,
    drafts: Drafts,
    chooser: Chooser,
    logits: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Keep the leading draft tokens that equal the token chosen before each, and choose
    the token after each one kept (into ``drafts.chosen``).  The LM head runs over the draft
    tokens' positions only once the first draft token is kept, and then over all of them
    at once: a draft that is turned down at once costs no more of it than a plain step."""
    rows = drafts.rows
    if not bool((tokens[rows] == drafts.tokens[rows, 0]).all()):
        return
    count, width = drafts.tokens.shape[1], drafts.hidden.shape[-1]
    hidden = drafts.hidden.reshape(-1, width)
    chosen, logprobs = chooser(logits(hidden))
    chosen = chosen.reshape(-1, count)
    if logprobs is not None:
        logprobs = logprobs.reshape(chosen.shape[0], count, -1)
    before = tokens
    for index in range(count):
        if not bool((before[rows] == drafts.tokens[rows, index]).all()):
            break
        before = chosen[:, index]
        drafts.chosen.append((before, None if logprobs is None else logprobs[:, index]))


def prompt_logprobs(
    outputs: torch.Tensor,
    prompts: Sequence[Sequence[int]],
    count: int,
    cancelled: Callable[[], bool],
    *,
    logits: Callable[[torch.Tensor], torch.Tensor],
    decode: Callable[[Sequence[int]], str],
    piece: Callable[[int], str],
) -> list[tuple[TokenLogprob, ...]] | None:
    """Each prompt's tokens with their log-probabilities (in a worker thread): ``logits`` over
    every prompt position of the blocks' ``outputs`` (one row per prompt; the prompt is its last
    positions) but the last, a few positions at a time; each token's log-probability is read
    off the position before it (the first token's is None).  None once ``cancelled()``."""
    per_prompt = []
    with torch.no_grad():
        for output, prompt in zip(outputs, prompts, strict=True):
            text = IncrementalText(decode)  # the echoed text, for the offsets
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
                logprobs = torch.log_softmax(logits(chunk), dim=-1).cpu()
                targets = prompt[start + 1 : start + 1 + chunk.shape[0]]
                tokens += [
                    scored(row, target, count, piece, offset=offsets[start + 1 + position])
                    for position, (row, target) in enumerate(zip(logprobs, targets, strict=True))
                ]
            per_prompt.append(tuple(tokens))
    return per_prompt
