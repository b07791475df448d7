"""OpenAI request bodies, read into checked records.

:func:`parse_completion_untrusted` and :func:`parse_chat_untrusted` take a decoded JSON body from
anyone and return a :class:`CompletionRequest` / :class:`ChatRequest`, or raise
:class:`~petals_core.api.ApiError` (400) saying which field is wrong and why. Fields OpenAI
defines but ``generate()`` cannot honour (penalties, logit biases, tools, ...) are accepted only
at their neutral values; fields OpenAI does not define are refused, as OpenAI refuses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from ._errors import ApiError

__all__ = [
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "ChatRequest",
    "CompletionRequest",
    "Message",
    "Sampling",
    "parse_chat_untrusted",
    "parse_completion_untrusted",
]

#: OpenAI's limits: up to 4 stop sequences, 5 top logprobs for completions and 20 for chat.
MAX_STOP: Final = 4
#: The longest stop sequence (each step looks for every one at the end of each choice's text).
MAX_STOP_CHARS: Final = 1024
MAX_COMPLETION_LOGPROBS: Final = 5
MAX_CHAT_LOGPROBS: Final = 20
#: Upper bound of ``n`` before the endpoint's own (smaller) limit applies.
MAX_N: Final = 128
#: Completions' default ``max_tokens`` (OpenAI's); chat completions default to the room left.
COMPLETION_DEFAULT_MAX_TOKENS: Final = 16


@attrs.frozen(kw_only=True)
class Sampling:
    """How to generate: ``temperature`` 0 is greedy; ``logprobs`` None returns none, ``k`` each
    token's log-probability with the ``k`` likeliest alternatives; ``max_tokens`` None: as many
    as the endpoint's limit leaves."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """``POST /v1/completions``: ``prompts`` are texts or token ids (one choice group each)."""

    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    echo: bool = False


@attrs.frozen(kw_only=True)
class Message:
    role: str
    content: str


@attrs.frozen(kw_only=True)
class ChatRequest:
    """``POST /v1/chat/completions``: ``messages`` go through the tokenizer's chat template."""

    model: str
    messages: tuple[Message, ...]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False


# -- field readers --------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # Integers are finite however large (isfinite would overflow converting them to float).
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _integer(body: Mapping[str, Any], name: str, *, low: int, high: int) -> int | None:
    value = _in_range(body, name, "an integer", _is_int, low, high)
    return None if value is None else int(value)


def _number(
    body: Mapping[str, Any], name: str, *, low: float, high: float, default: float
) -> float:
    value = _in_range(body, name, "a number", _is_number, low, high)
    return default if value is None else float(value)


def _in_range(
    body: Mapping[str, Any],
    name: str,
    kind: str,
    valid: Callable[[Any], bool],
    low: float,
    high: float,
) -> Any:
    """``body[name]``, None when it is absent; refused unless it is ``valid`` (``kind``) and
    from ``low`` to ``high``."""
    value = body.get(name)
    if value is not None and (not valid(value) or not low <= value <= high):
        raise ApiError.bad_request(
            f"{name} must be {kind} from {low} to {high}, got {value!r}", param=name
        )
    return value


def _given(body: Mapping[str, Any], name: str) -> Any:
    """``body[name]``, which must be there."""
    if name not in body:
        raise ApiError.bad_request(f"{name} must be given", param=name)
    return body[name]


def _boolean(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError.bad_request(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _neutral(body: Mapping[str, Any], name: str, is_neutral: Callable[[Any], bool]) -> None:
    value = body.get(name)
    if value is not None and not is_neutral(value):
        raise ApiError.bad_request(
            f"{name} is not supported by this endpoint (generation has no such setting); "
            "leave it out",
            param=name,
        )


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or not 0 <= len(stops) <= MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise ApiError.bad_request(
            f"stop must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up to "
            f"{MAX_STOP} of them",
            param="stop",
        )
    return tuple(stops)


def _seed(body: Mapping[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if not _is_int(value) or not -(2**63) <= value < 2**63:
        raise ApiError.bad_request(f"seed must be a 64-bit integer, got {value!r}", param="seed")
    return int(value)


def _check_known(body: Mapping[str, Any], known: frozenset[str]) -> None:
    unknown = sorted(str(name) for name in body if name not in known)
    if unknown:
        raise ApiError.bad_request(
            f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0]
        )


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError.bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(options, Mapping):
        raise ApiError.bad_request("stream_options must be an object", param="stream_options")
    _check_known(options, frozenset({"include_usage", "include_obfuscation"}))
    _boolean(options, "include_obfuscation")  # no obfuscation is added either way
    return _boolean(options, "include_usage")


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError.bad_request("model must be given, as a string", param="model")
    return model


def _object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError.bad_request("the request body must be a JSON object")
    return body


_COMMON: Final = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "stop",
        "seed",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "user",
    }
)


def _sampling(body: Mapping[str, Any], *, max_tokens: int | None, logprobs: int | None) -> Sampling:
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name, low=-2.0, high=2.0, default=0.0)
        _neutral(body, name, lambda value: value == 0)
    _neutral(body, "logit_bias", lambda value: isinstance(value, Mapping) and not value)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError.bad_request("user must be a string", param="user")
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", low=0.0, high=2.0, default=1.0),
        top_p=_top_p(body),
        stop=_stop(body),
        seed=_seed(body),
        n=_integer(body, "n", low=1, high=MAX_N) or 1,
        logprobs=logprobs,
    )


def _top_p(body: Mapping[str, Any]) -> float:
    """``top_p`` 0 keeps only the likeliest token, as greedy decoding does."""
    return _number(body, "top_p", low=0.0, high=1.0, default=1.0)


# -- completions ----------------------------------------------------------------------------------

