"""The block RPCs of a real server on loopback, against local blocks of the same checkpoint.

Every result is compared with :class:`LlamaBlock` objects loaded from the checkpoint the server
serves (fp32, within 1e-5); every refusal is checked for its remote type and message, and for the
server going on serving (an open session and a new one still compute the right thing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import BACKWARD, FORWARD, INFERENCE, send_tensors
from petals_core.server import ServingLimits
from petals_core.transport import Connection, open_call

from ..models.conftest import TinyCheckpoint
from ._client import (
    backward,
    connect,
    forward,
    forward_with_meta,
    info,
    local_blocks,
    open_raw_session,
    run_local,
    run_local_cached,
    serve,
    session,
)
from .fuzz_rpc import _RawCall

HIDDEN = 64
#: Generous: the whole module takes seconds; this only turns a hang into a failure.
DEADLINE_S = 60.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


# -- 1. inference sessions -------------------------------------------------------------------------


async def test_session_over_a_sub_span_equals_local_blocks(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Server holds 0:6, the session uses [2, 5): several tokens at once, then one at a time,
    with a zero-token step in between that returns (B, 0, H) and keeps the position."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 12, HIDDEN)  # (B, T, hidden)
    expected = run_local(local_blocks(server_llama, 2, 5), hidden)
    outputs = []
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
            session(
                connection, blocks=(2, 5), max_length=16, batch_size=2, session_id="sub-span"
            ) as opened,
        ):
            outputs.append(await opened.step(hidden[:, :5]))
            assert opened.position == 5
            outputs.append(await opened.step(hidden[:, 5:8]))
            assert opened.position == 8
            empty = await opened.step(hidden[:, 8:8])
            assert empty.shape == (2, 0, HIDDEN)
            assert opened.position == 8
            for t in range(8, 12):
                outputs.append(await opened.step(hidden[:, t : t + 1]))
                assert opened.position == t + 1
    assert_close(torch.cat(outputs, dim=1), expected)


async def test_chunked_prefill_equals_unchunked(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """With max_batch_tokens=4 a 13-token step of 2 rows runs in chunks of 2 positions."""
    torch.manual_seed(1)
    hidden = torch.randn(2, 14, HIDDEN)
    expected = run_local(local_blocks(server_llama, 1, 4), hidden)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(
                server_llama, cache_dir, blocks=(1, 4), limits=ServingLimits(max_batch_tokens=4)
            ) as server,
            connect(server) as connection,
            session(
                connection, blocks=(1, 4), max_length=14, batch_size=2, session_id="chunked"
            ) as opened,
        ):
            prefill = await opened.step(hidden[:, :13])
            assert opened.position == 13
            last = await opened.step(hidden[:, 13:])
            assert opened.position == 14
    assert_close(torch.cat([prefill, last], dim=1), expected)


async def test_start_from_position_rolls_back(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Resending different tokens from position 3 gives the local run of the new sequence."""
    torch.manual_seed(2)
    first = torch.randn(1, 6, HIDDEN)
    resent = torch.randn(1, 5, HIDDEN)
    new_sequence = torch.cat([first[:, :3], resent], dim=1)  # (1, 8, hidden)
    expected = run_local(local_blocks(server_llama, 0, 3), new_sequence)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 3)) as server,
            connect(server) as connection,
            session(connection, blocks=(0, 3), max_length=8, session_id="rollback") as opened,
        ):
            head = await opened.step(first)
            assert opened.position == 6
            rolled = await opened.step(resent[:, :4], start_from_position=3)
            assert opened.position == 7
            tail = await opened.step(resent[:, 4:])
            assert opened.position == 8
    assert_close(head[:, :3], expected[:, :3])
    assert_close(torch.cat([rolled, tail], dim=1), expected[:, 3:])


