"""Failover at scale: greedy generations and fine-tuning steps while servers die or stall.

A loopback swarm of real processes (a bootstrap DHT node and four servers of a tiny 8-block
LLaMA, or Falcon or Mixtral with ``--family``, spans 0:4, 4:8, 0:6 and 2:8: every block is held at
least twice) serves a client that
uses the model classes (``AutoDistributedModelForCausalLM``), as a user would.

- First, every prompt is generated without faults (``generate(max_new_tokens=16)``, greedy): the
  reference.  It is also compared with transformers' own model run locally.
- Then each prompt again, with one fault at a random step of its generation (chosen by a
  seeded ``random.Random``): a custom ``LogitsProcessor`` (called once per generated token, in
  the generation's thread) calls into the trio program, which picks a random server of the
  session's current route and either kills it (SIGKILL: it vanishes without closing anything)
  or stops it (SIGSTOP: it holds its connections open and answers nothing; only the client's
  ``request_timeout_s`` finds it).  A killed server is replaced by a new process with the same
  span (``swarm.add_server``), so that every block is held twice again for the next fault; a
  stopped one is resumed (SIGCONT) after the generation.
- Fine-tuning steps (p-tuning: trainable prompts, remote forward and backward): the forward
  runs, a random server of the forward's route is killed, then the backward runs.  The step
  must give the loss and prompt gradients of the same step without faults.

What is lost: nothing.  Every generation either equals its reference or raises a
:class:`~petals_core.PetalsError` with a message naming the cause; both are counted, and so is
anything else (a wrong token, another exception): that is a lost session, a bug.

Run at full size (``nox -s chaos``)::

    python -m tests.chaos.chaos_run --generations 20

(``--stalls N`` generations with a stall, default as many as ``--generations``; ``--finetune N``
steps; ``--seed``).  It prints one line per generation and a summary, and exits 1 unless every
session completed with the reference's output (``--allow-errors``: unless none was lost).
The CI-sized run is ``tests/chaos/test_chaos.py``.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import attrs
import torch
import trio
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    PretrainedConfig,
)

from petals_core import PetalsError
from petals_core.client import RemoteSequenceManager
from petals_core.dht import PeerTableSnapshot
from petals_core.distributed import AutoDistributedModelForCausalLM
from petals_core.testing import (
    LocalSwarm,
    SwarmProcess,
    fixed_server_args,
    open_local_swarm,
    tiny_falcon_config,
    tiny_llama_config,
    tiny_mixtral_config,
)

from ._report import ChaosConfig, ChaosReport, Fault, Outcome, Result

__all__ = [
    "ChaosConfig",
    "Fault",
    "Result",
    "ChaosHarness",
    "ChaosReport",
    "Outcome",
    "StepResult",
    "classify_error",
    "compare_steps",
    "finetune_step",
    "generate_with_fault",
    "load_client",
    "make_checkpoint",
    "manager_of",
    "open_harness",
    "prompt_ids",
    "run_chaos",
]

N_BLOCKS: Final = 8
HIDDEN: Final = 64
VOCAB: Final = 256
PREFIX: Final = "tiny-llama-chaos"
#: Every block is held by at least two servers: one kill never leaves a block without one.
SPANS: Final[tuple[tuple[int, int], ...]] = ((0, 4), (4, 8), (0, 6), (2, 8))
#: Trainable prompt positions of the fine-tuning model.
PROMPT_LEN: Final = 3
#: Loss and gradients of a step with a failover equal those without, up to this.
GRAD_ATOL: Final = 1e-5

Log = Callable[[str], None]
#: What a faulted session returns beside its victim (tokens, or a fine-tuning step's result).
_Got = TypeVar("_Got")


# --- the model and the swarm ------------------------------------------------------------------


def make_checkpoint(folder: Path, *, seed: int = 0, family: str = "llama") -> Path:
    """A tiny LLaMA (8 blocks, hidden 64, grouped-query attention), Falcon (Falcon-7B's layout) or
    Mixtral (8 experts, top 2) of the same size, with seeded random weights, saved in about one
    shard per block."""
    torch.manual_seed(seed)
    size = {"num_hidden_layers": N_BLOCKS, "vocab_size": VOCAB, "pad_token_id": 0}
    config: PretrainedConfig
    if family == "mixtral":
        config = tiny_mixtral_config(intermediate_size=HIDDEN, **size)
    elif family == "falcon":
        config = tiny_falcon_config(
            num_attention_heads=4,
            num_kv_heads=None,
            multi_query=True,
            parallel_attn=True,
            new_decoder_architecture=False,
            **size,
        )
    else:
        config = tiny_llama_config(**size)
    assert config.hidden_size == HIDDEN
    AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="100KB")
    return folder


def server_args(span: tuple[int, int], cache_dir: Path) -> list[str]:
    """Flags of a server of the chaos swarm: fixed span, nothing measured, quick to announce;
    an announcement expires after 8 s, so that a killed server leaves the peer table soon."""
    return fixed_server_args(
        span,
        update_period=2,
        expiration=8,
        dht_prefix=PREFIX,
        request_timeout=30,
        step_timeout=60,
        cache_dir=cache_dir,
    )


def client_options(initial_peers: Sequence[str], request_timeout_s: float | None) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of the chaos client: the default timeouts (unless
    ``request_timeout_s`` is given), short bans, quick retries, a bounded number of them (so
    that a hopeless session ends with an error)."""
    timeouts = {} if request_timeout_s is None else {"request_timeout_s": request_timeout_s}
    return {
        "initial_peers": tuple(initial_peers),
        "dht_prefix": PREFIX,
        "torch_dtype": torch.float32,
        **timeouts,
        "ban_timeout_s": 2.0,
        "min_backoff_s": 0.05,
        "max_backoff_s": 0.5,
        "update_period_s": 1.0,
        "max_retries": 10,
        "show_route": False,
    }


def peer_id_of(process: SwarmProcess) -> str:
    return process.address.rsplit("/p2p/", 1)[1]


class _AtStep(LogitsProcessor):
    """Calls ``action`` once, when the ``step``-th token (from 0) has been scored; leaves the
    scores alone, so that greedy generation picks the same tokens."""

    def __init__(self, step: int, action: Callable[[], None]) -> None:
        self.step = step
        self.calls = 0
        self._action = action
        self.struck_at: float | None = None
        #: From the action to the next token scored.
        self.recovery_s: float | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.calls == self.step:
            self._action()
            self.struck_at = time.monotonic()
        elif self.calls == self.step + 1 and self.struck_at is not None:
            self.recovery_s = time.monotonic() - self.struck_at
        self.calls += 1
        return scores


@attrs.define(eq=False)
class ChaosHarness:
    """The swarm of a run and what faults it: which process (by PeerID) holds which span, kills
    with restarts, stalls with resumption, and the wait until the client sees every live server.

    Create with :func:`open_harness`.  Methods run on the trio loop.
    """

    swarm: LocalSwarm
    folder: Path
    cache_dir: Path
    _nursery: trio.Nursery
    rng: random.Random
    log: Log
    #: Live servers: PeerID -> (process, span).
    alive: dict[str, tuple[SwarmProcess, tuple[int, int]]] = attrs.field(init=False, factory=dict)
    #: Servers never killed (the soak keeps some for the whole run, to watch their memory).
    protected: set[str] = attrs.field(init=False, factory=set)
    kills: int = attrs.field(init=False, default=0)
    stalls: int = attrs.field(init=False, default=0)
    restarts: int = attrs.field(init=False, default=0)
    _restarting: int = attrs.field(init=False, default=0)
    _restarted: trio.Event = attrs.field(init=False, factory=trio.Event)

    async def add(self, span: tuple[int, int]) -> str:
        process = await self.swarm.add_server(str(self.folder), server_args(span, self.cache_dir))
        peer = peer_id_of(process)
        self.alive[peer] = (process, span)
        return peer

    def kill(self, peer: str) -> None:
        """SIGKILL ``peer`` and start a replacement with the same span (in the background)."""
        process, span = self.alive.pop(peer)
        process.kill()
        self.kills += 1
        self._restarting += 1
        self._nursery.start_soon(self._restart, span)

    async def _restart(self, span: tuple[int, int]) -> None:
        try:
            peer = await self.add(span)
            self.restarts += 1
            self.log(f"  restarted blocks {span[0]}:{span[1]} as {peer[-6:]}")
        finally:
            self._restarting -= 1
            self._restarted.set()
            self._restarted = trio.Event()

    def stop(self, peer: str) -> SwarmProcess:
        """SIGSTOP ``peer``: its connections stay open, it answers nothing."""
        process, _ = self.alive[peer]
        process.process.send_signal(signal.SIGSTOP)
        self.stalls += 1
        return process

    @staticmethod
    def resume(process: SwarmProcess) -> None:
        if process.alive:
            process.process.send_signal(signal.SIGCONT)

    def choose_victim(self, route: set[str], fault: Fault = "kill") -> str | None:
        """A random live server of ``route``; kills spare the ``protected`` ones (then, if the
        route holds only those, another live server is killed)."""
        candidates = route & set(self.alive)
        if fault == "kill":
            candidates -= self.protected
            if not candidates:
                candidates = set(self.alive) - self.protected
        return self.rng.choice(sorted(candidates)) if candidates else None

    def settled(self, managers: Sequence[RemoteSequenceManager]) -> bool:
        """Whether :meth:`settle` would return at once."""
        return not self._restarting and all(
            set(manager.servers()) == set(self.alive) for manager in managers
        )

    async def settle(self, managers: Sequence[RemoteSequenceManager]) -> None:
        """Wait until every replacement serves and each manager can use exactly the live
        servers (dead ones expired from its peer table, bans of stalled ones over)."""
        while self._restarting:
            await self._restarted.wait()
        for manager in managers:
            topic = manager.state.topic
            assert topic is not None, "the manager's network part must run"
            while set(manager.servers()) != set(self.alive):
                # Bans end with time, not with a new snapshot: look again at least every 0.25 s.
                with trio.move_on_after(0.25):
                    await topic.wait_snapshot(_newer_than(topic.snapshot().version))

    async def stop_all(self) -> None:
        """End the run: servers are killed (a graceful leave takes seconds each, and is tested
        elsewhere), then the bootstrap node is stopped."""
        for process in self.swarm.servers:
            process.kill()
            self.resume(process)
        for process in self.swarm.servers:
            await process.process.wait()
        await self.swarm.bootstrap.stop()


def _newer_than(version: int) -> Callable[[PeerTableSnapshot], bool]:
    return lambda snapshot: snapshot.version > version


@asynccontextmanager
async def open_harness(
    work_dir: Path,
    *,
    seed: int,
    log: Log,
    spans: Sequence[tuple[int, int]] = SPANS,
    family: str = "llama",
) -> AsyncIterator[ChaosHarness]:
    """A checkpoint of ``family`` in ``work_dir`` and its swarm (servers started one after the
    other: on a small machine, starting them at once is slower)."""
    folder = make_checkpoint(work_dir / "checkpoint", seed=seed, family=family)
    cache_dir = work_dir / "cache"
    async with trio.open_nursery() as nursery, open_local_swarm(str(folder), []) as swarm:
        harness = ChaosHarness(swarm, folder, cache_dir, nursery, random.Random(seed), log)
        try:
            for span in spans:
                peer = await harness.add(span)
                log(f"server {peer[-6:]} holds blocks {span[0]}:{span[1]}")
            yield harness
        finally:
            with trio.CancelScope(shield=True):
                await harness.stop_all()
            nursery.cancel_scope.cancel()


def load_client(harness: ChaosHarness, request_timeout_s: float | None, **extra: Any) -> Any:
    """The distributed causal LM of the harness's swarm (its network part is not started)."""
    return AutoDistributedModelForCausalLM.from_pretrained(
        str(harness.folder),
        **client_options(harness.swarm.initial_peers, request_timeout_s),
        **extra,
    )


def manager_of(model: Any) -> RemoteSequenceManager:
    manager: RemoteSequenceManager = model.distributed_base.remote_blocks.sequence_manager
    return manager


# --- one session with a fault -----------------------------------------------------------------


def _greedy(model: Any, ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        output: torch.Tensor = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    return output


async def generate_with_fault(
    harness: ChaosHarness,
    model: Any,
    ids: torch.Tensor,
    *,
    max_new_tokens: int,
    fault: Fault | None,
    step: int,
) -> tuple[torch.Tensor, str | None, float | None]:
    """Greedy ``generate()`` in a worker thread; after token ``step`` is scored, ``fault``
    strikes a random server of the session's route.  Returns the tokens, the victim, and the
    seconds from the fault to the next token."""
    victims: list[str] = []
    stopped: list[SwarmProcess] = []

    def strike(session: Any) -> None:  # on the trio loop, while the generation waits
        route = session.route  # the session's chain of servers now
        if fault is None:
            return
        victim = harness.choose_victim({span.peer_id for span in route}, fault)
        if victim is None:
            return
        victims.append(victim)
        if fault == "kill":
            harness.kill(victim)
        else:
            stopped.append(harness.stop(victim))

    triggers: list[_AtStep] = []

    def run() -> torch.Tensor:
        max_length = ids.shape[1] + max_new_tokens
        with model.inference_session(max_length=max_length) as session:
            trigger = _AtStep(step, lambda: trio.from_thread.run_sync(strike, session))
            triggers.append(trigger)
            return _greedy(
                model, ids, max_new_tokens, logits_processor=LogitsProcessorList([trigger])
            )

    try:
        output = await trio.to_thread.run_sync(run)
    finally:
        for process in stopped:
            harness.resume(process)
    recovery = triggers[0].recovery_s if victims else None
    return output, victims[0] if victims else None, recovery


def classify_error(error: BaseException) -> tuple[Result, str]:
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, PetalsError) and str(error).strip():
        return "petals_error", message
    return "unexpected_error", message


def prompt_ids(index: int, length: int, seed: int, *, batch: int = 1) -> torch.Tensor:
    """Random token ids ``(batch, length)`` of prompt ``index`` of a run with ``seed``."""
    generator = torch.Generator().manual_seed(seed * 100_003 + index)
    return torch.randint(4, VOCAB, (batch, length), generator=generator)


@attrs.frozen(kw_only=True)
class StepResult:
    """The loss of a fine-tuning step and the gradient of its trainable prompts."""

    loss: torch.Tensor
    grad: torch.Tensor


async def finetune_step(
    harness: ChaosHarness, model: Any, ids: torch.Tensor, *, kill: bool
) -> tuple[StepResult, str | None]:
    """A p-tuning step (loss of ``ids`` as labels, backward to the prompts), in worker threads;
    with ``kill``, a random server of the forward's route is killed before the backward."""
    blocks = model.distributed_base.remote_blocks
    weight = model.distributed_base.prompt_embeddings.weight
    weight.grad = None
    outputs: list[torch.Tensor] = []
    hook = blocks.register_forward_hook(lambda module, args, output: outputs.append(output))
    try:
        loss = await trio.to_thread.run_sync(lambda: model(ids, labels=ids).loss)
    finally:
        hook.remove()
    victim = None
    if kill:
        # The remote forward's autograd node keeps, per row chunk, the spans it went through.
        saved = outputs[-1].grad_fn.saved  # type: ignore[union-attr]
        victim = harness.choose_victim({span.peer_id for chunk in saved for span, *_ in chunk})
        if victim is not None:
            harness.kill(victim)
    await trio.to_thread.run_sync(loss.backward)
    assert weight.grad is not None
    return StepResult(loss=loss.detach(), grad=weight.grad.detach().clone()), victim


# --- the run ----------------------------------------------------------------------------------


async def run_chaos(
    config: ChaosConfig, *, work_dir: Path | None = None, log: Log = print
) -> ChaosReport:
    """Run the chaos described in the module docstring; ``work_dir`` (default: a temporary
    folder) holds the checkpoint and the servers' cache."""
    torch.set_num_threads(1)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="petals-chaos-") as temporary:
        folder = work_dir if work_dir is not None else Path(temporary)
        with trio.fail_after(config.deadline_s):
            return await _run(config, folder, log, began)


