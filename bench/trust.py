"""``python -m bench trust``: what checking answers costs, catches, and never gets wrong.

1. **Honest disagreement** (no network): what a check compares, computed here.  Blocks of
   SmolLM2-135M's shape (hidden 576, 9 heads over 3 key/value heads; ``BLOCKS`` of them, random
   weights of a trained model's scale), in float32, bfloat16 and float16: the answering server
   runs a session (a ``PREFILL``-token prefill, then one token at a time, KV cache) on one torch
   thread; the checker replays the span's inputs so far from position 0 on two threads, as a
   check does.  Each step is one checked answer, compared as the client compares them
   (:func:`petals_core.client._checks.disagreement`); the table gives the largest and the 99.9th
   percentile against the dtype's bound, and how many honest answers would have been reported
   (target: none in at least 10,000).
2. **A liar that lies on 1% of its answers**, under the default policy (each server's first 2
   answers checked, then 5% at random): ``TRIALS`` simulated servers, answers until the first
   checked lie, and lies that passed before it, drawn by the sequence manager's own policy.
3. **End to end** (in-process servers of a tiny random LLaMA, 6 blocks, hidden 64, fp32, one
   thread): greedy generation through ``AutoDistributedModelForCausalLM``, ``NEW_TOKENS`` new
   tokens, (a) on 3 honest servers, (b) with a 4th server that answers every forward, step and
   backward a fifth of its scale off and announces a higher speed (routes prefer it; a test
   double, not a server mode): first with ``verify="none"`` before anyone has reported it (what
   checks prevent), then with default settings: tokens and logits must equal (a)'s.  (c) Deep prompt
   tuning (``PTUNE_STEPS`` Adam steps, the liar also lying in gradients), on the honest swarm
   and beside the liar: losses and the trained prompts must equal.  (d) A client checking every
   forward catches the liar and publishes a fraud report; then a client that checks nothing
   (``verify="none"``) must ban the liar from that report (confirmed by two other servers) and
   generate (a)'s tokens.  Then the overhead
   of the default policy on the honest swarm, side by side with ``verify="none"``:
   ``OVERHEAD_ROUNDS`` generations of ``OVERHEAD_TOKENS`` tokens each (a session each, so about
   one in 20 is followed by a checking server), rounds alternating: ms per token (median of
   rounds) and the positions the servers computed in all.

Targets: 0 false reports in >= 10,000 honest answers; the liar caught and outputs equal with
default settings; the default policy's overhead at most 10% (ms/token, and the positions the
servers compute: a checked step replays the span's inputs so far, so this one grows with the
length of sessions).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio

from ._client import sequence_manager, wait_for_servers, wait_until
from ._report import percentile, print_table, summarize, summarize_ratio, write_json

BLOCKS = 2
PREFILL = 8
DECODE_STEPS = 15
SESSIONS = {"float32": 250, "bfloat16": 220, "float16": 160}
TRIALS = 1000
LIE_RATE = 0.01
NEW_TOKENS = 24
OVERHEAD_ROUNDS = 100
OVERHEAD_TOKENS = 8
LIE = 0.2
PTUNE_STEPS = 3
PTUNE_PROMPTS = 4
#: How long the client of (d) may take to read and judge the report.
REPORT_DEADLINE_S = 60.0


# -- 1. honest disagreement ----------------------------------------------------------------------


def _blocks(dtype: torch.dtype) -> list[Any]:
    from petals_core.models.llama import LlamaBlock
    from petals_core.testing import smollm2_135m_config

    config = smollm2_135m_config(num_hidden_layers=BLOCKS)
    blocks = []
    for index in range(BLOCKS):
        block = LlamaBlock(config, index)
        with torch.no_grad():
            for name, param in block.named_parameters():
                if "norm" in name:
                    param.copy_(1 + 0.1 * torch.randn(param.shape))
                else:
                    param.copy_(0.02 * torch.randn(param.shape))
        blocks.append(block.to(dtype).eval().requires_grad_(False))
    return blocks


def honest_disagreement(
    dtype_name: str, sessions: int, *, device: str = "cpu", check_device: str = "cpu"
) -> list[float]:
    """Each answer's disagreement with its check (see the module): the session runs on
    ``device`` (one thread on the CPU), the replays on ``check_device`` (two threads on the CPU),
    as two honest servers on different hardware compute them."""
    import copy

    from petals_core.client._checks import disagreement

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(1)
    rng = random.Random(dtype_name)
    made = _blocks(dtype)
    blocks = [block.to(device) for block in copy.deepcopy(made)]
    checkers = [block.to(check_device) for block in made]
    found = []
    length = PREFILL + DECODE_STEPS
    with torch.inference_mode():
        for _ in range(sessions):
            batch = rng.choice((1, 2))
            # Hidden states of a trained model's scale, a few large dimensions included.
            inputs = torch.randn(batch, length, 576)
            inputs[..., :4] *= 20
            inputs = inputs.to(dtype)
            torch.set_num_threads(1)
            caches = [block.allocate_cache(batch, length) for block in blocks]
            answers = []
            for start, end in [(0, PREFILL), *((t, t + 1) for t in range(PREFILL, length))]:
                x = inputs[:, start:end].to(device)
                for block, cache in zip(blocks, caches, strict=True):
                    x = block(x, cache=cache)
                answers.append((end, x.cpu()))
            torch.set_num_threads(2)
            for end, answer in answers:
                replay = inputs[:, :end].to(check_device)
                for block in checkers:
                    replay = block(replay, cache=block.allocate_cache(batch, end))
                found.append(disagreement(answer, replay[:, -answer.shape[1] :].cpu()))
    torch.set_num_threads(1)
    return found


# -- 2. a liar of 1% under the default policy -----------------------------------------------------


def caught_after(trials: int, lie_rate: float) -> tuple[list[int], list[int]]:
    """Per simulated liar: answers until its first checked lie, and lies unchecked before it."""
    from petals_core.client import RemoteSequenceManager, SequenceManagerConfig

    answers_until, passed = [], []
    rng = random.Random(7)
    for trial in range(trials):
        manager = RemoteSequenceManager(
            SequenceManagerConfig(dht_prefix="simulated"), 1, rng=random.Random(trial)
        )
        answers = lies = 0
        while True:
            answers += 1
            lying = rng.random() < lie_rate
            if manager.should_verify("liar"):
                if lying:
                    break
                manager.on_verified("liar")
            elif lying:
                lies += 1
        answers_until.append(answers)
        passed.append(lies)
    return answers_until, passed


# -- 3. end to end -------------------------------------------------------------------------------


class _Tokens:
    """Counts the positions (rows x tokens) the servers' inference steps compute."""

    def __init__(self, servers: list[Any]) -> None:
        self.count = 0
        for server in servers:
            self._count(server.backend)

    def _count(self, backend: Any) -> None:
        step, steps = backend.inference_step, backend.inference_steps

        def counted_step(start: int, end: int, hidden: torch.Tensor, *a: Any, **k: Any) -> Any:
            self.count += hidden.shape[0] * hidden.shape[1]
            return step(start, end, hidden, *a, **k)

        def counted_steps(start: int, end: int, items: Any, *a: Any, **k: Any) -> Any:
            self.count += sum(hidden.shape[0] * hidden.shape[1] for hidden, _ in items)
            return steps(start, end, items, *a, **k)

        backend.inference_step, backend.inference_steps = counted_step, counted_steps


