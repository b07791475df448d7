"""A request's state while it is generated, without I/O: fed each step's tokens, it says what to
send.

:class:`Job` holds what one request generates: its prompts, its rows (:class:`Row`; several
prompts, ``n`` each) and what of each row's text was handed on.  The engine (``_engine.py``)
runs the request's session; it feeds :meth:`Job.on_tokens` the newest token of each row (with
the model's log-probabilities when the request asked for them), which answers with the
:class:`~._records.Chunk` events to send, one per row that has something new, and whether every
row is done; the engine sends them over the request's channel, and ends the session when every
row is done.  For each row's new token, :meth:`Job.on_tokens`:

- decodes the row's text, holds back an unfinished character and what could be the start of a
  stop sequence, cuts the text at one, and stops the row there, at an end-of-sequence token, or
  at ``max_tokens``;
- where the tokenizer rewrote text already sent (say, ``clean_up_tokenization_spaces`` taking
  away a space that was sent once a ``.`` follows it), sends the text on from the first changed
  character (less what was sent there and is still there): what was sent cannot be taken back,
  so the client keeps the space, and no character of the new text is lost;
- scores the token (:func:`~._sampling.scored`) when the request asked for log-probabilities;
  they are sent with the chunk that carries the token's text (a token whose text is held back,
  or that has none, waits for the next chunk with text, or the row's last).

Rows of one request are one batch of its session, left-padded as ``generate()`` pads them
(:meth:`Job.inputs`); a row that finished is fed the pad token until the others finish
(:meth:`Job.following`).  With ``speculative="prompt_lookup"`` a decode step also sends draft
tokens after each row's newest one (:meth:`Job.draft`), and the tokens it keeps go to
:meth:`Job.on_tokens` one position at a time (see :mod:`._speculative`).

:attr:`Job.cancelled` is set when nobody waits for the rest (the HTTP side left, the endpoint
shuts down): every row still generating stops at its next token, "cancelled".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch

from ._detokenize import UNFINISHED, IncrementalText
from ._records import Chunk, TokenLogprob, Usage
from ._requests import Sampling
from ._sampling import scored
from ._speculative import SpeculationCounts, prompt_lookup

__all__ = ["Job", "Row", "stop_prefix_start"]


class Row:
    """One choice being generated: its tokens, its text, and what was sent of it."""

    def __init__(self, limit: int, decode: Callable[[Sequence[int]], str]) -> None:
        self.limit = limit
        self.text = IncrementalText(decode)
        self.tokens = self.text.tokens
        self.sent = 0  # characters of the text, as it reads now, that were sent
        #: Characters sent beyond :attr:`sent`: those sent again after the tokenizer rewrote them.
        self.resent = 0
        self.pending: list[TokenLogprob] = []
        self.finish_reason: str | None = None


class Job:
    """One request: what to generate, and what of it was generated and sent (see the module).

    ``decode`` gives the text of token ids, ``token_text`` one token's own text (for
    log-probabilities); a row ends at a token of ``eos_token_ids``, and ``pad_token_id`` pads
    the prompts and follows a row that finished."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        max_new_tokens: int,
        *,
        decode: Callable[[Sequence[int]], str],
        token_text: Callable[[int], str],
        eos_token_ids: Collection[int],
        pad_token_id: int,
        prompt_logprobs: bool = False,
    ) -> None:
        self.prompts = prompts
        self.sampling = sampling
        self.max_new_tokens = max_new_tokens
        self.prompt_logprobs = prompt_logprobs
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        #: Set when nobody waits for the rest (the HTTP side left, the endpoint shuts down).
        self.cancelled = False
        self._token_text = token_text
        self._logprobs: torch.Tensor | None = None
        #: Its speculative steps, when it decodes speculatively (set by the engine).
        self.speculation: SpeculationCounts | None = None
        self.rows = [Row(max_new_tokens, decode) for prompt in prompts for _ in range(sampling.n)]

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first step's token ids ``(rows, tokens)``: each row's prompt, left-padded with the
        pad token to the longest; and each row's count of pad tokens (None: no row has any)."""
        rows = [list(prompt) for prompt in self.prompts for _ in range(self.sampling.n)]
        width = max(len(ids) for ids in rows)
        pads = [width - len(ids) for ids in rows]
        padding = torch.tensor(pads) if any(pads) else None
        pad = self.pad_token_id
        ids = torch.tensor([[pad] * count + ids for count, ids in zip(pads, rows, strict=True)])
        return ids, padding

    def usage(self) -> Usage:
        """The request's last event: its tokens read and generated."""
        return Usage(
            prompt_tokens=sum(len(prompt) for prompt in self.prompts),
            completion_tokens=sum(len(row.tokens) for row in self.rows),
            speculation=self.speculation,
        )

    def finish_empty(self) -> list[Chunk]:
        """End every row with no token (``max_tokens`` 0)."""
        chunks = []
        for index, row in enumerate(self.rows):
            row.finish_reason = "length"
            chunks.append(Chunk(row=index, text="", finish_reason="length"))
        return chunks

    def end_cancelled(self) -> None:
        """End every row as cancelled (nobody waits for them)."""
        for row in self.rows:
            row.finish_reason = "cancelled"

    @property
    def interrupted(self) -> bool:
        """Whether some row was stopped by a cancellation rather than finishing."""
        return any(row.finish_reason == "cancelled" for row in self.rows)

    def on_tokens(
        self, new_tokens: torch.Tensor, logprobs: torch.Tensor | None = None
    ) -> tuple[list[Chunk], bool]:
        """Take the newest token of each row (``logprobs``: the model's, ``(rows, vocab)``,
        when the request asked for them); returns the chunks to send, in order, and whether
        every row is done."""
        self._logprobs = logprobs
        cancelled = self.cancelled
        chunks = []
        done = True
        for index, row in enumerate(self.rows):
            if row.finish_reason is not None:
                continue
            chunk = self._advance(index, row, int(new_tokens[index]))
            if cancelled and row.finish_reason is None:
                row.finish_reason = "cancelled"
            if chunk is not None:
                chunks.append(chunk)
            done = done and row.finish_reason is not None
        return chunks, done

    def _advance(self, index: int, row: Row, token: int) -> Chunk | None:
        offset = len(row.text.text) + row.resent  # where the token's text starts, as sent
        if token in self.eos_token_ids:
            row.finish_reason = "stop"
            text = row.text.text
            if self._logprobs is not None:  # a scorer reads the end's logprob too
                row.pending.append(self._token_logprob(index, token, offset, end=True))
        else:
            before = row.text.text
            text = row.text.add(token)
            unchanged = row.text.unchanged
            if unchanged < row.sent:
                # The tokenizer rewrote text already sent: the text goes on from its first
                # changed character, less what it still begins with of the text sent there (a
                # space taken away before "n't" leaves the "n" that was sent).
                kept = _overlap(before[unchanged : row.sent], text[unchanged:])
                row.resent += row.sent - unchanged - kept
                row.sent = unchanged + kept
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
            end = min(len(whole), stop_prefix_start(whole, stops, since=row.sent))
        new_text = text[row.sent : max(end, row.sent)]
        if not new_text and row.finish_reason is None:
            # Nothing to send: the tokens' log-probabilities wait for the chunk with their text.
            return None
        row.sent = max(end, row.sent)
        pending, row.pending = tuple(row.pending), []
        return Chunk(row=index, text=new_text, logprobs=pending, finish_reason=row.finish_reason)

    def _token_logprob(
        self, index: int, token: int, offset: int, *, end: bool = False
    ) -> TokenLogprob:
        assert self._logprobs is not None
        count = self.sampling.logprobs or 0
        return scored(self._logprobs[index], token, count, self._token_text, offset=offset, end=end)

    def following(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next step's token ids ``(rows, 1)`` after each row's newest token ``tokens``
        ``(rows,)``: a row that finished goes on with the pad token, as in ``generate()``."""
        following = [
            self.pad_token_id if row.finish_reason is not None else int(token)
            for row, token in zip(self.rows, tokens.tolist(), strict=True)
        ]
        return torch.tensor(following).unsqueeze(1)

    def draft(self, count: int) -> torch.Tensor | None:
        """Draft tokens ``(rows, tokens)`` to send after each row's newest token, by prompt
        lookup in the row's prompt and answer: as many as the unfinished row with the fewest
        has, and fewer than any of them may still generate (finished rows get pad tokens), or
        None where that is none; ``count`` at most."""
        per_prompt = self.sampling.n
        found: dict[int, list[int]] = {}
        for index, row in enumerate(self.rows):
            if row.finish_reason is not None:
                continue
            count = min(count, row.limit - len(row.tokens) - 1)
            if count < 1:
                return None
            sequence = [*self.prompts[index // per_prompt], *row.tokens]
            found[index] = prompt_lookup(sequence, count, end_tokens=self.eos_token_ids)
            count = min(count, len(found[index]))
            if count < 1:
                return None
        drafts = torch.full((len(self.rows), count), self.pad_token_id, dtype=torch.long)
        for index, tokens in found.items():
            drafts[index] = torch.tensor(tokens[:count])
        return drafts


def _overlap(sent: str, text: str) -> int:
    """The length of the longest end of ``sent`` that ``text`` begins with."""
    for size in range(min(len(sent), len(text)), 0, -1):
        if text.startswith(sent[-size:]):
            return size
    return 0


def stop_prefix_start(text: str, stops: Sequence[str], *, since: int = 0) -> int:
    """Where the longest end of ``text`` that begins some stop sequence starts (or its end);
    only ends after ``since`` count (what was sent cannot be held back)."""
    start = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text) - since), 0, -1):
            if text.endswith(stop[:size]):
                start = min(start, len(text) - size)
                break
    return start