_COMPLETION: Final = _COMMON | {"prompt", "echo", "best_of", "suffix"}


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    def tokens(item: Any) -> tuple[int, ...] | None:
        if isinstance(item, list) and item and all(_is_int(t) and t >= 0 for t in item):
            return tuple(item)
        return None

    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value:
        if all(_is_int(t) for t in value):
            single = tokens(value)
            if single is not None:
                return (single,)
        elif all(isinstance(item, str) for item in value):
            return tuple(value)
        else:
            many = [tokens(item) for item in value]
            if all(item is not None for item in many):
                return tuple(item for item in many if item is not None)
    raise ApiError.bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
        "token ids (none empty)",
        param="prompt",
    )


def parse_completion_untrusted(body: Any) -> CompletionRequest:
    """``POST /v1/completions``'s body; :class:`ApiError` (400) if it is not a valid one."""
    body = _object(body)
    _check_known(body, _COMPLETION)
    model = _model(body)
    prompts = _prompts(_given(body, "prompt"))
    _neutral(body, "suffix", lambda value: value == "")
    n = _integer(body, "n", low=1, high=MAX_N) or 1
    _neutral(body, "best_of", lambda value: _is_int(value) and value == n)
    stream = _boolean(body, "stream")
    max_tokens = _integer(body, "max_tokens", low=0, high=2**31 - 1)
    sampling = _sampling(
        body,
        max_tokens=COMPLETION_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=_integer(body, "logprobs", low=0, high=MAX_COMPLETION_LOGPROBS),
    )
    echo = _boolean(body, "echo")
    return CompletionRequest(
        model=model,
        prompts=prompts,
        sampling=sampling,
        stream=stream,
        include_usage=_stream_options(body, stream),
        echo=echo,
    )


# -- chat completions -----------------------------------------------------------------------------

#: OpenAI's fields that change nothing here but how OpenAI bills, caches or stores the answer:
#: checked, ignored.
_CHAT_IGNORED: Final = {
    "service_tier": str,
    "prompt_cache_key": str,
    "safety_identifier": str,
    "prediction": Mapping,
    "metadata": Mapping,
}
#: OpenAI's fields that ask for what this endpoint cannot do, and their neutral values.
_CHAT_UNSUPPORTED: Final[dict[str, Callable[[Any], bool]]] = {
    "modalities": lambda value: value == ["text"],
    "reasoning_effort": lambda value: False,
    "verbosity": lambda value: False,
    "audio": lambda value: False,
    "web_search_options": lambda value: False,
}
_CHAT: Final = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "store",
    *_CHAT_IGNORED,
    *_CHAT_UNSUPPORTED,
}
#: Fields of an assistant message as OpenAI answers it: clients send them back with the history,
#: accepted when empty.
_ANSWER_FIELDS: Final = ("refusal", "tool_calls", "function_call", "audio", "annotations")
_MESSAGE_FIELDS: Final = frozenset({"role", "content", "name", *_ANSWER_FIELDS})
_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def _content(value: Any, index: int) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ApiError.bad_request(
                    f"messages[{index}].content: only text parts are supported",
                    param="messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError.bad_request(
                    f"messages[{index}].content: a text part needs a string text",
                    param="messages",
                )
            texts.append(text)
        return "".join(texts)
    raise ApiError.bad_request(
        f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


def _messages(value: Any) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise ApiError.bad_request("messages must be a non-empty list", param="messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ApiError.bad_request(f"messages[{index}] must be an object", param="messages")
        _check_known(message, _MESSAGE_FIELDS)
        for field in _ANSWER_FIELDS:
            if message.get(field) not in (None, [], {}):
                raise ApiError.bad_request(
                    f"messages[{index}].{field} is not supported here (no tools, audio or "
                    "annotations); leave it out or null",
                    param="messages",
                )
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise ApiError.bad_request(
                f"messages[{index}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                param="messages",
            )
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ApiError.bad_request(f"messages[{index}].name must be a string", param="messages")
        content = message.get("content")
        if content is None and role == "assistant":  # an answer that was all refusal or tools
            content = ""
        messages.append(Message(role=_ROLES[role], content=_content(content, index)))
    return tuple(messages)


def parse_chat_untrusted(body: Any) -> ChatRequest:
    """``POST /v1/chat/completions``' body; :class:`ApiError` (400) if it is not a valid one."""
    body = _object(body)
    _check_known(body, _CHAT)
    model = _model(body)
    messages = _messages(_given(body, "messages"))
    for name in ("tools", "functions"):
        _neutral(body, name, lambda value: isinstance(value, list) and not value)
    for name in ("tool_choice", "function_call"):
        _neutral(body, name, lambda value: value == "none")
    _neutral(
        body,
        "response_format",
        lambda value: isinstance(value, Mapping) and dict(value) == {"type": "text"},
    )
    for name in ("parallel_tool_calls", "store"):
        _boolean(body, name)
    for name, kind in _CHAT_IGNORED.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            what = "a string" if kind is str else "an object"
            raise ApiError.bad_request(f"{name} must be {what}", param=name)
    for name, is_neutral in _CHAT_UNSUPPORTED.items():
        _neutral(body, name, is_neutral)
    # max_tokens is the older name: both are checked, the newer one wins.
    old_limit = _integer(body, "max_tokens", low=1, high=2**31 - 1)
    limit = _integer(body, "max_completion_tokens", low=1, high=2**31 - 1)
    if limit is None:
        limit = old_limit
    stream = _boolean(body, "stream")
    wants_logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", low=0, high=MAX_CHAT_LOGPROBS)
    if top is not None and not wants_logprobs:
        raise ApiError.bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=_sampling(body, max_tokens=limit, logprobs=(top or 0) if wants_logprobs else None),
        stream=stream,
        include_usage=_stream_options(body, stream),
    )
