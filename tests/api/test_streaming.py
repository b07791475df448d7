"""Streamed answers as a client reads them over HTTP, in front of the real SmolLM2 swarm."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import urllib.parse
from collections.abc import Iterator
from typing import Any

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


def _begun_while_stalled(
    url: str, path: str, body: dict[str, Any], server: Any
) -> tuple[dict[str, Any], list[Any]]:
    """A streamed request's first chunk, read while ``server`` is stopped (SIGSTOP: its
    connections stay open, it answers nothing), and the rest of its chunks once it goes on."""
    server.send_signal(signal.SIGSTOP)
    try:
        with _stream(url, path, body) as reply:
            first = json.loads(_next_data(reply))
            server.send_signal(signal.SIGCONT)
            return first, _rest(reply)
    finally:
        server.send_signal(signal.SIGCONT)


def test_a_stream_begins_before_the_swarm_answers(endpoint: Any) -> None:
    """With the first server stopped, no token can be generated: a stream's headers and first
    chunk (OpenAI's: the assistant's role, or each choice's echoed prompt) come all the same;
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