async def _end_to_end(folder: Path) -> dict[str, Any]:
    from contextlib import AsyncExitStack

    from petals_core.server import ServerConfig, open_server
    from petals_core.testing import make_liar

    common: dict[str, Any] = {
        "model": str(folder),
        "host": "127.0.0.1",
        "torch_dtype": "float32",
        "quant_type": "none",
        "device": "cpu",
        "cache_dir": str(folder / "cache"),
    }
    # The honest servers announce a low speed and the liar a high one: routes prefer the liar
    # (as a cheat would arrange) even before the client has measured anyone.
    honest_speed = {"throughput": 0.1}
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            open_server(
                ServerConfig(new_swarm=True, block_indices=(0, 6), **honest_speed, **common)
            )
        )
        peers = tuple(str(address) for address in first.multiaddrs)
        servers = [first]
        for _ in range(2):
            servers.append(
                await stack.enter_async_context(
                    open_server(
                        ServerConfig(
                            initial_peers=peers, block_indices=(0, 6), **honest_speed, **common
                        )
                    )
                )
            )
        prefix = first.dht_prefix
        honest = await trio.to_thread.run_sync(_generate, folder, peers, prefix, "sample", 3)
        honest_tuning = await trio.to_thread.run_sync(_ptune, folder, peers, prefix, 3)
        tokens = _Tokens(servers)
        overhead = await trio.to_thread.run_sync(_overhead, folder, peers, prefix, tokens)
        liar = await stack.enter_async_context(
            open_server(
                ServerConfig(initial_peers=peers, block_indices=(0, 6), throughput=1000.0, **common)
            )
        )
        make_liar(liar, by=LIE, lies=("forward", "step", "backward"))
        # What checks prevent: a client checking nothing, before anyone has reported the liar.
        unchecked = await trio.to_thread.run_sync(_generate, folder, peers, prefix, "none", 4)
        lied = await trio.to_thread.run_sync(_generate, folder, peers, prefix, "sample", 4)
        reported = await trio.to_thread.run_sync(
            _banned_from_report, folder, peers, prefix, str(liar.dht.peer_id)
        )
        lied_tuning = await trio.to_thread.run_sync(_ptune, folder, peers, prefix, 4)
    return {
        "tokens_equal": honest["tokens"] == lied["tokens"],
        "logits_max_abs_diff": float((honest["logits"] - lied["logits"]).abs().max()),
        "caught": lied["caught"],
        "liar": str(liar.dht.peer_id),
        "ptune_losses": {"honest": honest_tuning["losses"], "liar": lied_tuning["losses"]},
        "ptune_losses_max_abs_diff": max(
            abs(a - b) for a, b in zip(honest_tuning["losses"], lied_tuning["losses"], strict=True)
        ),
        "ptune_prompts_max_abs_diff": float(
            (honest_tuning["prompts"] - lied_tuning["prompts"]).abs().max()
        ),
        "ptune_liar_caught": str(liar.dht.peer_id) in lied_tuning["caught"],
        "report_banned_after_s": reported["seconds"],
        "report_reason": reported["reason"],
        "report_tokens_equal": honest["tokens"] == reported["tokens"],
        "unchecked_tokens_equal": honest["tokens"] == unchecked["tokens"],
        "unchecked_logits_max_abs_diff": float(
            (honest["logits"] - unchecked["logits"]).abs().max()
        ),
        "overhead": overhead,
    }


