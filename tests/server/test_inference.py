"""Inference sessions of a real server on loopback, against local blocks of the same checkpoint:
their results (sub-spans, chunked prefills, rollbacks, beam reordering, deep prompts, batching),
and the cache they hold.

Every result is compared with :class:`LlamaBlock` objects loaded from the checkpoint the server
serves (fp32, within 1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import FORWARD, INFERENCE, send_tensors
from petals_core.server import ServingLimits
from petals_core.transport import Connection, open_call

from ..dht._swarm import wait_until
from ..models.conftest import TinyCheckpoint
from ._client import (
    DEADLINE_S,
    HIDDEN,
    assert_close,
    check_serving,
    connect,
    forward,
    info,
    local_blocks,
    open_raw_session,
    run_local,
    run_local_cached,
    serve,
    serve_and_connect,
    served_session,
    session,
)
from .fuzz_rpc import RawCall

# -- sessions --------------------------------------------------------------------------------------


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
        async with served_session(
            server_llama, cache_dir, served=(0, 6), blocks=(2, 5), max_length=16, batch_size=2
        ) as opened:
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
        limits = ServingLimits(max_batch_tokens=4)
        async with served_session(
            server_llama, cache_dir, blocks=(1, 4), max_length=14, batch_size=2, limits=limits
        ) as opened:
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
        async with served_session(server_llama, cache_dir, blocks=(0, 3), max_length=8) as opened:
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
        async with served_session(
            server_llama, cache_dir, served=(0, 6), blocks=(2, 5), max_length=8, batch_size=3
        ) as b:
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
        async with served_session(
            server_llama, cache_dir, blocks=(1, 4), max_length=8, batch_size=2
        ) as opened:
            outputs = [await opened.step(hidden[:, :5], prompts=prompts)]
            for t in range(5, 8):
                outputs.append(await opened.step(hidden[:, t : t + 1]))
    assert_close(torch.cat(outputs, dim=1), expected)
    assert not torch.allclose(expected, run_local(local_blocks(server_llama, 1, 4), hidden))


async def test_a_malformed_frame_mid_session_is_reported_and_the_server_goes_on(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Bytes that are no frame, after a step: the session ends with a protocol error sent to
    its client (the client's stream is read by a task of its own), and the server serves on."""
    torch.manual_seed(24)
    hidden = torch.randn(1, 3, HIDDEN)
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir) as (_, connection):
            call = await RawCall.open(connection, INFERENCE)
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


# -- batching --------------------------------------------------------------------------------------


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


# -- cache accounting ------------------------------------------------------------------------------


async def test_session_holds_its_cache_until_it_closes(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(
            server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=1000
        ) as (server, connection):
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
        async with serve_and_connect(
            server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=8
        ) as (server, connection):
            opening = {"session_id": "big", "blocks": [0, 6], "max_length": 10}
            with pytest.raises(RemoteError) as caught:
                await open_raw_session(connection, {**opening, "alloc_timeout": 3600.0})
            assert caught.value.remote_type == "SessionTooLarge"
            assert server.block_server.cache_tokens_left == 48
            await check_serving(server_llama, connection, blocks=(0, 6), max_length=8)


async def test_a_move_refuses_the_openings_that_wait_or_were_not_sent_yet(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """A server leaving its blocks (to move to others) refuses, naming why, an opening that
    waits for cache, and the session and forward whose calls were opened before but sent
    after: none runs on the blocks it leaves (nor keeps them in memory meanwhile)."""
    moving = "moving to blocks 3:6"
    with trio.fail_after(DEADLINE_S):
        async with (
            serve_and_connect(server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=8) as (
                server,
                connection,
            ),
            # Opened first: their handlers start before the cache fills (loopback keeps order).
            open_call(connection, INFERENCE) as early,
            open_call(connection, FORWARD) as early_forward,
            open_call(connection, INFERENCE) as fills,
        ):
            blocks = server.block_server
            opening = {"blocks": [0, 3], "max_length": 3, "alloc_timeout": DEADLINE_S}
            await fills.send({**opening, "max_length": 14, "session_id": "fills"})
            assert await fills.receive() == {"ready": True, "position": 0}
            assert blocks.cache_tokens_left == 8 * 6 - 14 * 3
            waiting = open_raw_session(connection, {**opening, "session_id": "waits"})
            async with trio.open_nursery() as nursery:

                async def refused() -> None:
                    with pytest.raises(RemoteError, match=moving):
                        await waiting

                nursery.start_soon(refused)
                await wait_until(lambda: blocks.statistics().openings == 1)
                blocks.detach(moving)
            await early.send({**opening, "session_id": "early"})
            with pytest.raises(RemoteError, match=moving):
                await early.receive()
            hidden = torch.randn(1, 2, HIDDEN)
            await send_tensors(early_forward.send, {"blocks": [0, 3]}, {"hidden_states": hidden})
            with pytest.raises(RemoteError, match=moving):
                await early_forward.receive()
            assert blocks.statistics().openings == 0


async def test_allocation_without_waiting_fails_when_the_cache_is_full(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(
            server_llama, cache_dir, blocks=(0, 6), attn_cache_tokens=8
        ) as (server, connection):
            async with session(connection, blocks=(0, 4), max_length=10, session_id="fills"):
                assert server.block_server.cache_tokens_left == 8
                opening = {"session_id": "late", "blocks": [0, 3], "max_length": 3}
                with pytest.raises(RemoteError) as caught:
                    await open_raw_session(connection, {**opening, "alloc_timeout": 0})
                assert caught.value.remote_type == "AllocationFailed"
                assert server.block_server.cache_tokens_left == 8
            # Once the first session is gone the same request fits.
            await check_serving(server_llama, connection, blocks=(0, 3), max_length=3)
