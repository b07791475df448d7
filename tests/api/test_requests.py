"""Reading OpenAI request bodies: defaults, accepted forms, and what is refused."""

from __future__ import annotations

from typing import Any

import pytest

from petals_core.api import (
    ApiError,
    Limits,
    Message,
    parse_chat_untrusted,
    parse_completion_untrusted,
)
from petals_core.api._requests import MAX_STOP_CHARS

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def _refused(parse: Any, body: Any, param: str | None, match: str) -> None:
    with pytest.raises(ApiError, match=match) as caught:
        parse(body)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_chat_defaults_and_forms() -> None:
    request = parse_chat_untrusted(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "stop": "END",
            "logprobs": True,
            "presence_penalty": 0,
            "tools": [],
            "response_format": {"type": "text"},
        }
    )
    assert request.messages == (
        Message(role="system", content="Be brief."),
        Message(role="user", content="ab"),
    )
    sampling = request.sampling
    assert sampling.max_tokens is None  # as much as the endpoint allows
    assert (sampling.temperature, sampling.top_p, sampling.n) == (1.0, 1.0, 1)
    assert sampling.stop == ("END",)
    assert sampling.logprobs == 0
    assert not request.stream
    assert parse_chat_untrusted({**CHAT, "max_completion_tokens": 7}).sampling.max_tokens == 7
    assert parse_chat_untrusted({**CHAT, "top_p": 0}).sampling.top_p == 0.0


def test_chat_fields_of_openai_that_change_nothing_here_are_accepted() -> None:
    request = parse_chat_untrusted(
        {
            **CHAT,
            "service_tier": "auto",
            "prompt_cache_key": "session-7",
            "safety_identifier": "user-1",
            "prediction": {"type": "content", "content": "Hello"},
            "modalities": ["text"],
            "reasoning_effort": None,
        }
    )
    assert request.messages == (Message(role="user", content="Hi"),)


def test_an_assistant_message_without_content_is_an_empty_one() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "refusal": None},
        {"role": "user", "content": "Again"},
    ]
    request = parse_chat_untrusted({**CHAT, "messages": messages})
    assert request.messages[1] == Message(role="assistant", content="")
    with pytest.raises(ApiError, match="must be a string"):
        parse_chat_untrusted({**CHAT, "messages": [{"role": "user", "content": None}]})


def test_completion_defaults_and_prompt_forms() -> None:
    request = parse_completion_untrusted({"model": "m", "prompt": "Hi"})
    assert request.prompts == ("Hi",)
    assert request.sampling.max_tokens == 16  # OpenAI's default for completions
    assert parse_completion_untrusted({"model": "m", "prompt": ["a", "b"]}).prompts == ("a", "b")
    assert parse_completion_untrusted({"model": "m", "prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion_untrusted({"model": "m", "prompt": [[1], [2, 3]]}).prompts == (
        (1,),
        (2, 3),
    )
    streamed = parse_completion_untrusted(
        {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.stream and streamed.include_usage


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
        ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop", "up to 4"),
        ({**CHAT, "stop": [""]}, "stop", "1 to 1024 characters"),
        ({**CHAT, "seed": 2**70}, "seed", "64-bit"),
        ({**CHAT, "max_tokens": -1}, "max_tokens", "from 1"),
        ({**CHAT, "max_tokens": 0}, "max_tokens", "from 1"),
        ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens", "from 1"),
        ({**CHAT, "service_tier": 3}, "service_tier", "must be a string"),
        ({**CHAT, "prediction": "x"}, "prediction", "must be an object"),
        ({**CHAT, "reasoning_effort": "low"}, "reasoning_effort", "not supported"),
        ({**CHAT, "modalities": ["text", "audio"]}, "modalities", "not supported"),
        ({**CHAT, "web_search_options": {}}, "web_search_options", "not supported"),
        ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools", "not supported"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format", "not supported"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "only text parts",
        ),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages", "role must be"),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x", "name": 3}]},
            "messages",
            "name must be a string",
        ),
        ({**CHAT, "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop", "1 to 1024 characters"),
        ({**CHAT, "model": 3}, "model", "model must be given"),
    ],
)
def test_chat_refusals(body: dict[str, Any], param: str, match: str) -> None:
    _refused(parse_chat_untrusted, body, param, match)


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"model": "m"}, "prompt", "prompt must be given"),
        ({"model": "m", "prompt": []}, "prompt", "prompt must be"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt", "prompt must be"),
        ({"model": "m", "prompt": [[]]}, "prompt", "prompt must be"),
        ({"model": "m", "prompt": [-1]}, "prompt", "prompt must be"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs", "from 0 to 5"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of", "not supported"),
        ({"model": "m", "prompt": "x", "best_of": 1.0}, "best_of", "not supported"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix", "not supported"),
        ({"model": "m", "prompt": "x", "messages": []}, "messages", "Unrecognized"),
    ],
)
def test_completion_refusals(body: dict[str, Any], param: str, match: str) -> None:
    _refused(parse_completion_untrusted, body, param, match)


def test_non_objects_are_refused() -> None:
    for body in (None, [], "x", 3):
        _refused(parse_chat_untrusted, body, None, "JSON object")


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_rows must be an integer >= 1"):
        Limits(max_rows=0)
    assert Limits(max_queued_requests=0).max_queued_requests == 0