async def test_hypo_ids_reorder_the_cache_rows(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Beam search on batch 3: the server's rows are reordered as ``KVCache.reorder`` does."""
    torch.manual_seed(3)
    hidden = torch.randn(3, 7, HIDDEN)
    reorders = [torch.tensor([2, 0, 0]), torch.tensor([1, 2, 1])]
    blocks = local_blocks(server_llama, 2, 5)
    caches = [block.allocate_cache(3, 8) for block in blocks]
    expected = [run_local_cached(blocks, hidden[:, :5], caches)]
    for t, hypo_ids in enumerate(reorders, start=5):
        for cache in caches:
            cache.reorder(hypo_ids)
        expected.append(run_local_cached(blocks, hidden[:, t : t + 1], caches))
    outputs = []
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
            session(connection, blocks=(2, 5), max_length=8, batch_size=3, session_id="beam") as b,
        ):
            outputs.append(await b.step(hidden[:, :5]))
            for t, hypo_ids in enumerate(reorders, start=5):
                outputs.append(await b.step(hidden[:, t : t + 1], hypo_ids=hypo_ids))
    assert_close(torch.cat(outputs, dim=1), torch.cat(expected, dim=1))
    # Not a vacuous check: without the reorder the last step differs.
    plain = run_local(blocks, hidden)
    assert not torch.allclose(plain[:, 6], expected[-1][:, 0], atol=1e-3)


