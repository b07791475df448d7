"""Forward and backward passes of a real server on loopback, against local autograd through
blocks of the same checkpoint, and the forward graphs it keeps for a backward."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from petals_core.server import ServingLimits

from ..models.conftest import TinyCheckpoint
from ._client import (
    DEADLINE_S,
    HIDDEN,
    assert_close,
    backward,
    connect,
    forward,
    forward_with_meta,
    local_blocks,
    run_local,
    serve,
)


async def test_forward_and_backward_equal_local_autograd(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Tensors sent in parts of 1 KiB (dozens of parts each)."""
    torch.manual_seed(6)
    hidden = torch.randn(2, 40, HIDDEN)  # 20 KiB in fp32
    grad_outputs = torch.randn(2, 40, HIDDEN)
    blocks = local_blocks(server_llama, 1, 4)
    leaf = hidden.clone().requires_grad_(True)
    local_output = run_local(blocks, leaf)
    (expected_grad,) = torch.autograd.grad(local_output, leaf, grad_outputs)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
        ):
            output = await forward(connection, (1, 4), hidden, chunk_bytes=1024)
            grads = await backward(connection, (1, 4), hidden, grad_outputs, chunk_bytes=1024)
            statistics = server.block_server.statistics()
    assert_close(output, local_output.detach())
    assert set(grads) == {"grad_inputs"}
    assert_close(grads["grad_inputs"], expected_grad)
    assert (statistics.forwards, statistics.backwards) == (1, 1)


@pytest.mark.parametrize(
    ("limits", "jobs"),
    [
        (ServingLimits(), 3 + 1),
        (ServingLimits(backward_activation_bytes=1), 3 + 2 * (2 + 3)),
        (ServingLimits(backward_activation_bytes=1, max_batch_tokens=9), 2 * 3 + 2 * (2 + 3)),
    ],
    ids=[
        "the span recomputed as one graph",
        "one block and row at a time",
        "forwards one row at a time too",
    ],
)
@pytest.mark.parametrize("prompt_rows", [2, 1], ids=["a prompt per row", "one prompt"])
async def test_backward_with_prompts_equals_local_autograd(
    server_llama: TinyCheckpoint,
    cache_dir: Path,
    limits: ServingLimits,
    jobs: int,
    prompt_rows: int,
) -> None:
    """Rows go in jobs of their own where one block's graph of both rows exceeds the backward
    budget, or they exceed ``max_batch_tokens`` (the jobs the server ran say how it went: its
    forward then its backward, which recomputes the forward of all but the last group)."""
    torch.manual_seed(7)
    hidden = torch.randn(2, 9, HIDDEN)
    prompts = torch.randn(3, prompt_rows, 4, HIDDEN)  # (blocks, B or 1, P, hidden)
    grad_outputs = torch.randn(2, 9, HIDDEN)
    blocks = local_blocks(server_llama, 2, 5)
    leaf, prompt_leaf = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    local_output = run_local(blocks, leaf, prompts=prompt_leaf)
    grad_hidden, grad_prompts = torch.autograd.grad(local_output, (leaf, prompt_leaf), grad_outputs)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6), limits=limits) as server,
            connect(server) as connection,
        ):
            pool = server.block_server._serving.pool
            assert pool is not None
            before = pool.statistics().completed
            output = await forward(connection, (2, 5), hidden, prompts=prompts, chunk_bytes=1024)
            grads = await backward(
                connection, (2, 5), hidden, grad_outputs, prompts=prompts, chunk_bytes=1024
            )
            ran = pool.statistics().completed - before
    assert_close(output, local_output.detach())
    assert set(grads) == {"grad_inputs", "grad_prompts"}
    assert_close(grads["grad_inputs"], grad_hidden)
    assert_close(grads["grad_prompts"], grad_prompts)
    assert ran == jobs


async def test_a_kept_forward_graph_serves_its_backward_once(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """keep_for_backward: the backward takes the kept graph (no recomputation) and equals local
    autograd; the token is spent, and a second backward with it is recomputed, equal too."""
    torch.manual_seed(21)
    hidden = torch.randn(2, 9, HIDDEN)
    prompts = torch.randn(3, 1, 4, HIDDEN)
    grad_outputs = torch.randn(2, 9, HIDDEN)
    leaf, prompt_leaf = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    local_output = run_local(local_blocks(server_llama, 2, 5), leaf, prompts=prompt_leaf)
    grad_hidden, grad_prompts = torch.autograd.grad(local_output, (leaf, prompt_leaf), grad_outputs)
    keep = {"keep_for_backward": True}
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
        ):
            output, reply = await forward_with_meta(
                connection, (2, 5), hidden, prompts=prompts, meta=keep
            )
            token = reply["kept"]
            assert isinstance(token, str)
            kept = server.block_server.statistics()
            assert (kept.kept_forwards, kept.kept_forward_bytes > 0) == (1, True)
            results = [
                await backward(
                    connection,
                    (2, 5),
                    hidden,
                    grad_outputs,
                    prompts=prompts,
                    meta={"kept": token},
                )
                for _ in range(2)
            ]
            statistics = server.block_server.statistics()
    assert_close(output, local_output.detach())
    for grads in results:
        assert_close(grads["grad_inputs"], grad_hidden)
        assert_close(grads["grad_prompts"], grad_prompts)
    assert (statistics.backwards, statistics.kept_backwards) == (2, 1)
    assert (statistics.kept_forwards, statistics.kept_forward_bytes) == (0, 0)


