"""Inference benchmark: tiny models served by a swarm of processes against transformers locally.

For each family (LLaMA, BLOOM) a random 8-block model — hidden 256, 4 attention heads (LLaMA: 2
key/value heads, FFN 1024; BLOOM: FFN 4 x 256), vocabulary 1024 — is generated with transformers
and saved to a temporary folder.  Two servers hold blocks 0:4 and 4:8: real processes from
:func:`~petals_core.testing.open_local_swarm` (fp32, CPU, one torch thread each, loopback).  The
client is :class:`~petals_core.models.distributed.AutoDistributedModelForCausalLM` in this
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

Run with ``nox -s bench -- inference``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import trio
from torch import nn
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from petals_core.models import BloomBlock, LlamaBlock
from petals_core.server import INFERENCE
from petals_core.testing import LocalSwarm, fixed_server_args, open_local_swarm
from petals_core.transport import open_call, open_node

from ._pipes import PipeChain
from ._report import median, percentile, print_table, summarize, write_json
from ._server_steps import server_steps

HIDDEN = 256
BLOCKS = 8
VOCAB = 1024
SPANS = ((0, 4), (4, 8))
PREFILL = 16
#: Decode: untimed tokens first, then ROUNDS rounds of PER_ROUND tokens of each measurement.
DECODE_WARMUP = 8
DECODE_ROUNDS = 6
DECODE_PER_ROUND = 12
#: Silence before the "idle" raw steps: about what each server of the chain waits between steps.
IDLE_GAP_S = 0.01
#: Rounds (of DECODE_PER_ROUND tokens) of the CPU accounting of decode, swarm then local.
CPU_ROUNDS = 3
PREFILL_WARMUP = 2
PREFILL_ROUNDS = 5
PREFILL_PER_ROUND = 4
PTUNE_BATCH = 4
PTUNE_LENGTH = 128
PTUNE_PROMPT = 16
PTUNE_WARMUP = 2
PTUNE_STEPS = 8
DECODE_TARGET = 1.6
PTUNE_TARGET = 1.4
#: Deadline of one family: starting its swarm and measuring it.
FAMILY_TIMEOUT_S = 600.0


@attrs.frozen(kw_only=True)
class Timing:
    """Samples (ms) of one operation."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return median(self.samples_ms)

    @property
    def p90_ms(self) -> float:
        return percentile(self.samples_ms, 0.9)

    def summary(self) -> dict[str, float]:
        return {
            "median_ms": self.median_ms,
            "p90_ms": self.p90_ms,
            "mean_ms": statistics.fmean(self.samples_ms),
            "samples": len(self.samples_ms),
        }


def interleaved(
    calls: Mapping[str, Callable[[], object]],
    *,
    warmup: int,
    rounds: int,
    per_round: int,
    each_round: Sequence[Callable[[], object]] = (),
) -> dict[str, Timing]:
    """Time each call alone (ms), ``per_round`` times per round, the calls taking turns.

    Each call first runs ``warmup`` untimed times.  Taking turns spreads any drift of the
    machine's load over every call alike.  ``each_round`` (untimed here: they keep their own
    samples) run once at the end of every round.
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(per_round):
                start = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - start) * 1e3)
        for extra in each_round:
            extra()
    return {name: Timing(samples_ms=tuple(values)) for name, values in samples.items()}


def token_ids(batch: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (batch, length), generator=generator)


def ratio_row(
    label: str, what: str, swarm_ms: float, local_ms: float, target: float | None
) -> tuple[Any, ...]:
    """A row of the main table: what, swarm ms, local ms, ratio, target, met."""
    ratio = swarm_ms / local_ms
    met = (
        None
        if target is None
        else ("yes" if ratio <= target else f"NO (+{ratio / target - 1:.0%})")
    )
    return (
        label,
        what,
        swarm_ms,
        local_ms,
        f"{ratio:.2f}x",
        None if target is None else f"<= {target}x",
        met,
    )


def load_note() -> str:
    """The machine's load: other work on it slows every process of the swarm."""
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


# -- CPU accounting ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SchedTotals:
    """Nanoseconds the threads of some processes ran on a CPU, and waited for one."""

    cpu_ns: int
    wait_ns: int

    def __sub__(self, other: SchedTotals) -> SchedTotals:
        return SchedTotals(cpu_ns=self.cpu_ns - other.cpu_ns, wait_ns=self.wait_ns - other.wait_ns)


