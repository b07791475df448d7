"""Soak: continuous sessions with random faults, watching memory.

On the chaos swarm (``tests/chaos/chaos_run.py``: a bootstrap node and four server processes of
a tiny 8-block LLaMA, every block held twice), one client runs greedy generations, one after
the other, for ``--minutes``; every fifth session is a p-tuning step (forward and backward)
instead.  Faults come every ``--fault_period`` seconds on average (exponential gaps), each one
a server of the session's route killed (SIGKILL; a replacement with the same span starts at once,
while sessions go on) or stopped (SIGSTOP, until the session ends).  The first two servers
(blocks 0:4 and 4:8) are never killed, so that their memory is watched over the whole run.

Every ``--rss_period`` seconds it prints the resident memory (``VmRSS`` of
``/proc/<pid>/status``) of the client and of every live process of the swarm.  At the end: the
sessions by outcome, the errors by type, and per process its RSS first after warm-up
(``--warmup``, default a quarter of the run, at most 5 minutes) and last, with the change.
Replaced servers are new processes: each has its own line.

    python -m tests.chaos.soak --minutes 60

Exits 1 if a session was lost (a wrong output or an error other than a clear PetalsError).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Final

import attrs
import torch
import trio

from .chaos_run import (
    PROMPT_LEN,
    ChaosHarness,
    Fault,
    Outcome,
    Result,
    classify_error,
    compare_steps,
    compare_tokens,
    finetune_step,
    generate_with_fault,
    load_client,
    manager_of,
    open_harness,
    prompt_ids,
)

__all__ = ["RssSample", "SoakConfig", "SoakReport", "rss_bytes", "run_soak"]

#: Output lines of a swarm process kept in memory (the harness's own memory must stay flat).
KEPT_OUTPUT_LINES: Final = 200
N_PROMPTS: Final = 8


@attrs.frozen(kw_only=True)
class SoakConfig:
    duration_s: float
    warmup_s: float
    rss_period_s: float = 30.0
    #: Mean seconds between faults (exponentially distributed), each a kill or a stall.
    fault_period_s: float = 30.0
    finetune_every: int = 5
    max_new_tokens: int = 16
    prompt_tokens: int = 6
    request_timeout_s: float | None = None
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.duration_s > 0 or self.warmup_s < 0 or not self.rss_period_s > 0:
            raise ValueError("duration_s and rss_period_s must be positive, warmup_s >= 0")
        if not self.fault_period_s > 0:
            raise ValueError("fault_period_s must be positive")


@attrs.frozen(kw_only=True)
class RssSample:
    elapsed_s: float
    #: Process label (``client``, ``bootstrap``, ``server-3[pid]``) -> resident bytes.
    rss_bytes: dict[str, int]


@attrs.frozen(kw_only=True)
class SoakReport:
    sessions: int
    results: dict[str, int]
    errors: dict[str, int]
    kills: int
    stalls: int
    restarts: int
    samples: tuple[RssSample, ...]
    warmup_s: float
    seconds: float

    @property
    def lost(self) -> int:
        return self.results.get("mismatch", 0) + self.results.get("unexpected_error", 0)

    def memory_lines(self) -> list[str]:
        """Per process: RSS first after warm-up, last, and the change."""
        first: dict[str, tuple[float, int]] = {}
        last: dict[str, tuple[float, int]] = {}
        for sample in self.samples:
            if sample.elapsed_s < self.warmup_s:
                continue
            for label, nbytes in sample.rss_bytes.items():
                first.setdefault(label, (sample.elapsed_s, nbytes))
                last[label] = (sample.elapsed_s, nbytes)
        lines = []
        for label, (t0, rss0) in first.items():
            t1, rss1 = last[label]
            lines.append(
                f"  {label:22s} {_mib(rss0):8.1f} MiB at {t0:6.0f} s -> {_mib(rss1):8.1f} MiB "
                f"at {t1:6.0f} s ({_mib(rss1 - rss0):+.1f} MiB)"
            )
        return lines

    def summary(self) -> str:
        lines = [
            f"soak: {self.sessions} sessions in {self.seconds:.0f} s; kills {self.kills}, "
            f"stalls {self.stalls}, restarts {self.restarts}",
            "outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(self.results.items())),
            "errors by type: "
            + (", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"),
            f"lost sessions: {self.lost}",
            f"RSS first after warm-up ({self.warmup_s:.0f} s) and last, per process:",
            *self.memory_lines(),
        ]
        return "\n".join(lines)


def _mib(nbytes: int) -> float:
    return nbytes / (1 << 20)


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (``VmRSS``), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def _sample(harness: ChaosHarness, elapsed_s: float) -> RssSample:
    sizes: dict[str, int] = {}
    client = rss_bytes(os.getpid())
    if client is not None:
        sizes["client"] = client
    for process in [harness.swarm.bootstrap, *harness.swarm.servers]:
        # Keep only the end of each process's output: the harness's memory must stay flat.
        del process.output[:-KEPT_OUTPUT_LINES]
        if not process.alive:
            continue
        size = rss_bytes(process.process.pid)
        if size is not None:
            label = "bootstrap" if process is harness.swarm.bootstrap else process.name
            sizes[f"{label}[{process.process.pid}]"] = size
    return RssSample(elapsed_s=elapsed_s, rss_bytes=sizes)


def _print_sample(sample: RssSample) -> None:
    parts = " | ".join(f"{label} {_mib(n):.1f}" for label, n in sample.rss_bytes.items())
    print(f"[{sample.elapsed_s:6.0f} s] RSS MiB: {parts}", flush=True)


async def run_soak(config: SoakConfig, *, work_dir: Path | None = None) -> SoakReport:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="petals-soak-") as temporary:
        folder = work_dir if work_dir is not None else Path(temporary)
        # Starting the swarm and the references take a minute or two on a small machine.
        with trio.fail_after(config.duration_s + 600.0):
            return await _soak(config, folder)


async def _soak(config: SoakConfig, work_dir: Path) -> SoakReport:
    rng = random.Random(config.seed)
    results: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    samples: list[RssSample] = []

    def log(line: str) -> None:
        print(line, flush=True)

    async with (
        open_harness(work_dir, seed=config.seed, log=log) as harness,
        AsyncExitStack() as stack,
    ):
        model = load_client(harness, config.request_timeout_s)
        await stack.enter_async_context(model.distributed_base.remote_blocks)
        torch.manual_seed(config.seed)
        tuned = load_client(
            harness, config.request_timeout_s, tuning_mode="ptune", pre_seq_len=PROMPT_LEN
        )
        await stack.enter_async_context(tuned.distributed_base.remote_blocks)
        managers = [manager_of(model), manager_of(tuned)]
        await harness.settle(managers)
        # The first two servers (blocks 0:4 and 4:8) live through the whole run (they may be
        # stalled, not killed): their memory over time is what the soak watches.
        harness.protected = set(list(harness.alive)[:2])
        prompts = [prompt_ids(i, config.prompt_tokens, config.seed) for i in range(N_PROMPTS)]
        references = [
            (
                await generate_with_fault(
                    harness, model, ids, max_new_tokens=config.max_new_tokens, fault=None, step=0
                )
            )[0]
            for ids in prompts
        ]
        step_ids = prompt_ids(10_000, config.prompt_tokens, config.seed, batch=2)
        step_reference, _ = await finetune_step(harness, tuned, step_ids, kill=False)

        began = time.monotonic()
        deadline = began + config.duration_s

        async def watch_memory() -> None:
            while True:
                sample = _sample(harness, time.monotonic() - began)
                samples.append(sample)
                _print_sample(sample)
                await trio.sleep(config.rss_period_s)

        sessions = 0
        next_fault_s = rng.expovariate(1 / config.fault_period_s)
        async with trio.open_nursery() as watcher:
            watcher.start_soon(watch_memory)
            while time.monotonic() < deadline:
                # Sessions go on while a replacement starts; the next fault waits until every
                # block is held twice again (and the client sees it).
                fault: Fault | None = None
                if time.monotonic() - began >= next_fault_s and harness.settled(managers):
                    fault = rng.choice(["kill", "stall"])
                    next_fault_s = (
                        time.monotonic() - began + rng.expovariate(1 / config.fault_period_s)
                    )
                started = time.monotonic()
                result: Result
                try:
                    if sessions % config.finetune_every == config.finetune_every - 1:
                        kind = "finetune"
                        step = -1
                        if fault == "stall":  # stalls strike generations only
                            fault = None
                        got, victim = await finetune_step(
                            harness, tuned, step_ids, kill=fault == "kill"
                        )
                        result, message = compare_steps(got, step_reference)
                    else:
                        kind = "generation"
                        index = rng.randrange(N_PROMPTS)
                        step = rng.randrange(config.max_new_tokens - 1)
                        output, victim, _ = await generate_with_fault(
                            harness,
                            model,
                            prompts[index],
                            max_new_tokens=config.max_new_tokens,
                            fault=fault,
                            step=step,
                        )
                        result, message = compare_tokens(output, references[index])
                except Exception as error:
                    result, message = classify_error(error)
                    errors[type(error).__name__] += 1
                    victim = None
                if result == "mismatch":
                    errors["mismatch"] += 1
                results[result] += 1
                sessions += 1
                if fault is not None:
                    outcome = Outcome(
                        kind="finetune" if kind == "finetune" else "generation",
                        index=sessions,
                        fault=fault,
                        step=step,
                        victim=victim,
                        result=result,
                        message=message,
                        seconds=time.monotonic() - started,
                    )
                    log(outcome.line())
                elif result != "equal":
                    log(f"{kind} {sessions} (no fault): {result}: {message}")
            samples.append(_sample(harness, time.monotonic() - began))
            _print_sample(samples[-1])
            watcher.cancel_scope.cancel()
        report = SoakReport(
            sessions=sessions,
            results=dict(results),
            errors=dict(errors),
            kills=harness.kills,
            stalls=harness.stalls,
            restarts=harness.restarts,
            samples=tuple(samples),
            warmup_s=config.warmup_s,
            seconds=time.monotonic() - began,
        )
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--minutes", type=float, required=True, help="how long sessions run")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before the first RSS compared (default: a quarter of the run, <= 300)",
    )
    parser.add_argument("--rss_period", type=float, default=30.0, help="seconds between samples")
    parser.add_argument(
        "--fault_period", type=float, default=30.0, help="mean seconds between faults"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    duration_s = args.minutes * 60.0
    config = SoakConfig(
        duration_s=duration_s,
        warmup_s=min(300.0, duration_s / 4) if args.warmup is None else args.warmup,
        rss_period_s=args.rss_period,
        fault_period_s=args.fault_period,
        seed=args.seed,
    )
    report = trio.run(run_soak, config)
    print(report.summary())
    return 0 if report.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
