"""Exhaustion: what one peer may hold is bounded, idle clients lose their sessions and free the
cache, requests beyond the budget are refused at once, and the server serves others meanwhile."""

from __future__ import annotations

import threading
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import INFERENCE
from petals_core.server import ServingLimits
from petals_core.transport import Connection, open_call, open_node

from ..models.conftest import TinyCheckpoint
from ._client import (
    HIDDEN,
    assert_close,
    forward,
    info,
    local_blocks,
    open_raw_session,
    run_local,
    serve_and_connect,
    session,
)

DEADLINE_S = 30.0


async def test_a_peer_holds_at_most_its_share_of_sessions(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    limits = ServingLimits(max_sessions_per_peer=3)
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir, limits=limits) as (server, greedy):
            async with AsyncExitStack() as stack:
                for i in range(3):
                    await stack.enter_async_context(
                        session(greedy, blocks=(0, 6), max_length=8, session_id=f"s{i}")
                    )
                with pytest.raises(RemoteError, match="already holds 3 sessions") as refused:
                    async with session(greedy, blocks=(0, 6), max_length=8, session_id="s3"):
                        pass
                assert refused.value.remote_type == "ServerError"
                # Another peer is not affected.
                async with open_node() as other_node:
                    other = await other_node.connect(server.multiaddrs[0])
                    async with session(other, blocks=(0, 6), max_length=8, session_id="o") as s:
                        out = await s.step(torch.randn(1, 2, 64))
                        assert out.shape == (1, 2, 64)
            # The greedy peer's sessions are closed: it may open again.
            async with session(greedy, blocks=(0, 6), max_length=8, session_id="again"):
                pass