async def test_deep_prompts_are_added_before_each_block(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Prompts (n_blocks, 1, P, H) on the first step: the local blocks with the prompt of each
    block added to the first P positions before it."""
    torch.manual_seed(4)
    hidden = torch.randn(2, 8, HIDDEN)
    prompts = torch.randn(3, 1, 3, HIDDEN)  # (blocks, 1, P, hidden)
    expected = run_local(local_blocks(server_llama, 1, 4), hidden, prompts=prompts)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(1, 4)) as server,
            connect(server) as connection,
            session(
                connection, blocks=(1, 4), max_length=8, batch_size=2, session_id="prompts"
            ) as opened,
        ):
            outputs = [await opened.step(hidden[:, :5], prompts=prompts)]
            for t in range(5, 8):
                outputs.append(await opened.step(hidden[:, t : t + 1]))
    assert_close(torch.cat(outputs, dim=1), expected)
    assert not torch.allclose(expected, run_local(local_blocks(server_llama, 1, 4), hidden))


# -- 2. batching ---------------------------------------------------------------------------------


async def _four_sessions(
    connection: Connection, hidden: list[torch.Tensor], prefills: list[int]
) -> list[torch.Tensor]:
    """Four sessions over blocks [1, 4), each in its own task: a prefill, then one token at a
    time, all stepping concurrently."""
    results: list[torch.Tensor | None] = [None] * len(hidden)

    async def run(index: int) -> None:
        states = hidden[index]
        async with session(
            connection,
            blocks=(1, 4),
            max_length=states.shape[1],
            batch_size=states.shape[0],
            session_id=f"concurrent-{index}",
        ) as opened:
            outputs = [await opened.step(states[:, : prefills[index]])]
            for t in range(prefills[index], states.shape[1]):
                outputs.append(await opened.step(states[:, t : t + 1]))
        results[index] = torch.cat(outputs, dim=1)

    async with trio.open_nursery() as nursery:
        for index in range(len(hidden)):
            nursery.start_soon(run, index)
    finished = [result for result in results if result is not None]
    assert len(finished) == len(hidden)
    return finished


async def test_batched_steps_equal_unbatched(server_llama: TinyCheckpoint, cache_dir: Path) -> None:
    torch.manual_seed(5)
    hidden = [torch.randn(batch, 10, HIDDEN) for batch in (1, 2, 1, 3)]
    prefills = [1, 2, 3, 4]
    blocks = local_blocks(server_llama, 1, 4)
    expected = [run_local(blocks, states) for states in hidden]
    results = {}
    with trio.fail_after(DEADLINE_S):
        for batch_steps in (True, False):
            limits = ServingLimits(batch_steps=batch_steps)
            async with (
                serve(server_llama, cache_dir, blocks=(0, 6), limits=limits) as server,
                connect(server) as connection,
            ):
                results[batch_steps] = await _four_sessions(connection, hidden, prefills)
                statistics = server.block_server.statistics()
            assert statistics.steps == sum(1 + 10 - p for p in prefills)
            # Public statistics only say which steps went to the batching path; how many went
            # together in one batch is in the server's task pool, which it keeps private.
            assert statistics.batched_steps == (statistics.steps if batch_steps else 0)
            assert statistics.failures == 0
    for batched, unbatched, local in zip(results[True], results[False], expected, strict=True):
        assert_close(batched, unbatched)
        assert_close(batched, local)


# -- 3. forward and backward -----------------------------------------------------------------------


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
    "backward_activation_bytes",
    [1 << 30, 1],
    ids=["the span recomputed as one graph", "one block at a time"],
)
async def test_backward_with_prompts_equals_local_autograd(
    server_llama: TinyCheckpoint, cache_dir: Path, backward_activation_bytes: int
) -> None:
    torch.manual_seed(7)
    hidden = torch.randn(2, 9, HIDDEN)
    prompts = torch.randn(3, 2, 4, HIDDEN)  # (blocks, B, P, hidden)
    grad_outputs = torch.randn(2, 9, HIDDEN)
    blocks = local_blocks(server_llama, 2, 5)
    leaf, prompt_leaf = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    local_output = run_local(blocks, leaf, prompts=prompt_leaf)
    grad_hidden, grad_prompts = torch.autograd.grad(local_output, (leaf, prompt_leaf), grad_outputs)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(
                server_llama,
                cache_dir,
                blocks=(0, 6),
                limits=ServingLimits(backward_activation_bytes=backward_activation_bytes),
            ) as server,
            connect(server) as connection,
        ):
            output = await forward(connection, (2, 5), hidden, prompts=prompts, chunk_bytes=1024)
            grads = await backward(
                connection, (2, 5), hidden, grad_outputs, prompts=prompts, chunk_bytes=1024
            )
    assert_close(output, local_output.detach())
    assert set(grads) == {"grad_inputs", "grad_prompts"}
    assert_close(grads["grad_inputs"], grad_hidden)
    assert_close(grads["grad_prompts"], grad_prompts)


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


async def test_a_malformed_frame_mid_session_is_reported_and_the_server_goes_on(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Bytes that are no frame, after a step: the session ends with a protocol error sent to
    its client (the client's stream is read by a task of its own), and the server serves on."""
    torch.manual_seed(24)
    hidden = torch.randn(1, 3, HIDDEN)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6)) as server,
            connect(server) as connection,
        ):
            call = await _RawCall.open(connection, INFERENCE)
            await call.send({"session_id": "garbled", "blocks": [0, 2], "max_length": 8})
            assert (await call.receive() or {}).get("ready") is True
            await call.send({"hidden_states": hidden})
            assert (await call.receive() or {}).get("position") == 3
            await call.send_bytes(b"\xff" * 64)
            with pytest.raises(RemoteError, match="ProtocolError"):
                await call.finish()
            await call.close()
            output = await forward(connection, (0, 2), hidden)
            assert (await info(connection)).open_sessions == 0
    assert_close(output, run_local(local_blocks(server_llama, 0, 2), hidden).detach())


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


# -- 4. cache accounting ---------------------------------------------------------------------------


async def test_session_holds_its_cache_until_it_closes(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=1000) as server,
            connect(server) as connection,
        ):
            described = await info(connection)
            # A CPU server: no device memory to report, and decode steps run eagerly.
            assert described.device == "cpu"
            assert described.device_memory_reserved_bytes is None
            assert described.decode_graphs is None
            before = described.cache_tokens_left
            assert before == 1000 * 6 == server.block_server.cache_tokens_left
            async with session(
                connection, blocks=(1, 4), max_length=10, batch_size=2, session_id="held"
            ) as opened:
                held = await info(connection)
                assert held.cache_tokens_left == before - 10 * 2 * 3
                assert held.open_sessions == 1
                await opened.step(torch.randn(2, 3, HIDDEN))
                assert server.block_server.cache_tokens_left == before - 60
            # session() closed it and waited for the server's end of the call: the handler has
            # returned, and the cache is back.
            assert server.block_server.cache_tokens_left == before
            after = await info(connection)
            assert (after.cache_tokens_left, after.open_sessions) == (before, 0)


