"""Inference benchmark: tiny models served by a swarm of processes against transformers locally.

For each family (LLaMA, BLOOM) a random 8-block model — hidden 256, 4 attention heads (LLaMA: 2
key/value heads, FFN 1024; BLOOM: FFN 4 x 256), vocabulary 1024 — is generated with transformers
and saved to a temporary folder.  Two servers hold blocks 0:4 and 4:8: real processes from
:func:`~petals_core.testing.open_local_swarm` (fp32, CPU, one torch thread each, loopback).  The
client is :class:`~petals_core.distributed.AutoDistributedModelForCausalLM` in this
process; the local reference is transformers' ``*ForCausalLM`` of the same checkpoint, in this
process too, with one torch thread.

Swarm and local are measured in alternating rounds (a few tokens or steps of one, then of the
other), so that a change of load on the machine affects both alike; the servers are idle while
the local model runs.  Measured:

- decode: single-token forwards (embeddings, every block, final norm, LM head) after a 16-token
  prefill, in an inference session opened (and its route set up) before timing; locally with a
  ``DynamicCache``.  Median and p90 ms per token.
- prefill: a 16-token forward at position 0 of that session (rolled back to 0 between
  repetitions); locally into a fresh ``DynamicCache``.  Median ms.
- ptune step: ``tuning_mode="ptune"`` with 16 trainable prompt positions on a batch of 4 x 128
  tokens: forward, loss, backward (through the servers to the prompts), Adam step.  Locally the
  same prompts are prepended to the embeddings of transformers' (frozen) model, trained the same
  way.  Median ms.

Targets (issue text): decode <= 1.6x local, ptune step <= 1.4x local.  A second table breaks the
decode time down: our blocks in this process (what the servers compute; and the same right after
sleeping as long as that idle gap, which is what idling costs the machine itself), the same
blocks split over one worker process per server that pass the hidden state on pipes (the process
split alone, no network stack: ``bench/_pipes.py``), a raw ``petals.inference`` step on each
server from a bare transport client (and an empty step, 0 tokens: transport and request handling
without compute; and the 1-token step again after an idle gap like the one each server of the
chain sees between its steps), the client's session step, and the whole model forward — what
each layer adds.

- first step: the first forward of an inference session (``PREFILL`` tokens) on a client made
  afresh, and that of the client's second session, on loopback and over a 50 ms link (servers
  behind a delaying relay), by part (route planning, sending the openings with the longest
  connection among them, the step itself), beside local transformers' time for the same
  forward (a fresh ``DynamicCache``), which stands for its compute.  Its fixed cost is the rest.
  Each tree runs in a worker process with a swarm of its own (``bench/_first_step.py``);
  ``--against REF`` measures the project at git ``REF`` too, the trees taking turns.  Target
  with ``--against`` (the tree before the change): the fixed cost at most half of the other
  tree's (medians).

Run with ``nox -s bench -- inference`` (``nox -s bench -- inference --against REF``).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
import trio
from torch import nn
from transformers import BloomForCausalLM, LlamaForCausalLM, PreTrainedModel

from petals_core.testing import (
    LocalSwarm,
    Pipe,
    open_local_swarm,
    tiny_bloom_config,
    tiny_llama_config,
)

from ._decode import (
    DecodeResults,
    breakdown_rows,
    load_note,
    measure_decode,
    quiet_transformers,
    ratio_row,
    server_args,
    token_ids,
)
from ._first_step import ROOT, FirstSteps, checkout, measure_first_steps
from ._report import print_table, summarize_ratio, write_json
from ._timing import Timing, interleaved

HIDDEN = 256
BLOCKS = 8
VOCAB = 1024
SPANS = ((0, 4), (4, 8))
PREFILL = 16
PTUNE_BATCH = 4
PTUNE_LENGTH = 128
PTUNE_PROMPT = 16
PTUNE_WARMUP = 2
PTUNE_STEPS = 8
DECODE_TARGET = 1.6
PTUNE_TARGET = 1.4
FIRST_STEP_ROUNDS = 6
#: Links the first step is measured over: loopback, and a 50 ms one-way link (servers behind a
#: delaying relay, jitter a tenth of the delay, no loss; LLaMA only, fewer rounds).
FIRST_STEP_LINKS: tuple[tuple[str, Pipe | None, int | None], ...] = (
    ("loopback", None, None),
    ("50 ms", Pipe(latency_s=0.0475, jitter_s=0.005), 3),
)
#: With ``--against``: our fixed cost of a first step at most this share of the other tree's.
FIRST_STEP_TARGET = 0.5
#: Deadline of one family: starting its swarm and measuring it.
FAMILY_TIMEOUT_S = 600.0


def measure_ptune(
    folder: str,
    reference: PreTrainedModel,
    model_kwargs: Mapping[str, Any],
    *,
    vocab: int,
    batch: int = PTUNE_BATCH,
    length: int = PTUNE_LENGTH,
    prompt_len: int = PTUNE_PROMPT,
    warmup: int = PTUNE_WARMUP,
    steps: int = PTUNE_STEPS,
) -> tuple[Timing, Timing]:
    """(swarm, local) ms of one p-tuning step: forward, loss, backward, Adam."""
    from petals_core.distributed import AutoDistributedModelForCausalLM

    torch.manual_seed(1)
    tuned = AutoDistributedModelForCausalLM.from_pretrained(
        folder, tuning_mode="ptune", pre_seq_len=prompt_len, **model_kwargs
    )
    try:
        remote_prompts = tuned.distributed_base.prompt_embeddings.weight
        local_prompts = nn.Parameter(remote_prompts.detach().clone())
        remote_optimizer = torch.optim.Adam([remote_prompts], lr=1e-3)
        local_optimizer = torch.optim.Adam([local_prompts], lr=1e-3)
        ids = token_ids(batch, length, seed=2, vocab=vocab)
        embed = reference.get_input_embeddings()
        reference.requires_grad_(False)

        def swarm_step() -> None:
            tuned(ids, labels=ids).loss.backward()
            remote_optimizer.step()
            remote_optimizer.zero_grad()

        def local_step() -> None:
            embeddings = torch.cat([local_prompts.expand(batch, -1, -1), embed(ids)], dim=1)
            # As the distributed model: the LM head sees the token positions only.
            hidden = reference.base_model(inputs_embeds=embeddings).last_hidden_state
            logits = reference.lm_head(hidden[:, prompt_len:].contiguous())  # (B, T, vocab)
            loss = reference.loss_function(
                logits=logits, labels=ids, vocab_size=reference.config.vocab_size
            )
            loss.backward()
            local_optimizer.step()
            local_optimizer.zero_grad()

        timings = interleaved(
            {"swarm": swarm_step, "local": local_step}, warmup=warmup, rounds=steps, per_round=1
        )
    finally:
        tuned.shutdown()
    return timings["swarm"], timings["local"]


def _save(family: str, folder: Path) -> str:
    """A random tiny model of ``family`` saved under ``folder``; its path."""
    torch.manual_seed(0)
    model: PreTrainedModel
    if family == "llama":
        config = tiny_llama_config(
            hidden_size=HIDDEN,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=BLOCKS,
            vocab_size=VOCAB,
            max_position_embeddings=1024,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(config)
    else:
        model = BloomForCausalLM(
            tiny_bloom_config(hidden_size=HIDDEN, n_layer=BLOCKS, vocab_size=VOCAB)
        )
    path = folder / family
    model.save_pretrained(path)
    return str(path)


@attrs.frozen(kw_only=True)
class FamilyResults:
    decode: DecodeResults
    ptune_swarm: Timing
    ptune_local: Timing


def _measure_family(folder: str, swarm: LocalSwarm) -> FamilyResults:
    from transformers import AutoModelForCausalLM

    from petals_core.distributed import AutoDistributedModelForCausalLM

    kwargs = {"initial_peers": swarm.initial_peers, "request_timeout_s": 60.0}
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = AutoDistributedModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    try:
        decode = measure_decode(model, reference, swarm, SPANS, prefill=PREFILL, vocab=VOCAB)
    finally:
        model.shutdown()
    ptune_swarm, ptune_local = measure_ptune(folder, reference, kwargs, vocab=VOCAB)
    return FamilyResults(decode=decode, ptune_swarm=ptune_swarm, ptune_local=ptune_local)


async def _run_family(family: str, temp: Path) -> FamilyResults:
    folder = _save(family, temp)
    args = [server_args(span, cache_dir=temp / "cache") for span in SPANS]
    with trio.fail_after(FAMILY_TIMEOUT_S):
        async with open_local_swarm(folder, args) as swarm:
            return await trio.to_thread.run_sync(_measure_family, folder, swarm)


def _local_prefill_ms(folder: str, rounds: int) -> Timing:
    """Local transformers: the same first forward, into a fresh cache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = token_ids(1, PREFILL, seed=3, vocab=VOCAB)

    def prefill() -> None:
        with torch.no_grad():
            reference(prompt, cache=DynamicCache(config=reference.config), use_cache=True)

    return interleaved({"local": prefill}, warmup=2, rounds=rounds, per_round=4)["local"]


