"""Forward and backward through real in-process servers, compared with local autograd: the async
core (``remote_forward`` / ``remote_backward``), ``RemoteSequential`` autograd driven from sync
code through the bridge, slicing, deep prompts, row chunks, and a server leaving between the
forward and the backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from petals_core.client import RemoteSequential, remote_backward, remote_forward

from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    Model,
    assert_close,
    in_process_swarm,
    local_grads,
    manager_for,
    training_inputs,
    wait_for_servers,
)


async def test_forward_backward_equal_local_autograd(model: Model, tmp_path: Path) -> None:
    """Async core and the sync module (from a worker thread, through the bridge) over two
    servers, with deep prompts; halves ``seq[:3]`` then ``seq[3:]`` reproduce the whole."""
    x, prompts, grad_output = training_inputs(4, rows=3, length=5)
    expected, expected_grad, expected_prompt_grad = local_grads(model, x, grad_output, prompts)
    assert expected_prompt_grad is not None
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        seq = RemoteSequential(manager_for(list(swarm.servers.values())))
        with trio.fail_after(DEADLINE_S):
            async with seq:
                # The async core.
                output, saved = await remote_forward(seq.sequence_manager, x, prompts)
                assert_close(output, expected)
                assert [(s.start, s.end) for chunk in saved for s, *_ in chunk] == [(0, 3), (3, 6)]
                grad, grad_prompts = await remote_backward(
                    seq.sequence_manager, grad_output, saved, prompts
                )
                assert_close(grad, expected_grad)
                assert grad_prompts is not None
                assert_close(grad_prompts, expected_prompt_grad)
                assert_close(await seq.forward_async(x, prompts), expected)

                # Row chunks: one row per request, concurrently, each on its own route.
                chunked = RemoteSequential(seq.sequence_manager, max_chunk_tokens=5)
                output, saved = await remote_forward(
                    chunked.sequence_manager, x, prompts, max_chunk_tokens=5
                )
                assert len(saved) == 3
                assert_close(output, expected)
                grad, grad_prompts = await remote_backward(
                    seq.sequence_manager, grad_output, saved, prompts, max_chunk_tokens=5
                )
                assert_close(grad, expected_grad)
                assert grad_prompts is not None
                assert_close(grad_prompts, expected_prompt_grad)

                # The module's autograd, from sync code.
                def train(
                    module: RemoteSequential,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                    xx = x.clone().requires_grad_(True)
                    pp = prompts.clone().requires_grad_(True)
                    out = module(xx, pp)
                    out.backward(grad_output)
                    assert xx.grad is not None and pp.grad is not None
                    return out.detach(), xx.grad, pp.grad, chunked(x, prompts).detach()

                def kept_backwards() -> int:
                    return sum(
                        server.block_server.statistics().kept_backwards
                        for server in swarm.servers.values()
                    )

                # So far no forward asked to keep its graph: every backward was recomputed.
                assert kept_backwards() == 0
                out, grad, prompt_grad, out_chunked = await trio.to_thread.run_sync(train, seq)
                # The module's forward, made for a backward, had both servers keep their graphs.
                assert kept_backwards() == 2
                assert_close(out, expected)
                assert_close(grad, expected_grad)
                assert_close(prompt_grad, expected_prompt_grad)
                assert_close(out_chunked, expected)

                # Halves: seq[:3] then seq[3:] is the whole, gradients included.
                def halves() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
                    first, second = seq[:3], seq[3:]
                    assert (len(first), len(second)) == (3, 3)
                    xx = x.clone().requires_grad_(True)
                    pp = prompts.clone().requires_grad_(True)
                    out = second(first(xx, pp[:3]), pp[3:])
                    out.backward(grad_output)
                    assert xx.grad is not None and pp.grad is not None
                    return out.detach(), xx.grad, pp.grad

                out, grad, prompt_grad = await trio.to_thread.run_sync(halves)
                assert_close(out, expected)
                assert_close(grad, expected_grad)
                assert_close(prompt_grad, expected_prompt_grad)
                assert not seq.sequence_manager.state.bans


async def test_the_callers_mistakes_are_refused_before_anything_is_sent(
    model: Model, tmp_path: Path
) -> None:
    """Inputs no server would take are the caller's ValueError, not a failure blamed on every
    server in turn; what was right goes through after them."""
    x, prompts, grad_output = training_inputs(4, rows=2, length=5)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        manager = manager_for(list(swarm.servers.values()))
        with trio.fail_after(DEADLINE_S):
            async with RemoteSequential(manager) as seq:
                await wait_for_servers(manager, 2)
                for hidden, deep, match in (
                    (x[0], None, r"hidden states must be \(batch, tokens, 64\)"),
                    (torch.zeros(2, 5, HIDDEN + 1), None, "hidden states must be"),
                    (x, prompts[:3], r"deep prompts must be \(6 blocks, 1 or 2, at most 5"),
                    (x, torch.zeros(N_BLOCKS, 1, 6, HIDDEN), "deep prompts must be"),
                ):
                    with pytest.raises(ValueError, match=match):
                        await remote_forward(manager, hidden, deep)
                _, saved = await remote_forward(manager, x, prompts)
                with pytest.raises(ValueError, match="does not match the saved forward"):
                    await remote_backward(manager, grad_output[:, :4], saved, prompts)
                with pytest.raises(ValueError, match=r"grad_output must be \(batch, tokens, 64"):
                    await remote_backward(manager, grad_output[..., :4], saved, prompts)
                grad, _ = await remote_backward(manager, grad_output, saved, prompts)
                assert grad.shape == x.shape
                async with seq.open_inference_session(max_length=16) as session:
                    with pytest.raises(ValueError, match="hidden states are of size 64"):
                        await session.step(torch.zeros(1, 1, HIDDEN + 1))
                    await session.step(torch.zeros(1, 1, HIDDEN))
                assert not manager.state.bans and not manager.state.caught


async def test_server_leaving_between_forward_and_backward(model: Model, tmp_path: Path) -> None:
    """Blocks 3:6 are held twice; the holder the forward went through leaves: the backward
    recomputes those blocks on the other one and gives the same gradients."""
    torch.manual_seed(5)
    x = torch.randn(2, 4, HIDDEN)
    grad_output = torch.randn(2, 4, HIDDEN)
    expected, expected_grad, _ = local_grads(model, x, grad_output)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6), (3, 6)]) as swarm:
        manager = manager_for(list(swarm.servers.values()))
        seq = RemoteSequential(manager)
        with trio.fail_after(DEADLINE_S):
            async with seq:
                await wait_for_servers(manager, 3)
                output, saved = await remote_forward(manager, x)
                assert_close(output, expected)
                used = saved[0][-1][0].peer_id
                assert saved[0][-1][0].start == 3
                await swarm.leave(used)
                grad, _ = await remote_backward(manager, grad_output, saved)
                assert_close(grad, expected_grad)
                assert manager.is_banned(used)


async def test_a_server_answering_the_wrong_shape_is_banned_and_the_forward_goes_elsewhere(
    model: Model, tmp_path: Path
) -> None:
    x, _, _ = training_inputs(5, rows=1, length=4)
    expected = model.forward(x).detach()
    async with in_process_swarm(model, tmp_path, [(0, 6)]) as swarm:
        broken = await swarm.add((0, 6), throughput=1000.0)  # routes prefer it
        backend = broken.backend
        assert backend is not None
        answer = backend.forward_block

        def short(index: int, *args: Any, **kwargs: Any) -> Any:
            output = answer(index, *args, **kwargs)
            return output[:, :-1].contiguous() if index == 5 else output  # a position short

        backend.forward_block = short  # type: ignore[method-assign]
        manager = manager_for(list(swarm.servers.values()), verify="none")
        with trio.fail_after(DEADLINE_S):
            async with RemoteSequential(manager):
                await wait_for_servers(manager, 2)
                output, _ = await remote_forward(manager, x)
                assert_close(output, expected)
                assert manager.is_banned(str(broken.dht.peer_id))