async def test_allocation_beyond_the_budget_fails_at_once(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """48 tokens in all (8 per block): a session of 6 blocks x 10 positions can never fit, so it
    is refused without waiting out its (long) alloc_timeout."""
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=8) as server,
            connect(server) as connection,
        ):
            opening = {"session_id": "big", "blocks": [0, 6], "max_length": 10}
            with pytest.raises(RemoteError) as caught:
                await open_raw_session(connection, {**opening, "alloc_timeout": 3600.0})
            assert caught.value.remote_type == "AllocationFailed"
            assert server.block_server.cache_tokens_left == 48
            await _check_serving(server_llama, connection, blocks=(0, 6), max_length=8)


async def test_allocation_without_waiting_fails_when_the_cache_is_full(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=8) as server,
            connect(server) as connection,
        ):
            async with session(connection, blocks=(0, 4), max_length=10, session_id="fills"):
                assert server.block_server.cache_tokens_left == 8
                opening = {"session_id": "late", "blocks": [0, 3], "max_length": 3}
                with pytest.raises(RemoteError) as caught:
                    await open_raw_session(connection, {**opening, "alloc_timeout": 0})
                assert caught.value.remote_type == "AllocationFailed"
                assert server.block_server.cache_tokens_left == 8
            # Once the first session is gone the same request fits.
            await _check_serving(server_llama, connection, blocks=(0, 3), max_length=3)


# -- 5. refusals -----------------------------------------------------------------------------------

#: The server of the refusal tests holds [1, 6); the session that stays open uses [2, 5).
HELD = (1, 6)
KEEPER = "keeper"
MAX_LENGTH = 32


async def _check_serving(
    checkpoint: TinyCheckpoint,
    connection: Connection,
    *,
    blocks: tuple[int, int] = (2, 5),
    max_length: int = 4,
) -> None:
    """A new session over ``blocks`` computes what the local blocks compute."""
    hidden = torch.randn(1, max_length, HIDDEN)
    async with session(
        connection, blocks=blocks, max_length=max_length, session_id="check"
    ) as opened:
        output = torch.cat(
            [await opened.step(hidden[:, :-1]), await opened.step(hidden[:, -1:])], dim=1
        )
    assert_close(output, run_local(local_blocks(checkpoint, *blocks), hidden))


async def _bad_step(connection: Connection, step: dict[str, Any], *, batch_size: int = 1) -> None:
    """Open a valid session of max_length 4, step 2 valid tokens, then send ``step``."""
    async with session(
        connection, blocks=(2, 5), max_length=4, batch_size=batch_size, session_id="bad"
    ) as opened:
        await opened.step(torch.randn(batch_size, 2, HIDDEN))
        await opened.step(step.pop("hidden_states"), **step)


def _opening(**fields: Any) -> dict[str, Any]:
    return {"session_id": "bad", "blocks": [2, 5], "max_length": 4, **fields}


async def _backward_mismatched(connection: Connection) -> None:
    await backward(connection, (2, 5), torch.randn(1, 4, HIDDEN), torch.randn(1, 3, HIDDEN))


async def _forward_without_hidden(connection: Connection) -> None:
    async with open_call(connection, FORWARD) as call:
        await send_tensors(call.send, {"blocks": [2, 5]}, {"prompts": torch.zeros(3, 1, 1, 64)})
        await call.receive()


async def _backward_without_grad(connection: Connection) -> None:
    async with open_call(connection, BACKWARD) as call:
        await send_tensors(call.send, {"blocks": [2, 5]}, {"hidden_states": torch.zeros(1, 2, 64)})
        await call.receive()


Refusal = Callable[[Connection], Awaitable[None]]