def sched_totals(pid: int) -> SchedTotals:
    """The sum over every thread of ``pid`` of ``/proc/<pid>/task/<tid>/schedstat`` (Linux):
    time on a CPU and time runnable but waiting in a run queue.

    The wait is what a busy machine adds: a process woken by a packet or a thread woken by a
    result waits there until a CPU is free.  Threads that ended meanwhile are not counted.
    """
    cpu = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended
        cpu += int(fields[0])
        wait += int(fields[1])
    return SchedTotals(cpu_ns=cpu, wait_ns=wait)


def schedstat_available() -> bool:
    return Path(f"/proc/{os.getpid()}/task").is_dir() and any(
        (task / "schedstat").is_file() for task in Path(f"/proc/{os.getpid()}/task").iterdir()
    )


@attrs.frozen(kw_only=True)
class CpuPerToken:
    """Per decode token (ms): wall time, CPU time of each process, run-queue wait of all."""

    wall_ms: float
    #: Process name ("client", "local", "server 0:4", ...) -> CPU ms per token.
    cpu_ms: Mapping[str, float]
    wait_ms: float

    @property
    def total_cpu_ms(self) -> float:
        return sum(self.cpu_ms.values())

    def summary(self) -> dict[str, Any]:
        return {"wall_ms": self.wall_ms, "cpu_ms": dict(self.cpu_ms), "wait_ms": self.wait_ms}


def cpu_per_token(
    step: Callable[[], object], processes: Mapping[str, int], *, rounds: int, per_round: int
) -> CpuPerToken:
    """Run ``step`` ``rounds * per_round`` times; wall, CPU and run-queue wait per step of the
    named processes (sampled around each round, so that reading ``/proc`` is not counted)."""
    wall = 0.0
    used = dict.fromkeys(processes, SchedTotals(cpu_ns=0, wait_ns=0))
    for _ in range(rounds):
        before = {name: sched_totals(pid) for name, pid in processes.items()}
        start = time.perf_counter()
        for _ in range(per_round):
            step()
        wall += time.perf_counter() - start
        for name, pid in processes.items():
            delta = sched_totals(pid) - before[name]
            used[name] = SchedTotals(
                cpu_ns=used[name].cpu_ns + delta.cpu_ns,
                wait_ns=used[name].wait_ns + delta.wait_ns,
            )
    steps = rounds * per_round
    return CpuPerToken(
        wall_ms=wall * 1e3 / steps,
        cpu_ms={name: totals.cpu_ns / 1e6 / steps for name, totals in used.items()},
        wait_ms=sum(totals.wait_ns for totals in used.values()) / 1e6 / steps,
    )


# -- decode and prefill, with the breakdown ----------------------------------------------------


def local_blocks(reference: Any) -> list[Any]:
    """Our blocks (what the servers run) with the weights of transformers' layers."""
    if reference.config.model_type == "llama":
        layers = reference.model.layers
        make: Callable[[Any, int], nn.Module] = LlamaBlock
    else:
        layers = reference.transformer.h
        make = BloomBlock
    blocks = []
    for index, layer in enumerate(layers):
        block = make(reference.config, index)
        block.load_state_dict(layer.state_dict())
        blocks.append(block.eval())
    return blocks


@attrs.frozen(kw_only=True)
class DecodeResults:
    """Decode and prefill, swarm and local, and the parts of the swarm's decode time."""

    decode_swarm: Timing
    decode_local: Timing
    prefill_swarm: Timing
    prefill_local: Timing
    #: Single-token steps of the client's session (both hops, through the sync bridge).
    session_step: Timing
    #: Per server (in route order): our blocks of its span in this process, no network.
    compute: tuple[Timing, ...]
    #: Per server: a raw ``petals.inference`` step of one token from a bare transport client.
    raw_step: tuple[Timing, ...]
    #: Per server: a raw step of 0 tokens (transport, codec and request handling only).
    empty_step: tuple[Timing, ...]
    #: Per server: a raw 1-token step sent after ``idle_gap_s`` of silence, as a server of the
    #: chain sees its steps (it idles while the others compute).
    idle_step: tuple[Timing, ...]
    #: Per server: our blocks of its span in this process right after sleeping ``idle_gap_s``:
    #: what idling costs the machine itself, with no server or network involved.
    idle_compute: tuple[Timing, ...]
    idle_gap_s: float
    #: Our blocks in one worker process per span, the hidden state passed on pipes from this
    #: process through every worker and back (:class:`PipeChain`): the process split alone.
    pipes: Timing
    #: CPU accounting of decode (None where ``/proc/*/schedstat`` is missing).
    cpu_swarm: CpuPerToken | None
    cpu_local: CpuPerToken | None


