"""A request's state on its own, fed tokens as the engine feeds them (no server, no event loop):
the chunks it gives for stop sequences, ``max_tokens``, the end token, rows that finish at
different times, log-probabilities and cancellation; and its module loads no event loop."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from petals_core.api import Chunk, Sampling
from petals_core.api._detokenize import TokenTexts, text_bytes
from petals_core.api._job import Job, stop_prefix_start

from .test_detokenize import TOKENIZERS

#: LLaMA-2's kind of tokenizer: a character a token, ``</s>`` the end token.
TOKENIZER = TOKENIZERS["sentencepiece"]
END = int(TOKENIZER.eos_token_id)
PAD = 0
TOKEN_TEXT = TokenTexts(TOKENIZER)


def _decode(ids: Sequence[int]) -> str:
    return str(TOKENIZER.decode(list(ids), skip_special_tokens=True))


def _ids(text: str) -> list[int]:
    return [int(i) for i in TOKENIZER.encode(text, add_special_tokens=False)]


def _job(sampling: Sampling, prompts: Sequence[Sequence[int]] = ((1,),)) -> Job:
    assert sampling.max_tokens is not None
    return Job(
        [list(prompt) for prompt in prompts],
        sampling,
        sampling.max_tokens,
        decode=_decode,
        token_text=TOKEN_TEXT,
        eos_token_ids=frozenset({END}),
        pad_token_id=PAD,
    )


def _feed(
    job: Job, tokens: Sequence[int], logprobs: torch.Tensor | None = None
) -> tuple[list[Chunk], int]:
    """One row's ``tokens`` one step at a time until it is done (``logprobs``: the model's at
    every step): the chunks, and the tokens taken."""
    chunks: list[Chunk] = []
    for taken, token in enumerate(tokens, 1):
        emitted, done = job.on_tokens(torch.tensor([token]), logprobs)
        chunks += emitted
        if done:
            return chunks, taken
    return chunks, len(tokens)


def test_what_may_start_a_stop_sequence_is_held_back() -> None:
    assert stop_prefix_start("Hello wor", ["world"]) == 6
    assert stop_prefix_start("Hello", ["world"]) == 5
    assert stop_prefix_start("abc", []) == 3
    assert stop_prefix_start("x<|e", ["<|end|>", "e"]) == 1
    # What was sent is not held back, nor looked through again.
    assert stop_prefix_start("Hello wor", ["world"], since=7) == 9
    assert stop_prefix_start("Hello wor", ["world"], since=9) == 9
    assert stop_prefix_start("Hello wor", ["world"], since=6) == 6


def test_a_stop_sequence_over_several_tokens_is_cut_and_never_sent_in_part() -> None:
    job = _job(Sampling(max_tokens=64, stop=("gon fl",)))
    tokens = _ids("the dragon flew far")
    chunks, taken = _feed(job, tokens)
    assert "".join(chunk.text for chunk in chunks) == "the dra"
    assert all("g" not in chunk.text for chunk in chunks)
    assert [chunk.finish_reason for chunk in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert taken == len(_ids("the dragon fl"))  # it stops at the token that completes it
    assert job.usage().completion_tokens == taken


def test_text_held_back_for_a_stop_sequence_goes_out_once_it_cannot_be_one() -> None:
    job = _job(Sampling(max_tokens=64, stop=("dragons",)))
    texts: list[str] = []
    for token in [*_ids("the dragon flew"), END]:
        chunks, done = job.on_tokens(torch.tensor([token]))
        texts.append("".join(chunk.text for chunk in chunks))
    assert done
    assert "".join(texts) == "the dragon flew"
    # "dragon" may begin "dragons": it waits for the space after it, and goes out with it.
    released = texts.index("dragon ")
    assert texts[released - len("dragon") : released] == [""] * len("dragon")
    assert "".join(texts[: released - len("dragon")]) == "the "


def test_max_tokens_ends_the_row_at_its_last_token() -> None:
    job = _job(Sampling(max_tokens=3))
    chunks, taken = _feed(job, _ids("abcdef"))
    assert taken == 3
    assert chunks[-1].finish_reason == "length"
    assert "".join(chunk.text for chunk in chunks) == _decode(_ids("abcdef")[:3])
    assert job.usage().completion_tokens == 3
    assert not job.interrupted


def test_the_end_token_stops_the_row_and_is_no_text() -> None:
    job = _job(Sampling(max_tokens=64))
    chunks, taken = _feed(job, [*_ids("hi"), END, *_ids("more")])
    assert taken == len(_ids("hi")) + 1
    assert "".join(chunk.text for chunk in chunks) == "hi"
    assert chunks[-1] == Chunk(row=0, text="", finish_reason="stop")
    assert job.rows[0].tokens == _ids("hi")
    usage = job.usage()
    assert (usage.prompt_tokens, usage.completion_tokens) == (1, len(_ids("hi")))


def test_rows_finish_at_different_times_and_a_finished_row_is_fed_pad_tokens() -> None:
    # Two prompts, two choices each: rows 0 and 1 are the first prompt's.
    job = _job(Sampling(max_tokens=3, stop=("x",), n=2), prompts=[[5], [6, 7]])
    ids, padding = job.inputs()
    assert ids.tolist() == [[PAD, 5], [PAD, 5], [6, 7], [6, 7]]
    assert padding is not None and padding.tolist() == [1, 1, 0, 0]
    a, b, x = _ids("a")[-1], _ids("b")[-1], _ids("x")[-1]
    steps = [[END, a, a, b], [a, x, b, a], [b, b, a, b]]  # row 0 ends, then row 1, then all
    finished: list[dict[int, str | None]] = []
    dones = []
    for step in steps:
        chunks, done = job.on_tokens(torch.tensor(step))
        finished.append({chunk.row: chunk.finish_reason for chunk in chunks})
        dones.append(done)
        if not done:
            following = job.following(torch.tensor(step))
            ended = [row.finish_reason is not None for row in job.rows]
            assert following.tolist() == [
                [PAD] if end else [token] for end, token in zip(ended, step, strict=True)
            ]
    assert finished == [
        {0: "stop", 1: None, 2: None, 3: None},
        {1: "stop", 2: None, 3: None},  # a finished row's tokens are not taken
        {2: "length", 3: "length"},
    ]
    assert dones == [False, False, True]
    assert [len(row.tokens) for row in job.rows] == [0, 2, 3, 3]  # the stop's own tokens count
    usage = job.usage()
    assert (usage.prompt_tokens, usage.completion_tokens) == (3, 8)


def _scored_chunks(job: Job, tokens: Sequence[int]) -> tuple[list[Chunk], torch.Tensor]:
    """The chunks of one row fed ``tokens`` with random log-probabilities, and those."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(tokens), len(TOKENIZER), generator=generator)
    logprobs = torch.log_softmax(logits, dim=-1)
    chunks: list[Chunk] = []
    for position, token in enumerate(tokens):
        emitted, done = job.on_tokens(torch.tensor([token]), logprobs[position : position + 1])
        chunks += emitted
    assert done
    return chunks, logprobs