#: The kinds of session a first step is measured in (see ``bench/_first_step_worker.py``).
SESSION_KINDS = {"fresh": "a client's first session", "running": "its second session"}


def _first_step_rows(
    family: str, steps: dict[str, FirstSteps], local: Timing, against: str | None
) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    """Rows ``(part, then one column per kind of session)`` and the JSON record."""
    local_ms = local.median_ms
    ours = {kind: steps[f"this tree, {kind}"] for kind in SESSION_KINDS}

    def row(part: str, value: Callable[[FirstSteps], float]) -> tuple[Any, ...]:
        return (family, part, *(value(ours[kind]) for kind in SESSION_KINDS))

    def own(name: str) -> Callable[[FirstSteps], float]:
        return lambda measured: measured.median(name)

    def itself(measured: FirstSteps) -> float:
        return measured.median("step_ms") - measured.median("route_ms") - measured.median("open_ms")

    rows: list[tuple[Any, ...]] = [
        row("route planning (peer table read, or waited for)", own("route_ms")),
        row("opening the servers' sessions, all at once", own("open_ms")),
        row("  of which the longest connection", own("connect_ms")),
        row("the step itself (send, compute, answers)", itself),
        row("first forward, all (client start, embeddings, head)", own("first_ms")),
        row("local transformers, the same forward", lambda _: local_ms),
        row("fixed cost: first forward less local", lambda m: m.median("first_ms") - local_ms),
        row("second forward (1 token)", own("second_ms")),
    ]
    record: dict[str, Any] = {name: attrs.asdict(measured) for name, measured in steps.items()}
    record["local_ms"] = local.summary()
    if against is not None:
        theirs = {kind: steps[f"{against}, {kind}"] for kind in SESSION_KINDS}
        ratios = {}
        for kind in SESSION_KINDS:
            fixed = ours[kind].median("first_ms") - local_ms
            ratios[kind] = fixed / (theirs[kind].median("first_ms") - local_ms)

        def theirs_row(part: str, value: Callable[[FirstSteps], Any]) -> tuple[Any, ...]:
            return (family, part, *(value(theirs[kind]) for kind in SESSION_KINDS))

        rows += [
            theirs_row(f"{against}: first forward, all", own("first_ms")),
            theirs_row(f"{against}: fixed cost", lambda m: m.median("first_ms") - local_ms),
            (
                family,
                f"fixed cost vs {against} (target <= {FIRST_STEP_TARGET}x)",
                *(
                    f"{ratio:.2f}x {'met' if ratio <= FIRST_STEP_TARGET else 'NOT met'}"
                    for ratio in ratios.values()
                ),
            ),
            theirs_row(f"{against}: second forward", own("second_ms")),
        ]
        for kind, description in SESSION_KINDS.items():
            summarize_ratio(
                "inference",
                f"{family} tiny, fixed cost of the first step of {description}, vs {against}",
                ours[kind].median("first_ms") - local_ms,
                theirs[kind].median("first_ms") - local_ms,
                at_most=FIRST_STEP_TARGET,
            )
    return rows, record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench inference")
    parser.add_argument(
        "--against", metavar="REF", help="also measure the first step of the project at git REF"
    )
    parser.add_argument("--first-step-rounds", type=int, default=FIRST_STEP_ROUNDS)
    args = parser.parse_args(argv or [])
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = load_note()
    rows: list[tuple[Any, ...]] = []
    results: dict[str, Any] = {}
    with quiet_transformers(), tempfile.TemporaryDirectory(prefix="bench-inference-") as temp:
        for family in ("llama", "bloom"):
            measured = trio.run(_run_family, family, Path(temp))
            folder = str(Path(temp) / family)
            local = _local_prefill_ms(folder, args.first_step_rounds)
            first_records = {}
            for link_name, link, rounds in FIRST_STEP_LINKS:
                if link is not None and family != "llama":
                    continue  # round trips, the same for either family
                with contextlib.ExitStack() as trees:
                    tree_paths = {"this tree": ROOT}
                    if args.against is not None:
                        tree_paths[args.against] = trees.enter_context(checkout(args.against))
                    steps = measure_first_steps(
                        tree_paths,
                        folder=folder,
                        server_args=[
                            server_args(span, cache_dir=Path(temp) / "cache") for span in SPANS
                        ],
                        prefill=PREFILL,
                        vocab=VOCAB,
                        rounds=rounds or args.first_step_rounds,
                        link=link,
                    )
                first_rows, first_records[link_name] = _first_step_rows(
                    f"{family}, {link_name}", steps, local, args.against
                )
                print_table(
                    f"inference, {family}, {link_name}: the first forward ({PREFILL} tokens) of a "
                    "session, by part (medians, ms): a client's first session (made afresh: its "
                    "network part starts too), and its second",
                    ["model, link", "part", *SESSION_KINDS.values()],
                    first_rows,
                )
            d = measured.decode
            rows += d.ratio_rows(family, decode_target=DECODE_TARGET, prefill_target=None)
            rows += [
                ratio_row(
                    family,
                    f"ptune step {PTUNE_BATCH}x{PTUNE_LENGTH} ms",
                    measured.ptune_swarm.median_ms,
                    measured.ptune_local.median_ms,
                    PTUNE_TARGET,
                ),
            ]
            summarize_ratio(
                "inference",
                f"{family} tiny, decode ms/token (median), swarm vs local",
                d.decode_swarm.median_ms,
                d.decode_local.median_ms,
                at_most=DECODE_TARGET,
            )
            summarize_ratio(
                "inference",
                f"{family} tiny, ptune step {PTUNE_BATCH}x{PTUNE_LENGTH}, swarm vs local",
                measured.ptune_swarm.median_ms,
                measured.ptune_local.median_ms,
                at_most=PTUNE_TARGET,
            )
            print_table(
                f"inference, {family}: where a swarm decode token's time goes (medians)",
                ["part", "ms", "note"],
                breakdown_rows(d, SPANS),
            )
            results[family] = {
                **d.summary(),
                "ptune_swarm": measured.ptune_swarm.summary(),
                "ptune_local": measured.ptune_local.summary(),
                "first_step": first_records,
            }
    load_after = load_note()
    print_table(
        f"inference: tiny {BLOCKS}-block models (hidden {HIDDEN}, fp32) on 2 servers x 4 blocks "
        "(processes, loopback, 1 torch thread each) against transformers in this process",
        ["model", "what", "swarm ms", "local ms", "swarm/local", "target", "met"],
        rows,
    )
    print(f"machine: before {load_before}; after {load_after}")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "inference",
        {
            "model": {"hidden": HIDDEN, "blocks": BLOCKS, "vocab": VOCAB, "spans": SPANS},
            "decode_target": DECODE_TARGET,
            "ptune_target": PTUNE_TARGET,
            "first_step_target": FIRST_STEP_TARGET,
            "against": args.against,
            "load": {"before": load_before, "after": load_after},
            "results": results,
        },
    )
