"""The text of an answer as its tokens arrive, decoded a few tokens at a time.

Decoding the whole answer again for each new token costs time in the answer's length: a
2,000-token answer spends about a millisecond per token in the tokenizer, under a lock every
request shares.  :class:`IncrementalText` decodes a window instead: the tokens since the last
complete character, together with the tokens of the window before (so that what a tokenizer does
at the start of a text, such as dropping a leading space, happens in both decodes and cancels
out); the new text is what the window adds to the text of its first part.  A window that ends in
an unfinished character (bytes of it still to come, shown as U+FFFD) grows until the character is
complete.  Where a tokenizer rewrites text before the window (the window's decode does not start
with its first part's), the whole answer is decoded again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

__all__ = ["UNFINISHED", "IncrementalText"]

#: What decoding shows for a character whose bytes are not all there yet.
UNFINISHED: Final = "\ufffd"


class IncrementalText:
    """The decoded text of :attr:`tokens`, kept up to date by :meth:`add`.

    ``decode`` turns token ids into text (as the answer's text is decoded as a whole)."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self._text = ""
        self._done = ""  # the text of tokens[: self._read], every character complete
        self._start = 0  # where the window starts: the tokens before the last complete character
        self._read = 0  # tokens decoded into self._done
        self._start_text = ""  # the text of tokens[self._start : self._read] decoded alone

    @property
    def text(self) -> str:
        """The text so far; it may end with an unfinished character (:data:`UNFINISHED`)."""
        return self._text

    def add(self, token: int) -> str:
        """Append ``token``; returns :attr:`text`."""
        self.tokens.append(token)
        window = self._decode(self.tokens[self._start :])
        if window.startswith(self._start_text):
            self._text = self._done + window[len(self._start_text) :]
        else:
            self._text = self._decode(self.tokens)
        if not self._text.endswith(UNFINISHED):
            # Every token so far is in the text: the next window starts after the last one.
            self._done = self._text
            self._start, self._read = self._read, len(self.tokens)
            self._start_text = self._decode(self.tokens[self._start : self._read])
        return self._text