def measure_decode(
    model: Any,
    reference: PreTrainedModel,
    swarm: LocalSwarm,
    spans: Sequence[tuple[int, int]],
    *,
    prefill: int,
    vocab: int,
    rounds: int = DECODE_ROUNDS,
    per_round: int = DECODE_PER_ROUND,
    warmup: int = DECODE_WARMUP,
    prefill_rounds: int = PREFILL_ROUNDS,
    prefill_per_round: int = PREFILL_PER_ROUND,
    cpu_rounds: int = CPU_ROUNDS,
    idle_gap_s: float = IDLE_GAP_S,
) -> DecodeResults:
    """Run in a worker thread of the trio program that holds ``swarm`` (raw calls run there)."""
    hidden_size = reference.config.hidden_size
    decode_tokens = warmup + (rounds + cpu_rounds) * per_round
    max_length = prefill + decode_tokens
    prompt = token_ids(1, prefill, seed=3, vocab=vocab)
    tokens = token_ids(1, decode_tokens, seed=4, vocab=vocab)
    blocks = local_blocks(reference)
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        session = stack.enter_context(model.inference_session(max_length=max_length))
        # The route is planned and every server's session opened here, untimed.
        model(prompt)

        def prefill_swarm() -> None:
            session.position = 0
            model(prompt)

        def prefill_local() -> None:
            reference(prompt, cache=DynamicCache(config=reference.config), use_cache=True)

        prefills = interleaved(
            {"swarm": prefill_swarm, "local": prefill_local},
            warmup=PREFILL_WARMUP,
            rounds=prefill_rounds,
            per_round=prefill_per_round,
        )

        session.position = 0
        model(prompt)
        cache = DynamicCache(config=reference.config)
        reference(prompt, cache=cache, use_cache=True)
        # A second session for bare session steps (random hidden states, no local layers); not
        # entered, so that the model's forwards keep stepping through the first.
        steps = model.inference_session(max_length=max_length)
        stack.callback(steps.close)
        steps.step(torch.randn(1, prefill, hidden_size))
        caches = [block.allocate_cache(1, max_length) for block in blocks]
        chain = PipeChain(blocks, spans, max_length=max_length, hidden_size=hidden_size)
        stack.callback(chain.close)
        chain.step(torch.randn(1, prefill, hidden_size))
        stack.enter_context(torch.inference_mode())
        warm_x = torch.randn(1, prefill, hidden_size)
        for block, block_cache in zip(blocks, caches, strict=True):
            warm_x = block(warm_x, cache=block_cache)
        swarm_column = iter(range(decode_tokens))
        local_column = iter(range(decode_tokens))

        def decode_swarm() -> None:
            i = next(swarm_column)
            model(tokens[:, i : i + 1])

        def decode_local() -> None:
            i = next(local_column)
            reference(tokens[:, i : i + 1], cache=cache, use_cache=True)

        def session_step() -> None:
            steps.step(torch.randn(1, 1, hidden_size))

        server = server_steps(blocks)

        def span_compute(span: tuple[int, int]) -> Callable[[], None]:
            def run() -> None:
                server(*span, [torch.randn(1, 1, hidden_size)], [caches[slice(*span)]])

            return run

        calls: dict[str, Callable[[], object]] = {
            "decode_swarm": decode_swarm,
            "decode_local": decode_local,
            "session_step": session_step,
        }
        for span in spans:
            calls[f"compute {span}"] = span_compute(span)
        raw: dict[str, list[float]] = {}

        idle_compute: dict[tuple[int, int], list[float]] = {span: [] for span in spans}

        def idle_compute_round() -> None:
            for span in spans:
                run = span_compute(span)
                # Rolled back after each step: the caches are sized for the timed calls only.
                lengths = [caches[index].length for index in range(*span)]
                for _ in range(per_round):
                    time.sleep(idle_gap_s)
                    start = time.perf_counter()
                    run()
                    idle_compute[span].append((time.perf_counter() - start) * 1e3)
                    for index, length in zip(range(*span), lengths, strict=True):
                        caches[index].rollback(length)

        pipes: list[float] = []

        def pipes_round() -> None:
            for _ in range(per_round):
                x = torch.randn(1, 1, hidden_size)
                start = time.perf_counter()
                chain.step(x)
                pipes.append((time.perf_counter() - start) * 1e3)

        def raw_round() -> None:
            for name, values in trio.from_thread.run(
                _raw_steps, swarm, spans, hidden_size, per_round, idle_gap_s
            ).items():
                raw.setdefault(name, []).extend(values)

        timings = interleaved(
            calls,
            warmup=warmup,
            rounds=rounds,
            per_round=per_round,
            each_round=[raw_round, idle_compute_round, pipes_round],
        )
        cpu_swarm = cpu_local = None
        if schedstat_available():
            processes = {"client": os.getpid()}
            for span, server in zip(spans, swarm.servers, strict=True):
                processes[f"server {span[0]}:{span[1]}"] = server.process.pid
            cpu_swarm = cpu_per_token(
                decode_swarm, processes, rounds=cpu_rounds, per_round=per_round
            )
            cpu_local = cpu_per_token(
                decode_local, {"local": os.getpid()}, rounds=cpu_rounds, per_round=per_round
            )
    return DecodeResults(
        decode_swarm=timings["decode_swarm"],
        decode_local=timings["decode_local"],
        prefill_swarm=prefills["swarm"],
        prefill_local=prefills["local"],
        session_step=timings["session_step"],
        compute=tuple(timings[f"compute {span}"] for span in spans),
        raw_step=tuple(Timing(samples_ms=tuple(raw[f"step {span}"])) for span in spans),
        empty_step=tuple(Timing(samples_ms=tuple(raw[f"empty {span}"])) for span in spans),
        idle_step=tuple(Timing(samples_ms=tuple(raw[f"idle {span}"])) for span in spans),
        idle_compute=tuple(Timing(samples_ms=tuple(idle_compute[span])) for span in spans),
        idle_gap_s=idle_gap_s,
        pipes=Timing(samples_ms=tuple(pipes)),
        cpu_swarm=cpu_swarm,
        cpu_local=cpu_local,
    )


