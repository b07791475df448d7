"""``--speculative prompt_lookup``: a second endpoint in front of the same SmolLM2 swarm drafts
tokens by prompt lookup, and its greedy answers equal the plain endpoint's, token for token."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from petals_core.api import ApiConfig
from petals_core.api._speculative import MAX_MATCHING_NGRAM, prompt_lookup

#: The model goes on with the pattern: nearly every draft is kept.
REPEATING = "red, green, blue, red, green, blue, red, green, blue, red,"
#: A story: drafts are found (words recur) and mostly rejected.
STORY = "Once upon a time"
REPEAT_CHAT = [
    {
        "role": "user",
        "content": "Repeat the following list exactly: apples, oranges, pears, plums, grapes, "
        "cherries, lemons, limes, peaches, melons.",
    }
]
QUESTION_CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def fast(endpoint: Any) -> Any:
    """The endpoint of ``--speculative prompt_lookup`` (drafts of up to 10 tokens)."""
    return endpoint.open_api(speculative="prompt_lookup")


@pytest.fixture(scope="module")
def fast_client(fast: Any) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{fast.urls[0]}/v1", api_key="unused", timeout=120, max_retries=0)


def _speculation(usage: Any) -> dict[str, int]:
    extra = usage.model_extra or {}
    assert "speculation" in extra, "a speculative endpoint's usage counts its drafts"
    return dict(extra["speculation"])


def _complete(
    client: Any, stream: bool, **request: Any
) -> tuple[list[str], list[tuple[str, str]], Any]:
    """A completion's token texts (with ``logprobs``), each choice's text and finish reason,
    and its usage; streamed or not."""
    if not stream:
        answer = client.completions.create(**request)
        choices = sorted(answer.choices, key=lambda choice: choice.index)
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens]
        return tokens, [(c.text, c.finish_reason) for c in choices], answer.usage
    chunks = list(
        client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens.setdefault(choice.index, []).extend(
                choice.logprobs.tokens if choice.logprobs else []
            )
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    rows = sorted(texts)
    return (
        [t for row in rows for t in tokens[row]],
        [(texts[row], finishes[row]) for row in rows],
        chunks[-1].usage,
    )


def _chat(client: Any, stream: bool, **request: Any) -> tuple[str, str, Any]:
    if not stream:
        answer = client.chat.completions.create(**request)
        choice = answer.choices[0]
        return choice.message.content, choice.finish_reason, answer.usage
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    return text, finishes[-1], chunks[-1].usage


# -- drafting --------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None, database=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=30),
    count=st.integers(1, 6),
    end=st.sampled_from([None, 0, 5]),
)
def test_prompt_lookup_drafts_what_transformers_does(
    tokens: list[int], count: int, end: int | None
) -> None:
    generator = PromptLookupCandidateGenerator(
        eos_token_id=None if end is None else torch.tensor([end]),
        num_output_tokens=count,
        max_matching_ngram_size=MAX_MATCHING_NGRAM,
        max_length=10_000,
    )
    candidates, _ = generator.get_candidates(torch.tensor([tokens]))
    theirs = candidates[0, len(tokens) :].tolist()
    ends = () if end is None else (end,)
    assert prompt_lookup(tokens, count, end_tokens=ends) == theirs


def test_prompt_lookup_takes_the_longest_ngram_and_its_first_occurrence() -> None:
    # The bigram (1, 2) occurred at 0 and at 4: what followed the first one is drafted.
    assert prompt_lookup([1, 2, 3, 9, 1, 2, 7, 1, 2], 3) == [3, 9, 1]
    # No bigram occurred before: the last token alone, first occurrence.
    assert prompt_lookup([4, 5, 4, 6, 4], 2) == [5, 4]
    # Cut at an end token.
    assert prompt_lookup([4, 5, 0, 4], 3, end_tokens={0}) == [5]
    assert prompt_lookup([1, 2, 3], 4) == []


# -- configuration ---------------------------------------------------------------------------------


def test_unknown_speculation_is_refused() -> None:
    with pytest.raises(ValueError, match="speculative must be None or one of: prompt_lookup"):
        ApiConfig(model="m", initial_peers=("x",), speculative="medusa")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens must be an integer >= 1"):
        ApiConfig(
            model="m",
            initial_peers=("x",),
            speculative="prompt_lookup",
            prompt_lookup_num_tokens=0,
        )


def test_the_engine_takes_speculation_for_later_requests(fast: Any) -> None:
    engine = fast.engine
    assert (engine.speculative, engine.prompt_lookup_num_tokens) == ("prompt_lookup", 10)
    with pytest.raises(ValueError, match="speculative must be None or one of"):
        engine.speculative = "draft_model"
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        engine.prompt_lookup_num_tokens = 0
    assert (engine.speculative, engine.prompt_lookup_num_tokens) == ("prompt_lookup", 10)


# -- answers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("prompt", "kept"), [(REPEATING, True), (STORY, False)])
def test_greedy_completions_equal_the_plain_endpoints(
    endpoint: Any, client: Any, fast: Any, fast_client: Any, prompt: str, kept: bool, stream: bool
) -> None:
    request = {
        "model": endpoint.repo,
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 1,
    }
    before = fast.engine.speculation.steps
    tokens, choices, usage = _complete(fast_client, stream, **request)
    plain_tokens, plain_choices, plain_usage = _complete(client, stream, **request)
    assert tokens == plain_tokens and len(tokens) == 40
    assert choices == plain_choices
    assert usage.completion_tokens == plain_usage.completion_tokens == 40
    assert "speculation" not in (plain_usage.model_extra or {})
    counts = _speculation(usage)
    # The prompt's step gives the first token; each decode step its kept drafts plus one.
    assert counts["steps"] + counts["accepted_tokens"] == 40 - 1
    assert 0 <= counts["accepted_tokens"] <= counts["drafted_tokens"]
    if kept:
        assert counts["accepted_tokens"] >= 20
    else:  # drafts were sent and some were turned down
        assert counts["drafted_tokens"] > counts["accepted_tokens"]
    assert fast.engine.speculation.steps == before + counts["steps"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("messages", "kept"), [(REPEAT_CHAT, True), (QUESTION_CHAT, False)])
def test_greedy_chat_answers_equal_the_plain_endpoints(
    endpoint: Any,
    client: Any,
    fast_client: Any,
    messages: list[dict[str, str]],
    kept: bool,
    stream: bool,
) -> None:
    request = {"model": endpoint.repo, "messages": messages, "max_tokens": 48, "temperature": 0}
    text, finish, usage = _chat(fast_client, stream, **request)
    plain_text, plain_finish, plain_usage = _chat(client, stream, **request)
    assert (text, finish) == (plain_text, plain_finish) and text
    assert usage.completion_tokens == plain_usage.completion_tokens
    counts = _speculation(usage)
    if kept:
        assert counts["accepted_tokens"] >= 10
    else:
        assert counts["drafted_tokens"] > counts["accepted_tokens"]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 11])
def test_max_tokens_is_kept_however_many_drafts_agree(
    endpoint: Any, client: Any, fast_client: Any, max_tokens: int
) -> None:
    request = {
        "model": endpoint.repo,
        "prompt": REPEATING,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    for stream in (False, True):
        _, choices, usage = _complete(fast_client, stream, **request)
        _, plain_choices, _ = _complete(client, stream, **request)
        assert choices == plain_choices and choices[0][1] == "length"
        assert usage.completion_tokens == max_tokens
        counts = _speculation(usage)
        assert counts["steps"] + counts["accepted_tokens"] == max_tokens - 1
        # Nothing is drafted that the answer has no room for.
        assert counts["drafted_tokens"] <= max(0, max_tokens - 2) * counts["steps"]


def test_stop_sequences_cut_a_kept_draft(endpoint: Any, client: Any, fast_client: Any) -> None:
    request = {
        "model": endpoint.repo,
        "prompt": REPEATING,
        "max_tokens": 40,
        "temperature": 0,
        "stop": ["blue, red, green"],
    }
    for stream in (False, True):
        _, choices, usage = _complete(fast_client, stream, **request)
        _, plain_choices, plain_usage = _complete(client, stream, **request)
        assert choices == plain_choices == [(" green, ", "stop")]
        assert usage.completion_tokens == plain_usage.completion_tokens
        assert _speculation(usage)["accepted_tokens"] > 0


def test_several_rows_of_different_lengths_equal_the_plain_endpoints(
    endpoint: Any, client: Any, fast_client: Any
) -> None:
    """Left-padded prompts and ``n`` 2: the rows share a session, whose position goes back
    for all of them."""
    request = {
        "model": endpoint.repo,
        "prompt": [REPEATING, "one two three one two three one two", STORY],
        "max_tokens": 24,
        "temperature": 0,
        "n": 1,
        "logprobs": 0,
    }
    for stream in (False, True):
        tokens, choices, usage = _complete(fast_client, stream, **request)
        plain_tokens, plain_choices, _ = _complete(client, stream, **request)
        assert (tokens, choices) == (plain_tokens, plain_choices)
        assert _speculation(usage)["steps"] > 0
    two = {**request, "prompt": REPEATING, "n": 2}
    tokens, choices, usage = _complete(fast_client, False, **two)
    assert (tokens, choices) == _complete(client, False, **two)[:2]
    assert choices[0] == choices[1]
    assert _speculation(usage)["accepted_tokens"] > 0


def test_greedy_logprobs_equal_the_plain_endpoints(
    endpoint: Any, client: Any, fast_client: Any
) -> None:
    request = {
        "model": endpoint.repo,
        "messages": REPEAT_CHAT,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    fast = fast_client.chat.completions.create(**request)
    plain = client.chat.completions.create(**request)
    assert _speculation(fast.usage)["accepted_tokens"] > 0
    ours, theirs = fast.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [t.token for t in ours] == [t.token for t in theirs]
    for token, other in zip(ours, theirs, strict=True):
        assert token.logprob == pytest.approx(other.logprob, abs=1e-3)
        assert [t.token for t in token.top_logprobs] == [t.token for t in other.top_logprobs]


def test_seeded_sampling_repeats_and_keeps_drafts(endpoint: Any, fast_client: Any) -> None:
    """A sampled row keeps a draft token when it is the token drawn at its position."""
    request = {
        "model": endpoint.repo,
        "prompt": REPEATING,
        "max_tokens": 30,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 11,
    }
    first = fast_client.completions.create(**request)
    again = fast_client.completions.create(**request)
    assert first.choices[0].text == again.choices[0].text
    assert first.usage.completion_tokens == 30
    counts = _speculation(first.usage)
    assert counts["accepted_tokens"] > 0
    assert counts["steps"] + counts["accepted_tokens"] == 30 - 1


def test_speculation_can_be_turned_off(endpoint: Any, fast: Any, fast_client: Any) -> None:
    """Set to None, the engine's later requests decode plainly (and count no drafts)."""
    fast.engine.speculative = None
    try:
        answer = fast_client.completions.create(
            model=endpoint.repo, prompt=REPEATING, max_tokens=8, temperature=0
        )
    finally:
        fast.engine.speculative = "prompt_lookup"
    assert "speculation" not in (answer.usage.model_extra or {})