def _model(folder: Path, peers: tuple[str, ...], prefix: str, verify: str) -> Any:
    from petals_core.distributed import AutoDistributedModelForCausalLM

    return AutoDistributedModelForCausalLM.from_pretrained(
        str(folder),
        initial_peers=peers,
        dht_prefix=prefix,
        verify=verify,
        local_files_only=True,
        request_timeout_s=30.0,
        update_period_s=1.0,
    ).eval()


def _ptune(folder: Path, peers: tuple[str, ...], prefix: str, servers: int) -> dict[str, Any]:
    """``PTUNE_STEPS`` Adam steps of deep prompt tuning with default checks: the losses, the
    trained prompts and who was caught."""
    from petals_core.distributed import AutoDistributedModelForCausalLM

    torch.manual_seed(21)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(folder),
        initial_peers=peers,
        dht_prefix=prefix,
        tuning_mode="deep_ptune",
        pre_seq_len=PTUNE_PROMPTS,
        local_files_only=True,
        request_timeout_s=30.0,
        update_period_s=1.0,
    )
    try:
        manager = sequence_manager(model)
        ids = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 12], [3, 8, 21, 40, 6, 1, 30, 11]])
        with torch.no_grad():
            model(ids)  # the client joins the swarm
        wait_for_servers(manager, servers, 30, banned=True)
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(trained, lr=1e-2)
        losses = []
        for _ in range(PTUNE_STEPS):
            loss = model(ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        prompts = torch.cat([p.detach().reshape(-1) for p in trained])
        return {"losses": losses, "prompts": prompts, "caught": list(manager.state.caught)}
    finally:
        model.shutdown()


def _banned_from_report(
    folder: Path, peers: tuple[str, ...], prefix: str, liar: str
) -> dict[str, Any]:
    """A client checking every forward catches ``liar`` and reports it; then a client checking
    nothing: how long until it bans ``liar`` from the report, why, and its tokens afterwards."""
    from petals_core.client import book_of

    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 12]])
    reporter = _model(folder, peers, prefix, "all")
    try:
        manager = sequence_manager(reporter)
        with torch.no_grad():
            reporter(ids)  # the client joins the swarm
            wait_for_servers(manager, 4, 30, banned=True)
            reporter(ids)
        if liar not in manager.state.caught:
            raise RuntimeError("the liar was not on the reporter's route")
        wait_until(
            lambda: bool(book_of(manager).published),
            "the report was not published",
            REPORT_DEADLINE_S,
        )
    finally:
        reporter.shutdown()
    model = _model(folder, peers, prefix, "none")
    try:
        manager = sequence_manager(model)
        began = time.monotonic()
        with torch.no_grad():
            model(ids)  # the client joins the swarm
        wait_until(
            lambda: liar in manager.state.caught, "no report banned the liar", REPORT_DEADLINE_S
        )
        seconds = time.monotonic() - began
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        return {"seconds": seconds, "reason": manager.state.caught[liar], "tokens": out.tolist()}
    finally:
        model.shutdown()