async def _raw_steps(
    swarm: LocalSwarm,
    spans: Sequence[tuple[int, int]],
    hidden_size: int,
    steps: int,
    idle_gap_s: float,
) -> dict[str, list[float]]:
    """One round of raw ``petals.inference`` steps to each server (the server holding exactly
    each span), one and zero tokens back to back, and one token after ``idle_gap_s`` of silence,
    from a bare transport node; samples in ms."""
    samples: dict[str, list[float]] = {}
    async with open_node() as node:
        for span, server in zip(spans, swarm.servers, strict=True):
            connection = await node.connect(server.address)
            async with open_call(connection, INFERENCE) as call:
                await call.send(
                    {"session_id": os.urandom(8).hex(), "blocks": list(span), "max_length": 256}
                )
                if not (await call.receive()).get("ready"):
                    raise RuntimeError(f"server {server.address} did not open a session")
                await call.send({"hidden_states": torch.randn(1, 8, hidden_size)})
                await call.receive()
                for tokens, name in ((1, "step"), (0, "empty"), (1, "idle")):
                    values = samples.setdefault(f"{name} {span}", [])
                    for index in range(steps + 2):
                        message = {
                            "hidden_states": torch.randn(1, tokens, hidden_size),
                            "start_from_position": 8,
                        }
                        if name == "idle":
                            # Not waiting for anything: the silence itself is what is measured.
                            await trio.sleep(idle_gap_s)
                        start = time.perf_counter()
                        await call.send(message)
                        await call.receive()
                        if index >= 2:  # two warm-up steps
                            values.append((time.perf_counter() - start) * 1e3)
                await call.send_eof()
    return samples


