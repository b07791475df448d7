"""The HTTP clients of ``bench api``, in a process of their own.

A user's HTTP client never runs in the endpoint's process; the benchmark's must not either, or its
threads reading the streams would take CPU and the interpreter lock from the endpoint it measures.
:class:`LoadProcess` starts ``python -m bench._http_load`` and hands it one batch of requests at
a time over a pipe: each line in is a JSON object ``{"url", "model", "names"}``, and the process
answers with one line, ``{"seconds", "tokens", "cpu_seconds"}`` (the wall time from the moment
every request's thread is ready until the last stream ends, each stream's completion tokens, and
the CPU time the process spent on the batch, its ended threads included) or ``{"error"}``.
A request may also carry ``"content"`` (every request's user message instead of the story of
each name) and ``"max_tokens"``; the answer then carries each stream's ``"texts"`` and
``"speculation"`` (its usage's drafting counts, or None), too.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Any, TextIO

__all__ = ["NEW_TOKENS", "LoadProcess", "messages", "stream"]

#: Answer length of every request.
NEW_TOKENS = 48


def messages(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about a dragon named {name}."}]


def stream(
    url: str,
    model: str,
    name: str,
    *,
    content: str | None = None,
    max_tokens: int = NEW_TOKENS,
) -> dict[str, Any]:
    """One streamed greedy chat request (the story of ``name``, or ``content``); returns the
    completion's ``tokens``, its ``text`` and its usage's ``speculation`` (None without)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300)
    body = {
        "model": model,
        "messages": messages(name) if content is None else [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body))
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"the endpoint answered {reply.status}: {reply.read()!r}")
        usage = None
        text = []
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            text += [choice["delta"].get("content") or "" for choice in chunk["choices"]]
            if chunk.get("usage"):
                usage = chunk["usage"]
        if usage is None:
            raise RuntimeError("the stream ended without usage")
        return {
            "tokens": int(usage["completion_tokens"]),
            "text": "".join(text),
            "speculation": usage.get("speculation"),
        }
    finally:
        connection.close()


def _batch(
    url: str, model: str, names: list[str], content: str | None, max_tokens: int
) -> dict[str, Any]:
    """Every name's request at once, each in its own thread."""
    answers: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(names) + 1)

    def one(name: str) -> None:
        try:
            barrier.wait()
            answers.append(stream(url, model, name, content=content, max_tokens=max_tokens))
        except BaseException as exc:
            errors.append(exc)

    cpu = time.process_time()
    threads = [threading.Thread(target=one, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if errors:
        return {"error": repr(errors[0])}
    return {
        "seconds": seconds,
        "tokens": [answer["tokens"] for answer in answers],
        "texts": [answer["text"] for answer in answers],
        "speculation": [answer["speculation"] for answer in answers],
        "cpu_seconds": time.process_time() - cpu,
    }


def serve(lines: TextIO, out: TextIO) -> None:
    for line in lines:
        request = json.loads(line)
        answer = _batch(
            request["url"],
            request["model"],
            request["names"],
            request.get("content"),
            request.get("max_tokens", NEW_TOKENS),
        )
        out.write(json.dumps(answer) + "\n")
        out.flush()


class LoadProcess:
    """The benchmark's side of ``python -m bench._http_load``; close it (or use ``with``)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench._http_load"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def run(self, url: str, model: str, names: list[str]) -> tuple[float, list[int], float]:
        """The requests of ``names`` at once: (wall seconds, each one's completion tokens, CPU
        seconds of the clients)."""
        answer = self._ask({"url": url, "model": model, "names": names})
        tokens = [int(count) for count in answer["tokens"]]
        return float(answer["seconds"]), tokens, float(answer["cpu_seconds"])

    def answer(
        self, url: str, model: str, content: str, max_tokens: int
    ) -> tuple[float, int, str, dict[str, int] | None]:
        """One request of user message ``content``: (wall seconds, completion tokens, text,
        the usage's drafting counts or None)."""
        request = {"url": url, "model": model, "names": ["-"], "content": content}
        answer = self._ask({**request, "max_tokens": max_tokens})
        speculation = answer["speculation"][0]
        return float(answer["seconds"]), int(answer["tokens"][0]), answer["texts"][0], speculation

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the load process ended (exit status {self.process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"a request failed: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LoadProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    serve(sys.stdin, sys.stdout)
