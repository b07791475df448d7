"""The whole run of the demo (:func:`run_demo`) and its command line (:func:`main`)."""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import signal
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TextIO

import trio

from .._errors import PetalsError
from .._groups import single_error
from ._config import SMOLLM2, DemoConfig, DemoResult, short_peer_id, split_blocks
from ._model import (
    decode,
    encode_prompt,
    generate,
    generation_settings,
    load_hf_config,
    resolve_model,
    timed_streamer,
)
from ._swarm import run_in_swarm, say, stop_on_signals


def _child_pids() -> set[int]:
    """The PIDs of this process's children (Linux's /proc; elsewhere none are found)."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(word) for word in Path(path).read_text().split())
    return pids


def _stop_leftover_children(before: set[int], timeout_s: float = 20.0) -> None:
    """SIGTERM the children started since ``before`` was taken and wait for them; SIGKILL
    those still running after ``timeout_s``."""
    leftovers = _child_pids() - before
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for pid in leftovers:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                break  # already reaped
            if done:
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                break
            time.sleep(0.05)


def run_demo(config: DemoConfig, *, out: TextIO | None = None) -> DemoResult:
    """Run the demo (see :mod:`petals_core.demo`), writing what it does to ``out`` (stdout)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    out = sys.stdout if out is None else out
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would break up the output
    is_smollm2 = config.model.lower() == SMOLLM2
    say(
        out,
        "Preparing SmolLM2-135M-Instruct (the first time: about 20 s) ..."
        if is_smollm2
        else f"Loading the config of {config.model} ...",
    )
    model = resolve_model(config.model)
    say(out, f"Model {model.repo}: {model.num_blocks} blocks, swarm prefix {model.dht_prefix!r}")
    spans = split_blocks(model.num_blocks, config.servers)
    tokenizer = AutoTokenizer.from_pretrained(model.repo, local_files_only=model.local_files_only)
    prompt_ids = encode_prompt(tokenizer, config.prompt)  # (1, T)
    model_config = load_hf_config(model)
    settings = generation_settings(tokenizer, model_config, config.max_new_tokens)

    children = _child_pids()
    try:
        swarm_run = trio.run(
            stop_on_signals,
            partial(run_in_swarm, config, model, spans, tokenizer, prompt_ids, settings, out),
            out,
        )
    finally:
        # open_local_swarm stops the processes it knows; one still starting when the start was
        # cancelled (Ctrl-C, SIGTERM, the start timeout) is not among them yet.
        _stop_leftover_children(children)

    say(out, "Running the same model locally (transformers) ...")
    local = AutoModelForCausalLM.from_pretrained(
        model.repo, dtype=torch.float32, local_files_only=model.local_files_only
    ).eval()
    local_generation = generate(local, prompt_ids, settings, timed_streamer(tokenizer, None))
    del local

    swarm = swarm_run.generation
    result = DemoResult(
        prompt_ids=tuple(int(t) for t in prompt_ids[0].tolist()),
        swarm_ids=swarm.ids,
        local_ids=local_generation.ids,
        swarm_answer=decode(tokenizer, list(swarm.ids), skip_special_tokens=True),
        local_answer=decode(tokenizer, list(local_generation.ids), skip_special_tokens=True),
        route=swarm_run.route,
        swarm_ms_per_token=swarm.ms_per_token,
        local_ms_per_token=local_generation.ms_per_token,
        swarm_first_token_ms=swarm.first_token_ms,
        local_first_token_ms=local_generation.first_token_ms,
        swarm_start_s=swarm_run.start_s,
    )
    _report(result, out)
    return result


def _report(result: DemoResult, out: TextIO) -> None:
    hops = " => ".join(
        f"{hop.name} {short_peer_id(hop.peer_id)} [{hop.start}:{hop.end}]" for hop in result.route
    )
    say(out, f"\nRoute: client => {hops} => client")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    tokens = len(result.swarm_ids)
    say(out, f"{'':<20} {'ms/token (decode, median)':>26} {'first token ms':>15} {'tokens':>7}")
    say(
        out,
        f"{'through the swarm':<20} {ms(result.swarm_ms_per_token):>26} "
        f"{result.swarm_first_token_ms:>15.1f} {tokens:>7}",
    )
    say(
        out,
        f"{'locally':<20} {ms(result.local_ms_per_token):>26} "
        f"{result.local_first_token_ms:>15.1f} {len(result.local_ids):>7}",
    )
    if result.identical:
        say(out, "The two answers are identical, token for token.")
    else:
        pairs = zip(result.swarm_ids, result.local_ids, strict=False)
        first = next(
            (i for i, (a, b) in enumerate(pairs) if a != b),
            min(len(result.swarm_ids), len(result.local_ids)),
        )
        say(out, f"The answers DIFFER from generated token {first} on.")
        say(out, f"Locally: {result.local_answer}")


def _parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.demo",
        description="The main job on a real model: a question answered by a swarm of processes "
        "on this machine.",
    )
    parser.add_argument("--prompt", default=defaults.prompt, help="the question to ask")
    parser.add_argument(
        "--servers",
        type=int,
        default=defaults.servers,
        help=f"servers to start; the blocks are split evenly (default: {defaults.servers})",
    )
    parser.add_argument(
        "--model",
        default=defaults.model,
        help="'smollm2' (default), a Hugging Face repo id or a local checkpoint folder "
        "with a tokenizer (LLaMA, BLOOM, Falcon or Mixtral)",
    )
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=defaults.max_new_tokens,
        help=f"longest answer, in tokens (default: {defaults.max_new_tokens})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit code (0, 1 for an error, 130 when interrupted)."""
    args = _parser().parse_args(argv)
    began = time.perf_counter()
    try:
        config = DemoConfig(
            model=args.model,
            prompt=args.prompt,
            servers=args.servers,
            max_new_tokens=args.max_new_tokens,
        )
        run_demo(config)
    except BaseException as raised:
        error = single_error(raised)
        if isinstance(error, KeyboardInterrupt):
            print("\ninterrupted: every process the demo started is stopped", file=sys.stderr)
            return 130
        if isinstance(error, (PetalsError, OSError, RuntimeError)):
            print(f"error: {error}", file=sys.stderr)
            return 1
        raise
    print(f"Demo done in {time.perf_counter() - began:.1f} s.")
    return 0