async def _run(config: ChaosConfig, work_dir: Path, log: Log, began: float) -> ChaosReport:
    rng = random.Random(config.seed)
    kill: Fault = "kill"
    stall: Fault = "stall"
    faults = [kill] * config.generations + [stall] * config.stalls
    rng.shuffle(faults)
    outcomes: list[Outcome] = []
    async with (
        open_harness(work_dir, seed=config.seed, log=log, family=config.family) as harness,
        AsyncExitStack() as stack,
    ):
        model = load_client(harness, config.request_timeout_s)
        await stack.enter_async_context(model.distributed_base.remote_blocks)
        managers = [manager_of(model)]
        tuned = None
        if config.finetune_steps:
            torch.manual_seed(config.seed)
            tuned = load_client(
                harness, config.request_timeout_s, tuning_mode="ptune", pre_seq_len=PROMPT_LEN
            )
            await stack.enter_async_context(tuned.distributed_base.remote_blocks)
            managers.append(manager_of(tuned))
        await harness.settle(managers)

        # References: every session without faults (and the generations run locally).
        prompts = [prompt_ids(i, config.prompt_tokens, config.seed) for i in range(len(faults))]
        references = [
            (
                await generate_with_fault(
                    harness, model, ids, max_new_tokens=config.max_new_tokens, fault=None, step=0
                )
            )[0]
            for ids in prompts
        ]
        local = AutoModelForCausalLM.from_pretrained(str(harness.folder)).eval()
        equal_local = sum(
            torch.equal(_greedy(local, ids, config.max_new_tokens), reference)
            for ids, reference in zip(prompts, references, strict=True)
        )
        log(f"references: {equal_local}/{len(references)} equal transformers' local generation")
        step_ids = [
            prompt_ids(10_000 + i, config.prompt_tokens, config.seed, batch=2)
            for i in range(config.finetune_steps)
        ]
        step_references = []
        if tuned is not None:
            for ids in step_ids:
                step_references.append((await finetune_step(harness, tuned, ids, kill=False))[0])

        # Sessions with faults.
        for index, (fault, ids) in enumerate(zip(faults, prompts, strict=True)):
            await harness.settle(managers)
            step = rng.randrange(config.max_new_tokens - 1)
            generate = functools.partial(
                generate_with_fault,
                harness,
                model,
                ids,
                max_new_tokens=config.max_new_tokens,
                fault=fault,
                step=step,
            )
            judge = functools.partial(compare_tokens, expected=references[index])
            outcome = await faulted_outcome("generation", index, fault, step, generate, judge)
            outcomes.append(outcome)
            log(outcome.line())
        if tuned is not None:
            for index, (ids, expected) in enumerate(zip(step_ids, step_references, strict=True)):
                await harness.settle(managers)
                outcome = await faulted_outcome(
                    "finetune",
                    index,
                    "kill",
                    -1,
                    functools.partial(finetune_step, harness, tuned, ids, kill=True),
                    functools.partial(compare_steps, expected=expected),
                )
                outcomes.append(outcome)
                log(outcome.line())
        report = ChaosReport(
            outcomes=tuple(outcomes),
            references_equal_local=equal_local,
            references=len(references),
            kills=harness.kills,
            stalls=harness.stalls,
            restarts=harness.restarts,
            seconds=time.monotonic() - began,
        )
    return report