async def test_a_kept_graph_is_used_only_for_the_same_inputs_and_peer(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Other hidden states, other blocks, another peer or a made-up token: recomputed, exact."""
    torch.manual_seed(22)
    hidden = torch.randn(1, 6, HIDDEN)
    other = hidden.clone()
    other[0, 0, 0] += 1.0
    grad_outputs = torch.randn(1, 6, HIDDEN)
    keep = {"keep_for_backward": True}

    def expected(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
        leaf = x.clone().requires_grad_(True)
        out = run_local(local_blocks(server_llama, start, end), leaf)
        return torch.autograd.grad(out, leaf, grad_outputs)[0]

    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
            connect(server) as stranger,
        ):
            cases = []
            for x, blocks, caller in (
                (other, (1, 4), connection),
                (hidden, (1, 3), connection),
                (hidden, (1, 4), stranger),
            ):
                _, reply = await forward_with_meta(connection, (1, 4), hidden, meta=keep)
                grads = await backward(
                    caller, blocks, x, grad_outputs, meta={"kept": reply["kept"]}
                )
                cases.append((grads["grad_inputs"], expected(x, *blocks)))
            made_up = await backward(connection, (1, 4), hidden, grad_outputs, meta={"kept": "x"})
            cases.append((made_up["grad_inputs"], expected(hidden, 1, 4)))
            statistics = server.block_server.statistics()
    for got, want in cases:
        assert_close(got, want)
    assert statistics.kept_backwards == 0
    # The stranger could not spend the third graph; the first two were spent by their mismatch.
    assert statistics.kept_forwards == 1


async def test_kept_graphs_stay_within_their_budget(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """A budget of one graph: a second forward drops the first (whose backward is recomputed);
    a budget of 0 keeps none (the reply has no token)."""
    torch.manual_seed(23)
    hidden = torch.randn(1, 5, HIDDEN)
    grad_outputs = torch.randn(1, 5, HIDDEN)
    keep = {"keep_for_backward": True}
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
        ):
            assert server.backend is not None
            one_graph = server.backend.activation_bytes(1, 5) * 3
        limits = ServingLimits(kept_forward_bytes=one_graph)
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6), limits=limits) as server,
            connect(server) as connection,
        ):
            _, first = await forward_with_meta(connection, (0, 3), hidden, meta=keep)
            _, second = await forward_with_meta(connection, (0, 3), hidden, meta=keep)
            assert server.block_server.statistics().kept_forwards == 1
            for reply in (first, second):
                await backward(
                    connection, (0, 3), hidden, grad_outputs, meta={"kept": reply["kept"]}
                )
            assert server.block_server.statistics().kept_backwards == 1
        async with (
            serve(
                server_llama, cache_dir, blocks=(0, 6), limits=ServingLimits(kept_forward_bytes=0)
            ) as server,
            connect(server) as connection,
        ):
            _, reply = await forward_with_meta(connection, (0, 3), hidden, meta=keep)
            assert "kept" not in reply
            assert server.block_server.statistics().kept_forwards == 0


async def test_kept_graphs_expire(server_llama: TinyCheckpoint, cache_dir: Path) -> None:
    limits = ServingLimits(kept_forward_timeout_s=0.05)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6), limits=limits) as server,
            connect(server) as connection,
        ):
            _, reply = await forward_with_meta(
                connection, (0, 2), torch.randn(1, 3, HIDDEN), meta={"keep_for_backward": True}
            )
            assert "kept" in reply
            # The graph's deadline (on this same trio clock) lies before this one.
            await trio.sleep_until(trio.current_time() + 0.05)
            assert server.block_server.statistics().kept_forwards == 0


async def test_a_graph_computed_as_the_server_moves_is_not_kept(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """A forward kept for backward that computes while the server leaves its blocks is answered
    but not kept: the graph would hold the blocks left."""
    hidden = torch.randn(1, 3, HIDDEN)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
            trio.open_nursery() as nursery,
        ):
            backend, blocks = server.backend, server.block_server
            assert backend is not None
            computing, go_on = trio.Event(), threading.Event()
            keeping = backend.forward_keeping_graph

            def held(*args: Any, **kwargs: Any) -> Any:
                trio.from_thread.run_sync(computing.set)  # from the pool's worker thread
                go_on.wait()
                return keeping(*args, **kwargs)

            backend.forward_keeping_graph = held  # type: ignore[method-assign]
            replies: list[dict[str, Any]] = []

            async def kept_forward() -> None:
                meta = {"keep_for_backward": True}
                replies.append((await forward_with_meta(connection, (0, 2), hidden, meta=meta))[1])

            try:
                nursery.start_soon(kept_forward)
                await computing.wait()
                blocks.detach("moving to blocks 3:6")
            finally:
                go_on.set()
        assert replies and "kept" not in replies[0]
        assert blocks.statistics().kept_forwards == 0


async def test_forward_accepts_bfloat16(server_llama: TinyCheckpoint, cache_dir: Path) -> None:
    """bf16 in, bf16 out: the fp32 blocks run on the input cast up, the output is cast down."""
    torch.manual_seed(8)
    hidden = torch.randn(1, 6, HIDDEN).to(torch.bfloat16)
    expected = run_local(local_blocks(server_llama, 0, 2), hidden.float()).detach()
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 2)) as server,
            connect(server) as connection,
        ):
            output = await forward(connection, (0, 2), hidden)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.float(), expected, rtol=1e-2, atol=1e-2)
