"""The text of an answer as its tokens arrive, decoded a few tokens at a time.

Decoding the whole answer again for each new token costs time in the answer's length: a
2,000-token answer spends about a millisecond per token in the tokenizer, on the event loop
every request shares.  :class:`IncrementalText` decodes a window instead: the tokens since the last
complete character, together with the tokens of the window before (so that what a tokenizer does
at the start of a text, such as dropping a leading space, happens in both decodes and cancels
out); the new text is what the window adds to the text of its first part.  A window that ends in
an unfinished character (bytes of it still to come, shown as U+FFFD) grows until the character is
complete.  Where a tokenizer rewrites text before the window (the window's decode does not start
with its first part's), the whole answer is decoded again; :attr:`IncrementalText.unchanged` then
says where the text first differs from what it was, which may be text already sent (see
:mod:`._job`).

:class:`TokenTexts` gives one token's own text, as log-probabilities show it: its bytes read off
the vocabulary (GPT-2's byte alphabet, or SentencePiece's pieces), so that a leading space stays
and a token that is part of a character reads ``bytes:\\xNN...`` as in OpenAI's answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Final

from tokenizers import decoders

__all__ = ["UNFINISHED", "IncrementalText", "TokenTexts", "text_bytes"]

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
        self._known = 0  # characters at the start of self._text that are those of self._done
        #: Characters at the start of :attr:`text` that the last :meth:`add` left as they were.
        self.unchanged = 0

    @property
    def text(self) -> str:
        """The text so far; it may end with an unfinished character (:data:`UNFINISHED`)."""
        return self._text

    def add(self, token: int) -> str:
        """Append ``token``; returns :attr:`text`."""
        self.tokens.append(token)
        before, known = self._text, self._known
        window = self._decode(self.tokens[self._start :])
        if window.startswith(self._start_text):
            # The text goes on from the complete text: only what follows that may differ.
            self._text = self._done + window[len(self._start_text) :]
            self._known = len(self._done)
        else:
            self._text = self._decode(self.tokens)
            self._known = known = 0
        self.unchanged = _common_prefix(before, self._text, known)
        if not self._text.endswith(UNFINISHED):
            # Every token so far is in the text: the next window starts after the last one.
            self._done = self._text
            self._known = len(self._text)
            self._start, self._read = self._read, len(self.tokens)
            self._start_text = self._decode(self.tokens[self._start : self._read])
        return self._text


def _common_prefix(a: str, b: str, start: int) -> int:
    """How many characters ``a`` and ``b`` begin with alike, knowing the first ``start`` are."""
    if b.startswith(a[start:], start):
        return len(a)
    end = min(len(a), len(b))
    while start < end and a[start] == b[start]:
        start += 1
    return start


#: SentencePiece's space, and its pieces that stand for one byte.
_METASPACE: Final = "\u2581"
_BYTE_FALLBACK: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the byte each character stands for.  Bytes
    that print as one Latin-1 character (other than a space) stand for themselves; the others,
    in order, for the characters from U+0100 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    alphabet = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if byte not in printable]
    for offset, byte in enumerate(others):
        alphabet[chr(256 + offset)] = byte
    return alphabet


_BYTE_OF_CHAR: Final = _byte_alphabet()


class TokenTexts:
    """``texts(token)``: one token's own text (cached), for log-probabilities."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        vocab = [str(piece) for piece in tokenizer.get_vocab()]
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self._metaspace = not self._byte_level and any(_METASPACE in piece for piece in vocab)
        longest = max(
            (len(piece) if self._byte_level else len(piece.encode()) for piece in vocab),
            default=1,
        )
        self._longest = longest * (1 if getattr(backend, "normalizer", None) is None else 4)
        self._added = {
            int(i): str(getattr(added, "content", added))
            for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        self._texts: dict[int, str] = {}

    def longest(self) -> int:
        """How many characters of a text one token stands for, at most: its bytes (where the
        vocabulary writes one character per byte, its characters), times 4 where a normalizer
        rewrites the text first (it may merge characters)."""
        return self._longest

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            raw = self.token_bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            self._texts[token] = text
        return text

    def token_bytes(self, token: int) -> bytes:
        """The bytes of text ``token`` stands for."""
        added = self._added.get(token)
        if added is not None:  # a special token: its own text, which decoding leaves out
            return added.encode()
        piece = self._tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            if self._metaspace:
                return piece.replace(_METASPACE, " ").encode()
        return str(self._tokenizer.decode([token])).encode()


def text_bytes(text: str) -> bytes:
    """The bytes a token's text (from :class:`TokenTexts`) stands for."""
    if text.startswith("bytes:\\x"):
        return bytes.fromhex(text[len("bytes:") :].replace("\\x", ""))
    return text.encode()