async def test_openings_waiting_for_cache_count_against_the_peers_share(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """48 tokens of cache, 40 of them held by a session: the same peer's opening for all 48
    waits, and counts against its share of 2, so its next opening is refused though it would fit;
    another peer's that fits is granted at once beside the waiting one."""
    limits = ServingLimits(max_sessions_per_peer=2)
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(
            server_llama, cache_dir, limits=limits, attn_cache_tokens=8
        ) as (server, greedy):
            async with (
                trio.open_nursery() as nursery,
                session(greedy, blocks=(0, 4), max_length=10, session_id="holds"),
            ):
                waiting = {"session_id": "waits", "blocks": [0, 6], "max_length": 8}
                nursery.start_soon(open_raw_session, greedy, {**waiting, "alloc_timeout": 3600.0})
                await server.block_server.wait_statistics(lambda s: s.openings == 1)
                small = {"session_id": "small", "blocks": [0, 1], "max_length": 8}
                with pytest.raises(RemoteError, match="already holds 2 sessions") as refused:
                    await open_raw_session(greedy, {**small, "alloc_timeout": 0})
                assert refused.value.remote_type == "ServerError"
                async with (
                    open_node() as other_node,
                    session(
                        await other_node.connect(server.multiaddrs[0]),
                        blocks=(0, 1),
                        max_length=8,
                        session_id="other",
                    ) as other,
                ):
                    assert (await other.step(torch.randn(1, 2, 64))).shape == (1, 2, 64)
            # Once "holds" is closed the waiting opening is granted (and its call ends).
            await server.block_server.wait_statistics(lambda s: s.openings == s.sessions == 0)
            async with session(greedy, blocks=(0, 1), max_length=8, session_id="again"):
                pass


async def test_an_idle_client_loses_its_session_and_the_cache_comes_back(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    limits = ServingLimits(step_timeout_s=0.5)
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir, limits=limits) as (server, client):
            baseline = (await info(client)).cache_tokens_left
            async with open_call(client, INFERENCE) as call:
                await call.send({"session_id": "idle", "blocks": [0, 6], "max_length": 32})
                assert await call.receive() == {"ready": True, "position": 0}
                assert (await info(client)).cache_tokens_left == baseline - 32 * 6
                # Send nothing: the server gives up on us with a clear reason.
                with pytest.raises(RemoteError, match="step timeout") as ended:
                    await call.receive()
                assert ended.value.remote_type == "ServerError"
            assert (await info(client)).cache_tokens_left == baseline
            assert server.block_server.open_sessions == 0


async def test_a_client_that_never_opens_its_session_is_dropped(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    limits = ServingLimits(step_timeout_s=0.5)
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir, limits=limits) as (server, client):
            async with open_call(client, INFERENCE) as call:
                with pytest.raises(RemoteError, match="no session request"):
                    await call.receive()
            assert server.block_server.open_sessions == 0


async def test_many_abandoned_streams_leave_the_server_serving(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir) as (_, connection):
            baseline = (await info(connection)).cache_tokens_left
            for round_ in range(3):
                async with trio.open_nursery() as nursery:
                    for i in range(40):
                        nursery.start_soon(_abandon, connection, f"{round_}-{i}")
            async with session(connection, blocks=(0, 6), max_length=4, session_id="ok") as s:
                assert (await s.step(torch.randn(1, 1, 64))).shape == (1, 1, 64)
            assert (await info(connection)).cache_tokens_left == baseline


async def _abandon(connection: Connection, session_id: str) -> None:
    """Open a session call, send half an opening, and leave: the stream is reset."""
    with trio.CancelScope() as scope:
        async with open_call(connection, INFERENCE) as call:
            await call.send({"session_id": session_id})
            scope.cancel()
            await trio.lowlevel.checkpoint()


async def test_forwards_wait_their_turn_per_peer(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """At most 2 calls of one peer are read and computed at once: its third forward waits for
    one of its own, another peer's goes ahead; once the computation goes on, every forward gets
    its answer."""
    limits = ServingLimits(max_requests_per_peer=2)
    hidden = torch.randn(1, 3, HIDDEN)
    expected = run_local(local_blocks(server_llama, 0, 2), hidden)
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir, limits=limits) as (server, greedy):
            backend = server.backend
            assert backend is not None
            go_on = threading.Event()
            forward_block = backend.forward_block

            def held(*args: Any, **kwargs: Any) -> Any:
                go_on.wait()  # in the pool's worker: the calls holding a turn stay there
                return forward_block(*args, **kwargs)

            backend.forward_block = held  # type: ignore[method-assign]
            blocks = server.block_server
            outputs: list[torch.Tensor] = []

            async def forwarded(connection: Connection) -> None:
                outputs.append(await forward(connection, (0, 2), hidden))

            def counts(waiting: int, running: int) -> Any:
                return lambda s: (s.requests_waiting, s.requests_running) == (waiting, running)

            try:
                async with open_node(host="127.0.0.1") as other, trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(forwarded, greedy)
                    await blocks.wait_statistics(counts(waiting=1, running=2))
                    nursery.start_soon(forwarded, await other.connect(server.multiaddrs[0]))
                    await blocks.wait_statistics(counts(waiting=1, running=3))
                    go_on.set()
            finally:
                go_on.set()
            assert len(outputs) == 4
            for output in outputs:
                assert_close(output, expected)
            assert blocks.statistics().requests_waiting == 0


async def test_calls_waiting_their_turn_do_not_stall_the_one_under_way(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """One turn per peer, and four calls waiting with more than their stream's window to send
    (4 MiB each): held back on their streams, they leave the connection's window (16 MiB) to
    the call being read, which gets its answer, and then each of them."""
    limits = ServingLimits(max_requests_per_peer=1)
    large = torch.randn(2560, 64, HIDDEN)  # 40 MiB
    small = torch.randn(320, 64, HIDDEN)  # 5 MiB
    with trio.fail_after(DEADLINE_S):
        async with serve_and_connect(server_llama, cache_dir, limits=limits) as (server, client):
            outputs: dict[int, torch.Tensor] = {}

            async def forwarded(index: int, hidden: torch.Tensor) -> None:
                outputs[index] = await forward(client, (0, 1), hidden)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(forwarded, 0, large)
                await server.block_server.wait_statistics(lambda s: s.requests_running == 1)
                for index in range(1, 5):
                    nursery.start_soon(forwarded, index, small)
            assert sorted(outputs) == [0, 1, 2, 3, 4]
            assert outputs[0].shape == large.shape
