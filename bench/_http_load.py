"""The HTTP clients of ``bench api``, in a process of their own.

A user's HTTP client never runs in the endpoint's process; the benchmark's must not either, or its
threads reading the streams would take CPU and the interpreter lock from the endpoint it measures.
:class:`LoadProcess` starts ``python -m bench._http_load`` and hands it one batch of requests at
a time over a pipe: each line in is a JSON object ``{"url", "model", "names"}``, and the process
answers with one line, ``{"seconds", "tokens", "cpu_seconds"}`` (the wall time from the moment
every request's thread is ready until the last stream ends, each stream's completion tokens, and
the CPU time the process spent on the batch, its ended threads included) or ``{"error"}``.
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


def stream(url: str, model: str, name: str) -> int:
    """One streamed greedy chat request; returns the completion's tokens."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300)
    body = {
        "model": model,
        "messages": messages(name),
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body))
        reply = connection.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"the endpoint answered {reply.status}: {reply.read()!r}")
        tokens = None
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        if tokens is None:
            raise RuntimeError("the stream ended without usage")
        return int(tokens)
    finally:
        connection.close()


def _batch(url: str, model: str, names: list[str]) -> dict[str, Any]:
    """Every name's request at once, each in its own thread."""
    tokens: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(names) + 1)

    def one(name: str) -> None:
        try:
            barrier.wait()
            tokens.append(stream(url, model, name))
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
    return {"seconds": seconds, "tokens": tokens, "cpu_seconds": time.process_time() - cpu}


def serve(lines: TextIO, out: TextIO) -> None:
    for line in lines:
        request = json.loads(line)
        out.write(json.dumps(_batch(request["url"], request["model"], request["names"])) + "\n")
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
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps({"url": url, "model": model, "names": names}) + "\n")
        stdin.flush()
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"the load process ended (exit status {self.process.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"a request failed: {answer['error']}")
        tokens = [int(count) for count in answer["tokens"]]
        return float(answer["seconds"]), tokens, float(answer["cpu_seconds"])

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