def test_log_probabilities_go_with_the_chunk_of_their_token() -> None:
    job = _job(Sampling(max_tokens=64, logprobs=2, stop=("ag",)))
    tokens = [*_ids("drab"), END]
    chunks, logprobs = _scored_chunks(job, tokens)
    # The leading "▁" has no text of its own, and "a" may begin "ag": each waits for the next
    # chunk with text.
    assert [chunk.text for chunk in chunks] == ["d", "r", "ab", ""]
    assert [[entry.token for entry in chunk.logprobs] for chunk in chunks] == [
        [" ", "d"],
        ["r"],
        ["a", "b"],
        ["</s>"],
    ]
    scored = [entry for chunk in chunks for entry in chunk.logprobs]
    assert [entry.token for entry in scored] == [TOKEN_TEXT(token) for token in tokens]
    for position, (entry, token) in enumerate(zip(scored, tokens, strict=True)):
        assert entry.logprob == float(logprobs[position, token])
        values, ids = torch.topk(logprobs[position], 2)
        assert entry.top == tuple(
            (TOKEN_TEXT(int(i)), float(v)) for v, i in zip(values, ids, strict=True)
        )
    # Offsets into the answer's text; the end token adds no text, and is marked.
    assert [entry.offset for entry in scored[1:]] == [0, 1, 2, 3, 4]
    assert [entry.end for entry in scored] == [False] * (len(tokens) - 1) + [True]
    assert chunks[-1].finish_reason == "stop"


def test_the_tokens_of_a_character_go_with_the_chunk_that_completes_it() -> None:
    """A character over several tokens (its UTF-8 bytes) is sent once complete, with all of
    its tokens' log-probabilities; no chunk carries log-probabilities without text."""
    job = _job(Sampling(max_tokens=64, logprobs=0))
    tokens = [*_ids("a日b"), END]
    chunks, _ = _scored_chunks(job, tokens)
    assert [chunk.text for chunk in chunks] == ["a", "日", "b", ""]
    assert [len(chunk.logprobs) for chunk in chunks] == [2, 3, 1, 1]
    for chunk in chunks[:-1]:
        assert b"".join(text_bytes(entry.token) for entry in chunk.logprobs).strip() == (
            chunk.text.encode()
        )