async def faulted_outcome(
    kind: Literal["generation", "finetune"],
    index: int,
    fault: Fault,
    step: int,
    run: Callable[[], Awaitable[tuple[_Got, str | None] | tuple[_Got, str | None, float | None]]],
    judge: Callable[[_Got], tuple[Result, str]],
) -> Outcome:
    """What became of ``run()``, a session that ``fault`` strikes: ``judge`` of what it returned
    (beside the victim and, for a generation, the seconds from the fault to the next token), or
    what it raised."""
    started = time.monotonic()
    victim = None
    recovery: float | None = None
    try:
        got, victim, *rest = await run()
        recovery = rest[0] if rest else None
    except Exception as error:
        result, message = classify_error(error)
    else:
        result, message = judge(got)
    return Outcome(
        kind=kind,
        index=index,
        fault=fault,
        step=step,
        victim=victim,
        result=result,
        message=message,
        seconds=time.monotonic() - started,
        recovery_s=recovery,
    )


def compare_tokens(got: torch.Tensor, expected: torch.Tensor) -> tuple[Result, str]:
    return ("equal", "") if torch.equal(got, expected) else ("mismatch", f"got {got.tolist()}")


def compare_steps(got: StepResult, expected: StepResult) -> tuple[Result, str]:
    loss_diff = float((got.loss - expected.loss).abs())
    grad_diff = float((got.grad - expected.grad).abs().max())
    message = f"|d loss| {loss_diff:.2e}, max |d grad| {grad_diff:.2e}"
    if math.isfinite(grad_diff) and loss_diff <= GRAD_ATOL and grad_diff <= GRAD_ATOL:
        return "equal", message
    return "mismatch", message


# --- command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos.chaos_run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--generations", type=int, default=20, help="generations with a kill")
    parser.add_argument(
        "--stalls", type=int, default=None, help="generations with a stall (default: as many)"
    )
    parser.add_argument("--finetune", type=int, default=3, help="fine-tuning steps with a kill")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    parser.add_argument(
        "--request_timeout", type=float, default=None, help="the client's (default: the library's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("llama", "falcon", "mixtral"), default="llama")
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds for everything")
    parser.add_argument(
        "--allow-errors",
        action="store_true",
        help="succeed if no session was lost, even if some raised a clear PetalsError",
    )
    args = parser.parse_args(argv)
    config = ChaosConfig(
        generations=args.generations,
        stalls=args.generations if args.stalls is None else args.stalls,
        finetune_steps=args.finetune,
        max_new_tokens=args.max_new_tokens,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        family=args.family,
        deadline_s=args.deadline,
    )
    report = trio.run(run_chaos, config)
    print(report.summary())
    ok = report.lost == 0 if args.allow_errors else report.all_equal
    return 0 if ok and report.references_equal_local == report.references else 1


if __name__ == "__main__":
    sys.exit(main())