def breakdown_rows(
    results: DecodeResults, spans: Sequence[tuple[int, int]]
) -> list[tuple[Any, ...]]:
    """Where a swarm decode token's time goes (medians, ms), as rows (part, ms, note)."""
    rows: list[tuple[Any, ...]] = [
        ("transformers locally, whole model", results.decode_local.median_ms, "the reference"),
    ]
    compute = sum(t.median_ms for t in results.compute)
    raw = sum(t.median_ms for t in results.raw_step)
    gap_ms = f"{results.idle_gap_s * 1e3:g} ms"
    for span, part, asleep, step, empty, idle in zip(
        spans,
        results.compute,
        results.idle_compute,
        results.raw_step,
        results.empty_step,
        results.idle_step,
        strict=True,
    ):
        label = f"blocks {span[0]}:{span[1]}"
        rows += [
            (f"{label}: our blocks in this process", part.median_ms, "server compute"),
            (
                f"{label}: the same right after {gap_ms} asleep",
                asleep.median_ms,
                f"{asleep.median_ms - part.median_ms:+.2f}: the machine's own cost of idling",
            ),
            (f"{label}: raw empty step (0 tokens)", empty.median_ms, "transport + handler"),
            (f"{label}: raw 1-token step", step.median_ms, f"p90 {step.p90_ms:.2f}"),
            (
                f"{label}: raw step - compute - empty step",
                step.median_ms - part.median_ms - empty.median_ms,
                "task pool, thread hand-off, scheduling",
            ),
            (
                f"{label}: raw 1-token step after {gap_ms} idle",
                idle.median_ms,
                f"{idle.median_ms - step.median_ms:+.2f}: what idling between steps costs",
            ),
        ]
    session = results.session_step.median_ms
    model = results.decode_swarm.median_ms
    rows += [
        ("our blocks, all spans, in this process", compute, "compute floor"),
        (
            f"our blocks, all spans, each after {gap_ms} asleep",
            sum(t.median_ms for t in results.idle_compute),
            "the floor for servers that idle",
        ),
        (
            f"our blocks in {len(spans)} processes, passed on pipes",
            results.pipes.median_ms,
            "the process split alone: no transport, codec or client",
        ),
        ("raw 1-token steps, all spans", raw, "sum of per-server round trips"),
        (
            "raw 1-token steps after idling, all spans",
            sum(t.median_ms for t in results.idle_step),
            "the same, as chained servers run them",
        ),
        ("client session.step (sync, all hops)", session, f"{session - raw:+.2f} over raw steps"),
        ("model(token) in a session", model, f"{model - session:+.2f} over session.step"),
    ]
    swarm_cpu, local_cpu = results.cpu_swarm, results.cpu_local
    if swarm_cpu is not None and local_cpu is not None:
        rows.append(("CPU accounting (separate run of decode tokens):", None, None))
        rows.append(("  local: wall per token", local_cpu.wall_ms, None))
        rows.append(("  local: CPU per token", local_cpu.total_cpu_ms, "this process"))
        rows.append(("  local: run-queue wait per token", local_cpu.wait_ms, "waiting for a CPU"))
        rows.append(("  swarm: wall per token", swarm_cpu.wall_ms, None))
        for name, cpu_ms in swarm_cpu.cpu_ms.items():
            rows.append((f"  swarm: CPU per token, {name}", cpu_ms, "all its threads"))
        rows.append(
            (
                "  swarm: CPU per token, all processes",
                swarm_cpu.total_cpu_ms,
                f"{swarm_cpu.total_cpu_ms / local_cpu.total_cpu_ms:.2f}x local CPU",
            )
        )
        rows.append(
            (
                "  swarm: run-queue wait per token, all",
                swarm_cpu.wait_ms,
                "waiting for a CPU (busy machine)",
            )
        )
    return rows


# -- ptune ------------------------------------------------------------------------------------


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
    from petals_core.models.distributed import AutoDistributedModelForCausalLM

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


# -- this benchmark ---------------------------------------------------------------------------


def _save(family: str, folder: Path) -> str:
    """A random tiny model of ``family`` saved under ``folder``; its path."""
    torch.manual_seed(0)
    model: PreTrainedModel
    if family == "llama":
        config = LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=4 * HIDDEN,
            num_hidden_layers=BLOCKS,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=1024,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(config)
    else:
        model = BloomForCausalLM(
            BloomConfig(hidden_size=HIDDEN, n_layer=BLOCKS, n_head=4, vocab_size=VOCAB)
        )
    path = folder / family
    model.save_pretrained(path)
    return str(path)