def _generate(
    folder: Path, peers: tuple[str, ...], prefix: str, verify: str, servers: int
) -> dict[str, Any]:
    model = _model(folder, peers, prefix, verify)
    try:
        manager = sequence_manager(model)
        ids = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 12]])
        with torch.no_grad():
            model(ids)  # the client joins the swarm
            wait_for_servers(manager, servers, 30, banned=True)
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
            logits = model(out).logits
        return {"tokens": out.tolist(), "logits": logits, "caught": list(manager.state.caught)}
    finally:
        model.shutdown()


def _overhead(folder: Path, peers: tuple[str, ...], prefix: str, tokens: _Tokens) -> dict[str, Any]:
    models = {verify: _model(folder, peers, prefix, verify) for verify in ("none", "sample")}
    times: dict[str, list[float]] = {verify: [] for verify in models}
    steps: dict[str, int] = {verify: 0 for verify in models}
    ids = torch.tensor([[5, 17, 33, 2, 9, 41, 7, 12]])
    try:
        for model in models.values():  # warm: routes, pings, the first answers' checks
            with torch.no_grad():
                model.generate(ids, max_new_tokens=4, do_sample=False)
        for _ in range(OVERHEAD_ROUNDS):
            for verify, model in models.items():
                before = tokens.count
                began = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=OVERHEAD_TOKENS, do_sample=False)
                times[verify].append((time.perf_counter() - began) * 1000 / OVERHEAD_TOKENS)
                steps[verify] += tokens.count - before
    finally:
        for model in models.values():
            model.shutdown()
    return {
        "ms_per_token": {verify: statistics.median(t) for verify, t in times.items()},
        "server_positions": steps,
    }


