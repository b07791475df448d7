"""The swarm part of the demo: start the servers, answer through them, stop them, and stop on
SIGINT or SIGTERM by stopping what was started."""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TextIO, TypeVar

import attrs
import trio

from .._groups import raising_single_error
from .._local_swarm import LocalSwarm, SwarmProcess, fixed_server_args, open_local_swarm
from ._config import DemoConfig, RouteHop, short_peer_id
from ._model import Generation, Model, Stopped, generate, timed_streamer

T = TypeVar("T")

#: How long an interrupted demo waits for generate() to end before it stops the client anyway.
_STOP_WAIT_S: Final = 5.0


class Stopper:
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


@attrs.frozen(kw_only=True)
class SwarmRun:
    generation: Generation
    route: tuple[RouteHop, ...]
    start_s: float


async def run_in_swarm(
    config: DemoConfig,
    model: Model,
    spans: list[tuple[int, int]],
    tokenizer: Any,
    prompt_ids: Any,
    settings: dict[str, Any],
    out: TextIO,
    stopper: Stopper,
) -> SwarmRun:
    """Start the swarm, answer through it, stop it (whatever happens)."""
    say(
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
    say(out, "Stopping the swarm ...")
    began = time.perf_counter()
    with trio.CancelScope(shield=True):
        async with trio.open_nursery() as nursery:
            for process in running:
                nursery.start_soon(process.stop)
    say(out, f"(stopped in {time.perf_counter() - began:.1f} s)")


async def _start_servers(
    swarm: LocalSwarm, model: Model, spans: list[tuple[int, int]]
) -> list[SwarmProcess]:
    """Start one server per span, all at once (each loads its blocks in its own process); return
    them in the order of ``spans``."""
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
    model: Model,
    tokenizer: Any,
    prompt_ids: Any,
    settings: dict[str, Any],
    out: TextIO,
    swarm: LocalSwarm,
    servers: list[SwarmProcess],
    spans: list[tuple[int, int]],
    start_s: float,
    stopper: Stopper,
) -> SwarmRun:
    """Load the client, and generate through the swarm's servers (streaming the answer)."""
    from ..distributed import AutoDistributedModelForCausalLM

    names = {_peer_id(p.address): f"server-{i}" for i, p in enumerate(servers)}
    say(out, f"  bootstrap  pid {swarm.bootstrap.process.pid:<7} {swarm.bootstrap.address}")
    for i, (process, (start, end)) in enumerate(zip(servers, spans, strict=True)):
        say(
            out,
            f"  server-{i:<3} pid {process.process.pid:<7} blocks {start}:{end}  "
            f"{short_peer_id(_peer_id(process.address))}",
        )
    say(out, f"Swarm ready in {start_s:.1f} s. Loading the client (no blocks) ...")

    def load() -> Any:
        import torch

        return AutoDistributedModelForCausalLM.from_pretrained(
            model.repo,
            initial_peers=swarm.initial_peers,
            dht_prefix=model.dht_prefix,
            torch_dtype=torch.float32,
            local_files_only=model.local_files_only,
            request_timeout_s=config.request_timeout_s,
        ).eval()

    client = await trio.to_thread.run_sync(load, abandon_on_cancel=True)
    # The client's network part runs in this trio program; its sync calls (from generate(), in
    # a worker thread) use this loop.
    async with client.distributed_base.remote_blocks:
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def answer() -> tuple[Generation, list[Any]]:
            try:
                streamer = timed_streamer(tokenizer, out, stopper.requested)
                max_length = prompt_ids.shape[1] + config.max_new_tokens
                with client.inference_session(max_length=max_length) as session:
                    generation = generate(client, prompt_ids, settings, streamer)
                    return generation, _session_route(session)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    trio.from_thread.run_sync(done.set, trio_token=token)

        say(out, f"\nUser: {config.prompt}\nAssistant (through the swarm): ", end="")
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
    return SwarmRun(generation=generation, route=route, start_s=start_s)


def _session_route(session: Any) -> list[Any]:
    """The route (``RouteSpan``s) the session's steps went through last."""
    return list(session.route)


def _peer_id(address: str) -> str:
    return address.rsplit("/p2p/", 1)[-1]


async def stop_on_signals(fn: Callable[[Stopper], Awaitable[T]], out: TextIO) -> T:
    """Run ``await fn(stopper)``; SIGINT (Ctrl-C) or SIGTERM stops it (see :class:`Stopper`; a
    second signal cancels at once), so that it stops what it started; then raise
    KeyboardInterrupt.

    The signals are received as trio messages rather than trio's own KeyboardInterrupt, which
    would be raised in whichever task happens to run (a network task of the client, say) instead
    of stopping the whole.  Only in the main thread (elsewhere ``fn`` just runs).
    """
    stopper = Stopper()
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
                        say(out, f"\n{received[0]}: stopping ...")
                        nursery.start_soon(stopper.stop, nursery.cancel_scope)
                    else:
                        nursery.cancel_scope.cancel()

            async def work() -> None:
                try:
                    result.append(await fn(stopper))
                except Stopped:
                    if not received:
                        raise
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            nursery.start_soon(work)
    if received or not result:
        raise KeyboardInterrupt(received[0] if received else "cancelled")
    return result[0]


def say(out: TextIO, text: str, end: str = "\n") -> None:
    out.write(text + end)
    out.flush()