REFUSALS: dict[str, tuple[Refusal, str, str]] = {
    # name: (what the client does, remote type, part of the remote message)
    "unknown adapter": (
        lambda c: open_raw_session(c, _opening(active_adapter="nope")),
        "AdapterError",
        "unknown adapter 'nope'",
    ),
    "reused open session id": (
        lambda c: open_raw_session(c, _opening(session_id=KEEPER)),
        "ServerError",
        "session id 'keeper' is already in use",
    ),
    "wrong hidden size": (
        lambda c: _bad_step(c, {"hidden_states": torch.randn(1, 1, HIDDEN // 2)}),
        "ServerError",
        f"hidden_states must be (batch >= 1, tokens, {HIDDEN})",
    ),
    "wrong batch rows": (
        lambda c: _bad_step(c, {"hidden_states": torch.randn(3, 1, HIDDEN)}, batch_size=2),
        "ServerError",
        "the session has 2 rows; this step has 3",
    ),
    "integer dtype": (
        lambda c: _bad_step(c, {"hidden_states": torch.ones(1, 1, HIDDEN, dtype=torch.int64)}),
        "ServerError",
        "must be floating point",
    ),
    "steps past max_length": (
        lambda c: _bad_step(c, {"hidden_states": torch.randn(1, 3, HIDDEN)}),
        "ServerError",
        "2 + 3 positions exceed the session's max_length 4",
    ),
    "start_from_position beyond the position": (
        lambda c: _bad_step(
            c, {"hidden_states": torch.randn(1, 1, HIDDEN), "start_from_position": 3}
        ),
        "ServerError",
        "cannot start from position 3: the cache holds 2",
    ),
    "hypo_ids out of range": (
        lambda c: _bad_step(
            c,
            {"hidden_states": torch.randn(2, 1, HIDDEN), "hypo_ids": torch.tensor([0, 2])},
            batch_size=2,
        ),
        "ServerError",
        "hypo_ids must be (2,) integers in [0, batch)",
    ),
    "blocks outside the span": (
        lambda c: open_raw_session(c, _opening(blocks=[0, 3])),
        "CodecError",
        "blocks [0, 3) are not inside the blocks this server holds, [1, 6)",
    ),
    "max_length above inference_max_length": (
        lambda c: open_raw_session(c, _opening(max_length=MAX_LENGTH + 1)),
        "CodecError",
        f"max_length must be an integer in [1, {MAX_LENGTH}]",
    ),
    "malformed opening": (
        lambda c: open_raw_session(c, {"blocks": [2, 5], "max_length": 4}),
        "CodecError",
        "session_id must be a string",
    ),
    "forward without hidden_states": (
        _forward_without_hidden,
        "ServerError",
        "request refused: hidden_states must be a tensor",
    ),
    "backward without grad_outputs": (
        _backward_without_grad,
        "ServerError",
        "grad_outputs must have the shape of hidden_states",
    ),
    "backward with mismatched grad_outputs": (
        _backward_mismatched,
        "ServerError",
        "grad_outputs must have the shape of hidden_states, (1, 4, 64)",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
async def test_refusals_name_the_fault_and_the_server_keeps_serving(
    name: str, server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """While a session is open, another call breaks a rule: it gets the error naming the fault;
    the open session goes on computing the right thing, and a new one works too."""
    action, remote_type, message = REFUSALS[name]
    torch.manual_seed(9)
    hidden = torch.randn(1, 6, HIDDEN)
    limits = ServingLimits(inference_max_length=MAX_LENGTH)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=HELD, limits=limits) as server,
            connect(server) as connection,
        ):
            budget = server.block_server.cache_tokens_left
            async with session(
                connection, blocks=(2, 5), max_length=MAX_LENGTH, session_id=KEEPER
            ) as keeper:
                before = await keeper.step(hidden[:, :3])
                with pytest.raises(RemoteError) as caught:
                    await action(connection)
                assert caught.value.remote_type == remote_type
                assert message in caught.value.remote_message
                after = await keeper.step(hidden[:, 3:])
                assert keeper.position == 6
                await _check_serving(server_llama, connection)
            assert server.block_server.cache_tokens_left == budget
            assert (await info(connection)).open_sessions == 0
    assert_close(
        torch.cat([before, after], dim=1), run_local(local_blocks(server_llama, 2, 5), hidden)
    )