def main() -> None:
    from transformers import LlamaForCausalLM

    from petals_core.client._checks import TOLERANCE
    from petals_core.testing import tiny_llama_config

    torch.set_num_threads(1)
    started = time.perf_counter()
    rows, honest = [], {}
    total = false_reports = 0
    for dtype, sessions in SESSIONS.items():
        found = honest_disagreement(dtype, sessions)
        bound = TOLERANCE[dtype]
        reports = sum(value > bound for value in found)
        total += len(found)
        false_reports += reports
        honest[dtype] = {
            "answers": len(found),
            "max": max(found),
            "p999": percentile(found, 0.999),
            "median": statistics.median(found),
            "bound": bound,
            "false_reports": reports,
        }
        rows.append(
            [dtype, len(found), f"{statistics.median(found):.2e}",
             f"{percentile(found, 0.999):.2e}", f"{max(found):.2e}", bound, reports]
        )  # fmt: skip
    print_table(
        f"trust: honest disagreement, {BLOCKS} SmolLM2-shaped blocks: session on 1 thread against "
        "replays from position 0 on 2 threads (relative L2 per token, largest over tokens)",
        ["dtype", "answers", "median", "p99.9", "max", "bound", "false reports"],
        rows,
    )
    summarize(
        "trust",
        f"false reports among {total} honest answers",
        float(false_reports),
        unit="answers",
        target="0",
        met=false_reports == 0 and total >= 10_000,
    )

    answers, passed = caught_after(TRIALS, LIE_RATE)
    print_table(
        f"trust: a server lying on {LIE_RATE:.0%} of its answers, default policy, {TRIALS} trials",
        ["", "median", "p90", "p99", "max"],
        [
            ["answers until caught", statistics.median(answers), percentile(answers, 0.9),
             percentile(answers, 0.99), max(answers)],
            ["lies unchecked before", statistics.median(passed), percentile(passed, 0.9),
             percentile(passed, 0.99), max(passed)],
        ],
    )  # fmt: skip

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(3)
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder, max_shard_size="200KB")
        end = trio.run(_end_to_end, Path(folder))
    overhead = end["overhead"]
    ms = overhead["ms_per_token"]
    steps = overhead["server_positions"]
    print_table(
        f"trust: end to end, tiny LLaMA on 3 honest servers (+1 liar), greedy, {NEW_TOKENS} tokens",
        ["what", "value"],
        [
            ["liar caught (default settings)", end["liar"] in end["caught"]],
            ["tokens equal an honest swarm's", end["tokens_equal"]],
            ["logits max |diff| to an honest swarm", end["logits_max_abs_diff"]],
            [
                f"deep p-tuning, {PTUNE_STEPS} steps: losses max |diff| to an honest swarm's",
                end["ptune_losses_max_abs_diff"],
            ],
            ["deep p-tuning: trained prompts max |diff|", end["ptune_prompts_max_abs_diff"]],
            [
                "a client checking nothing bans the liar from a report after (s)",
                end["report_banned_after_s"],
            ],
            ["... then its tokens equal an honest swarm's", end["report_tokens_equal"]],
            ["verify='none', before any report: tokens equal", end["unchecked_tokens_equal"]],
            [
                "verify='none', before any report: logits max |diff|",
                end["unchecked_logits_max_abs_diff"],
            ],
            [f"ms/token, verify='none' ({OVERHEAD_ROUNDS} x {OVERHEAD_TOKENS} tokens)", ms["none"]],
            ["ms/token, verify='sample'", ms["sample"]],
            ["positions the servers computed, 'none'", steps["none"]],
            ["positions the servers computed, 'sample'", steps["sample"]],
        ],
    )
    exact = (
        end["tokens_equal"]
        and end["logits_max_abs_diff"] == 0.0
        and bool(end["caught"])
        and end["ptune_losses_max_abs_diff"] == 0.0
        and end["ptune_prompts_max_abs_diff"] == 0.0
    )
    summarize(
        "trust",
        "a liar caught; tokens, logits and prompt tuning equal an honest swarm's",
        float(exact),
        unit="",
        target="1",
        met=exact,
    )
    summarize(
        "trust",
        "a client checking nothing bans the reported liar, then generates exact tokens",
        end["report_banned_after_s"],
        unit="s",
        target=f"<= {REPORT_DEADLINE_S:.0f} s, tokens equal",
        met=end["report_tokens_equal"] and end["report_reason"].startswith("reported by"),
    )
    summarize_ratio(
        "trust",
        "decode ms/token, default checks vs none",
        ms["sample"],
        ms["none"],
        at_most=1.10,
    )
    summarize(
        "trust",
        "positions the servers computed, default checks vs none",
        float(steps["sample"]),
        float(max(steps["none"], 1)),
        unit="positions",
        target="<= 1.1x",
        met=steps["sample"] <= 1.1 * steps["none"],
    )
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "trust",
        {
            "honest": honest,
            "honest_answers": total,
            "false_reports": false_reports,
            "liar_1pct": {
                "trials": TRIALS,
                "answers_until_caught": answers,
                "lies_unchecked": passed,
            },
            "end_to_end": {k: v for k, v in end.items()},
        },
    )
