"""Streamed answers as a client reads them over HTTP, in front of the real SmolLM2 swarm."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import urllib.parse
from collections.abc import Iterator
from typing import Any

from petals_core.api._detokenize import text_bytes

DEADLINE_S = 60.0


@contextlib.contextmanager
def _stream(url: str, path: str, body: dict[str, Any]) -> Iterator[Any]:
    """A streamed request's response (headers read), until the block ends."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=DEADLINE_S)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        assert reply.status == 200
        assert reply.getheader("content-type", "").startswith("text/event-stream")
        yield reply
    finally:
        connection.close()


def _next_data(reply: Any) -> str:
    """The stream's next ``data:`` field (comment lines and blank lines skipped)."""
    while True:
        line = reply.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data: "):
            return line[len(b"data: ") :].decode().rstrip("\r\n")


def _rest(reply: Any) -> list[Any]:
    """The stream's chunks up to ``[DONE]``."""
    chunks = []
    while (data := _next_data(reply)) != "[DONE]":
        chunks.append(json.loads(data))
    return chunks


@contextlib.contextmanager
def _stalled(server: Any) -> Iterator[None]:
    """``server`` stopped (SIGSTOP: its connections stay open, it answers nothing) until the
    block ends, or until it sends SIGCONT itself."""
    server.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        server.send_signal(signal.SIGCONT)


def _begun_while_stalled(
    url: str, path: str, body: dict[str, Any], server: Any
) -> tuple[dict[str, Any], list[Any]]:
    """A streamed request's first chunk, read while ``server`` is stopped, and the rest of its
    chunks once it goes on."""
    with _stalled(server), _stream(url, path, body) as reply:
        first = json.loads(_next_data(reply))
        server.send_signal(signal.SIGCONT)
        return first, _rest(reply)


def test_a_stream_begins_before_the_swarm_answers(endpoint: Any) -> None:
    """With the first server stopped, no token can be generated: a stream's headers and first
    chunk (OpenAI's: the assistant's role, or each choice's echoed prompt; none for a plain
    completion, whose chunks each carry text) come all the same;
    once the server goes on, the answer follows.  The server is stopped only until the first
    chunk comes (well within the silence after which a client gives up on a server), and the
    endpoint has a client of its own."""
    url = endpoint.open_api().urls[0]
    server = endpoint.swarm.servers[0].process
    chat = {
        "model": endpoint.repo,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
    }
    first, rest = _begun_while_stalled(url, "/v1/chat/completions", chat, server)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in rest[:-1])
    assert rest[-1]["choices"][0]["finish_reason"] in ("stop", "length")

    prompt = "The capital of France is"
    completion = {
        "model": endpoint.repo,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "n": 2,
        "stream": True,
    }
    first, rest = _begun_while_stalled(url, "/v1/completions", completion, server)
    assert first["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in first["choices"]] == [
        (0, prompt, None),
        (1, prompt, None),
    ]
    texts = ["", ""]
    for chunk in rest:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts[0] == texts[1] != ""

    # Without an echo, a completion's chunks each carry text: its headers come all the same.
    plain = {**completion, "echo": False, "n": 1}
    with _stalled(server), _stream(url, "/v1/completions", plain) as reply:
        server.send_signal(signal.SIGCONT)
        chunks = _rest(reply)
    assert chunks[0]["choices"][0]["text"] != ""
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == texts[0]


def test_tokens_of_a_character_are_sent_with_it(endpoint: Any, client: Any) -> None:
    """Characters spread over several tokens (their UTF-8 bytes) are held back until complete,
    and their tokens' logprobs with them: each chunk carries the logprobs of the tokens whose
    text it carries, and none carries logprobs without text, as the whole answer has them."""
    settings: dict[str, Any] = {
        "model": endpoint.repo,
        "prompt": "東京は日本の首都です。東京は日本の首都です。東京は",  # copied on
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 1,
    }
    whole = client.completions.create(**settings).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**settings, stream=True)]
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    assert "".join(c.text for c in chunks) == whole.text
    assert max(len(c.logprobs.tokens) for c in chunks) > 1  # a character took several
    for chunk in chunks:  # (no opening chunk: each carries text)
        assert chunk.text or chunk.finish_reason is not None
        if chunk.finish_reason is None:
            assert b"".join(map(text_bytes, chunk.logprobs.tokens)) == chunk.text.encode()

    messages = [{"role": "user", "content": "Give me a smiley emoji."}]
    options: dict[str, Any] = {"max_tokens": 16, "temperature": 0, "logprobs": True}
    answer = client.chat.completions.create(model=endpoint.repo, messages=messages, **options)
    stream = client.chat.completions.create(
        model=endpoint.repo, messages=messages, stream=True, **options
    )
    choices = [chunk.choices[0] for chunk in stream]
    tokens = [[t.token for t in c.logprobs.content] if c.logprobs else [] for c in choices]
    assert [t for chunk in tokens for t in chunk] == [
        t.token for t in answer.choices[0].logprobs.content
    ]
    assert max(map(len, tokens)) > 1
    for choice in choices[1:]:
        assert choice.delta.content or choice.finish_reason is not None
        if choice.finish_reason is None:
            assert choice.logprobs is not None
            content = bytes(b for t in choice.logprobs.content for b in t.bytes)
            assert content == choice.delta.content.encode()