def server_args(span: tuple[int, int], **flags: object) -> list[str]:
    """Flags of a benchmark server: fixed blocks, fp32 on CPU, one thread, nothing measured."""
    return fixed_server_args(span, log_level="WARNING", **flags)


@attrs.frozen(kw_only=True)
class FamilyResults:
    decode: DecodeResults
    ptune_swarm: Timing
    ptune_local: Timing


def _measure_family(folder: str, swarm: LocalSwarm) -> FamilyResults:
    from transformers import AutoModelForCausalLM

    from petals_core.models.distributed import AutoDistributedModelForCausalLM

    kwargs = {"initial_peers": swarm.initial_peers, "request_timeout": 60.0}
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


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or deprecation chatter from transformers in the tables."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(verbosity)


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = load_note()
    rows: list[tuple[Any, ...]] = []
    results: dict[str, Any] = {}
    with quiet_transformers(), tempfile.TemporaryDirectory(prefix="bench-inference-") as temp:
        for family in ("llama", "bloom"):
            measured = trio.run(_run_family, family, Path(temp))
            d = measured.decode
            rows += [
                ratio_row(
                    family,
                    "decode ms/token (median)",
                    d.decode_swarm.median_ms,
                    d.decode_local.median_ms,
                    DECODE_TARGET,
                ),
                ratio_row(
                    family,
                    "decode ms/token (p90)",
                    d.decode_swarm.p90_ms,
                    d.decode_local.p90_ms,
                    None,
                ),
                ratio_row(
                    family,
                    f"prefill {PREFILL} tokens ms",
                    d.prefill_swarm.median_ms,
                    d.prefill_local.median_ms,
                    None,
                ),
                ratio_row(
                    family,
                    f"ptune step {PTUNE_BATCH}x{PTUNE_LENGTH} ms",
                    measured.ptune_swarm.median_ms,
                    measured.ptune_local.median_ms,
                    PTUNE_TARGET,
                ),
            ]
            summarize(
                "inference",
                f"{family} tiny, decode ms/token (median), swarm vs local",
                d.decode_swarm.median_ms,
                d.decode_local.median_ms,
                target=f"<= {DECODE_TARGET}x",
                met=d.decode_swarm.median_ms <= DECODE_TARGET * d.decode_local.median_ms,
            )
            summarize(
                "inference",
                f"{family} tiny, ptune step {PTUNE_BATCH}x{PTUNE_LENGTH}, swarm vs local",
                measured.ptune_swarm.median_ms,
                measured.ptune_local.median_ms,
                target=f"<= {PTUNE_TARGET}x",
                met=measured.ptune_swarm.median_ms <= PTUNE_TARGET * measured.ptune_local.median_ms,
            )
            print_table(
                f"inference, {family}: where a swarm decode token's time goes (medians)",
                ["part", "ms", "note"],
                breakdown_rows(d, SPANS),
            )
            results[family] = {
                "decode_swarm": d.decode_swarm.summary(),
                "decode_local": d.decode_local.summary(),
                "prefill_swarm": d.prefill_swarm.summary(),
                "prefill_local": d.prefill_local.summary(),
                "session_step": d.session_step.summary(),
                "compute_per_span": [t.summary() for t in d.compute],
                "raw_step_per_span": [t.summary() for t in d.raw_step],
                "empty_step_per_span": [t.summary() for t in d.empty_step],
                "idle_step_per_span": [t.summary() for t in d.idle_step],
                "idle_compute_per_span": [t.summary() for t in d.idle_compute],
                "pipes": d.pipes.summary(),
                "idle_gap_ms": d.idle_gap_s * 1e3,
                "cpu_swarm": None if d.cpu_swarm is None else d.cpu_swarm.summary(),
                "cpu_local": None if d.cpu_local is None else d.cpu_local.summary(),
                "ptune_swarm": measured.ptune_swarm.summary(),
                "ptune_local": measured.ptune_local.summary(),
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
            "load": {"before": load_before, "after": load_after},
            "results": results,
        },
    )