def test_a_cancelled_job_ends_its_rows_at_their_next_token() -> None:
    job = _job(Sampling(max_tokens=64, n=2))
    chunks, done = job.on_tokens(torch.tensor(_ids("a")[-1:] * 2))
    assert not done and [chunk.text for chunk in chunks] == ["a", "a"]
    job.cancelled = True
    chunks, done = job.on_tokens(torch.tensor(_ids("b")[-1:] * 2))
    assert done and job.interrupted
    assert [row.finish_reason for row in job.rows] == ["cancelled", "cancelled"]
    assert [chunk.text for chunk in chunks] == ["b", "b"]


def test_max_tokens_0_ends_every_row_with_no_token() -> None:
    job = _job(Sampling(max_tokens=0, n=2))
    assert job.finish_empty() == [
        Chunk(row=0, text="", finish_reason="length"),
        Chunk(row=1, text="", finish_reason="length"),
    ]
    assert job.usage().completion_tokens == 0
    assert not job.interrupted


def test_drafts_follow_each_row_and_stay_within_max_tokens() -> None:
    job = _job(Sampling(max_tokens=6, n=2), prompts=[[10, 11, 12, 13, 10]])
    job.on_tokens(torch.tensor([11, 11]))
    # The last two tokens, 10 11, came before 12 13 10 11 in the prompt and answer.
    drafts = job.draft(3)
    assert drafts is not None and drafts.tolist() == [[12, 13, 10], [12, 13, 10]]
    job.on_tokens(torch.tensor([END, 12]))  # row 0 ends: pad tokens follow it
    drafts = job.draft(10)
    # Row 1 has 2 of its 6 tokens: a step may keep its drafts and one token more.
    assert drafts is not None and drafts.tolist() == [[PAD] * 3, [13, 10, 11]]


def _cleaning_up() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose decoding cleans up spaces, as transformers does for
    WordPiece-like ones (``clean_up_tokenization_spaces``): " ." reads ".", " n't" reads "n't",
    so a space already decoded goes away once what follows it comes."""
    words = ["[UNK]", "</s>", "x", "y", "▁", ".", ",", "n", "'t", "'", "'s"]
    model = models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="[UNK]")
    tokenizer = Tokenizer(model)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        eos_token="</s>",
        clean_up_tokenization_spaces=True,
    )


CLEANING_UP = _cleaning_up()


def _cleaning_up_job() -> Job:
    return Job(
        [[2]],
        Sampling(max_tokens=64, logprobs=0),
        64,
        decode=lambda ids: str(CLEANING_UP.decode(list(ids), skip_special_tokens=True)),
        token_text=TokenTexts(CLEANING_UP),
        eos_token_ids=frozenset({1}),
        pad_token_id=0,
    )


def _stream(job: Job, tokens: Sequence[int]) -> tuple[str, list[int]]:
    """What the client gets of one row fed ``tokens``: its text, and its tokens' offsets."""
    logprobs = torch.log_softmax(torch.zeros(1, len(CLEANING_UP)), dim=-1)
    chunks, _ = _feed(job, tokens, logprobs)
    return "".join(chunk.text for chunk in chunks), [t.offset for c in chunks for t in c.logprobs]


def test_text_the_tokenizer_rewrites_after_it_was_sent_is_not_lost() -> None:
    """The text "x " is sent, then "." comes and the text reads "x.": the "." is sent (the
    space stays with the client, who has it already); " n" is sent, then "'t" makes it "n't":
    only the "'t" is new."""
    words = ["x", "▁", ".", "▁", "y", "▁", "n", "'t", "</s>"]
    ids = [CLEANING_UP.convert_tokens_to_ids(word) for word in words]
    assert CLEANING_UP.decode(ids, skip_special_tokens=True) == "x. yn't"
    text, offsets = _stream(_cleaning_up_job(), ids)
    assert text == "x . y n't"
    # Each token's offset is where its text starts in the text sent; the end token's, the end.
    assert offsets == [0, 1, 2, 3, 4, 5, 6, 7, len(text)]


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(2, len(CLEANING_UP) - 1), max_size=16))
def test_the_text_sent_holds_every_character_of_the_answer(ids: list[int]) -> None:
    """Whatever the tokenizer takes back, the answer's text as it finally reads is in what was
    sent, in order, and the tokens' offsets run along the text sent."""
    text, offsets = _stream(_cleaning_up_job(), [*ids, 1])
    answer = iter(text)
    assert all(character in answer for character in CLEANING_UP.decode(ids))
    assert offsets == sorted(offsets) and all(0 <= offset <= len(text) for offset in offsets)
