"""Servers in a swarm, end to end on loopback: what they announce, which blocks they choose, how
they move to fill a gap, how they end sessions when they leave, and that a long forward pass never
holds up inference steps or pings.

Every server is a real :func:`open_server` over the QUIC transport; what the swarm sees is read
by a separate client-mode DHT node that follows the model (:func:`follower`), as a client would.
Nothing sleeps to wait for an event: each test waits on the snapshot, an announcement or a reply,
under a generous ``trio.fail_after``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from petals_core import RemoteError, __version__
from petals_core.dht import (
    MODELS_KEY,
    ModelInfo,
    PeerTableSnapshot,
    ServerInfo,
    ServerState,
    Topic,
    get_models,
    open_dht_node,
)
from petals_core.protocol import FORWARD, INFERENCE, receive_tensors, send_tensors
from petals_core.server import (
    Server,
    ServerConfig,
    ServingLimits,
    _server as server_module,
    open_server,
)
from petals_core.transport import Identity, call_unary, open_call, open_node

from ..models.conftest import TinyCheckpoint
from ._client import connect, forward, session

#: Deadline of every wait on the swarm; far above what any of them takes.
DEADLINE_S = 30.0
#: How often servers re-announce and re-read the swarm in these tests.
UPDATE_PERIOD_S = 0.5
#: A departed server stays in the DHT's routing tables for a while, and each lookup that asks it
#: waits for the request timeout (the server's DHT node uses ``request_timeout_s``, at most
#: 10 s): a short one keeps the announcements that follow a departure quick.
QUICK_LIMITS = ServingLimits(request_timeout_s=2.0)


def server_config(checkpoint: TinyCheckpoint, cache_dir: Path, **fields: Any) -> ServerConfig:
    """A fp32 CPU server on loopback whose throughput is given (nothing is measured), with
    :data:`QUICK_LIMITS` unless ``limits`` is given."""
    settings: dict[str, Any] = {
        "model": str(checkpoint.folder),
        "host": "127.0.0.1",
        "throughput": 1.0,
        "torch_dtype": "float32",
        "device": "cpu",
        "cache_dir": str(cache_dir),
        "update_period_s": UPDATE_PERIOD_S,
        "limits": QUICK_LIMITS,
    }
    settings.update(fields)
    return ServerConfig(**settings)


def joining(
    server: Server, checkpoint: TinyCheckpoint, cache_dir: Path, **fields: Any
) -> ServerConfig:
    """A config that joins the swarm of ``server`` through its multiaddr."""
    return server_config(
        checkpoint, cache_dir, initial_peers=(str(server.multiaddrs[0]),), **fields
    )


def identity(seed: int) -> Identity:
    """A fixed key, so that a test knows a server's PeerID before it starts."""
    return Identity.from_private_bytes(bytes([seed]) * 32)


@asynccontextmanager
async def follower(server: Server) -> AsyncIterator[Topic]:
    """A client-mode DHT node that joins through ``server`` and follows its model."""
    async with open_dht_node(
        initial_peers=[str(server.multiaddrs[0])], client_mode=True, request_timeout_s=2.0
    ) as dht:
        yield dht.follow(
            server.dht_prefix, server.num_blocks_total, update_period_s=UPDATE_PERIOD_S
        )


def announced(snapshot: PeerTableSnapshot, peer_id: str) -> dict[int, ServerInfo]:
    """What ``peer_id`` announced, by the blocks it is listed under in ``snapshot``."""
    return {
        block: servers[peer_id] for block, servers in snapshot.blocks.items() if peer_id in servers
    }


def listed_as(
    peer_id: str, state: ServerState, blocks: range
) -> Callable[[PeerTableSnapshot], bool]:
    """A snapshot predicate: ``peer_id`` is listed under exactly ``blocks``, in ``state``."""

    def predicate(snapshot: PeerTableSnapshot) -> bool:
        infos = announced(snapshot, peer_id)
        return set(infos) == set(blocks) and all(
            info.state is state
            and (info.start_block, info.end_block) == (blocks.start, blocks.stop)
            for info in infos.values()
        )

    return predicate


async def serve_until(
    config: ServerConfig,
    leave: trio.Event,
    *,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a server in a task of its own (``nursery.start`` returns it) until ``leave``."""
    async with open_server(config, seed=1) as server:
        task_status.started(server)
        await leave.wait()


@contextmanager
def _released_on_exit(release: threading.Event) -> Iterator[None]:
    """Let a held loading thread go however the block ends (a failing test must not wait for
    it)."""
    try:
        yield
    finally:
        release.set()


# -- announcements -----------------------------------------------------------------------------


async def test_announces_joining_then_online_then_offline(
    server_llama: TinyCheckpoint, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joining server is listed as JOINING while it loads, ONLINE with its fields once it
    serves, and not at all once it has left."""
    loading = identity(2)
    loading_id = str(loading.peer_id)
    release = threading.Event()
    load = server_module.Server._load

    def held_load(self: Server, blocks: range) -> Any:
        # Only the server under test waits (in its loading thread) until the test has seen it
        # JOINING; the loading itself is the real one.
        if str(self.dht.peer_id) == loading_id and not release.wait(DEADLINE_S):
            raise RuntimeError("the test never released the loading")
        return load(self, blocks)

    monkeypatch.setattr(server_module.Server, "_load", held_load)
    config = server_config(server_llama, cache_dir, new_swarm=True, block_indices=(0, 3))
    async with (
        open_server(config, seed=0) as first,
        follower(first) as topic,
        trio.open_nursery() as nursery,
    ):
        started: list[Server] = []
        serving, leave, left = trio.Event(), trio.Event(), trio.Event()

        async def run_second() -> None:
            second_config = joining(first, server_llama, cache_dir, num_blocks=3, throughput=1.5)
            async with open_server(second_config, identity=loading, seed=1) as second:
                started.append(second)
                serving.set()
                await leave.wait()
            left.set()

        with trio.fail_after(DEADLINE_S), _released_on_exit(release):
            await topic.wait_snapshot(
                listed_as(str(first.dht.peer_id), ServerState.ONLINE, range(0, 3))
            )
            nursery.start_soon(run_second)
            # The gap 3:6 is what it takes; it says so before it has loaded anything.
            snapshot = await topic.wait_snapshot(
                listed_as(loading_id, ServerState.JOINING, range(3, 6))
            )
            info = announced(snapshot, loading_id)[3]
            assert not serving.is_set()
            assert info.cache_tokens_left is None

            release.set()
            await serving.wait()
            (second,) = started
            assert second.blocks == range(3, 6)
            assert second.state is ServerState.ONLINE
            snapshot = await topic.wait_snapshot(
                listed_as(loading_id, ServerState.ONLINE, range(3, 6))
            )
            info = announced(snapshot, loading_id)[4]
            assert info.version == __version__
            assert info.torch_dtype == "float32"
            assert info.throughput == 1.5
            assert info.quant_type == "none"
            assert info.adapters == ()
            assert info.cache_tokens_left == second.block_server.cache_tokens_left > 0
            assert str(second.multiaddrs[0]) in info.addresses
            # Every block of its span carries the same announcement.
            assert len(set(announced(snapshot, loading_id).values())) == 1

            leave.set()
            await left.wait()
            await topic.wait_snapshot(lambda s: loading_id not in s.peer_ids)
            # The server that stays is still listed.
            assert listed_as(str(first.dht.peer_id), ServerState.ONLINE, range(0, 3))(
                topic.snapshot()
            )


async def test_a_server_files_its_model_in_the_registry(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Its announcements file the model under MODELS_KEY as well, for as long: a reader finds
    the model without knowing its prefix (a local folder: no repository to name)."""
    config = server_config(server_llama, cache_dir, new_swarm=True, block_indices=(0, 3))
    with trio.fail_after(DEADLINE_S):
        async with (
            open_server(config, seed=0) as server,
            open_dht_node(
                initial_peers=[str(server.multiaddrs[0])], client_mode=True, request_timeout_s=2.0
            ) as reader,
        ):
            assert await get_models(reader) == {
                server.dht_prefix: ModelInfo(num_blocks=6, repository=None, model_type="llama")
            }
            registry = await reader.get(MODELS_KEY, latest=True)
            block = await reader.get(f"{server.dht_prefix}.0", latest=True)
            assert registry is not None and block is not None
            expiration = registry.entries[server.dht_prefix].expiration
            assert expiration > time.time() + config.effective_expiration_s - 60
            assert expiration == pytest.approx(block.expiration, abs=30)


# -- block choice ------------------------------------------------------------------------------


async def test_servers_choose_the_weakest_blocks(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """An empty swarm's first server starts at 0, the next fills the gap, and the third goes
    where the swarm's throughput is lowest."""
    with trio.fail_after(DEADLINE_S):
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(
                open_server(
                    server_config(
                        server_llama, cache_dir, new_swarm=True, num_blocks=3, throughput=2.0
                    ),
                    seed=0,
                )
            )
            assert first.blocks == range(0, 3)
            second = await stack.enter_async_context(
                open_server(
                    joining(first, server_llama, cache_dir, num_blocks=3, throughput=1.0), seed=1
                )
            )
            assert second.blocks == range(3, 6)
            # Blocks 0:3 hold 2.0, blocks 3:6 hold 1.0: two blocks go best at 3:5.
            third = await stack.enter_async_context(
                open_server(
                    joining(first, server_llama, cache_dir, num_blocks=2, throughput=1.0), seed=2
                )
            )
            assert third.blocks == range(3, 5)
            topic = await stack.enter_async_context(follower(first))
            expected = {first: range(0, 3), second: range(3, 6), third: range(3, 5)}
            for server, blocks in expected.items():
                await topic.wait_snapshot(
                    listed_as(str(server.dht.peer_id), ServerState.ONLINE, blocks)
                )


# -- rebalancing -------------------------------------------------------------------------------


async def test_server_moves_to_fill_a_gap(server_llama: TinyCheckpoint, cache_dir: Path) -> None:
    """B duplicates A's blocks 0:3 while C holds 3:6; once C leaves, B moves to 3:6, and the
    session it had open ends with a reason that says it moved."""
    with trio.fail_after(DEADLINE_S):
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(
                open_server(
                    server_config(server_llama, cache_dir, new_swarm=True, block_indices=(0, 3)),
                    seed=0,
                )
            )
            nursery = await stack.enter_async_context(trio.open_nursery())
            # C runs in a task of its own: it leaves while servers started after it stay.
            leave = trio.Event()
            leaving: Server = await nursery.start(
                serve_until,
                joining(first, server_llama, cache_dir, block_indices=(3, 6)),
                leave,
            )
            mover = await stack.enter_async_context(
                open_server(
                    joining(
                        first,
                        server_llama,
                        cache_dir,
                        num_blocks=3,
                        balance_quality=1.0,
                        mean_balance_check_period_s=0.2,
                    ),
                    seed=2,
                )
            )
            # Every window ties (each block has one server): it takes the first.
            assert mover.blocks == range(0, 3)
            topic = await stack.enter_async_context(follower(first))
            mover_id = str(mover.dht.peer_id)
            await topic.wait_snapshot(listed_as(mover_id, ServerState.ONLINE, range(0, 3)))
            # Checks of the balance have run meanwhile: with no gap, it stays.
            assert mover.moves == 0

            connection = await stack.enter_async_context(connect(mover))
            call = await stack.enter_async_context(open_call(connection, INFERENCE))
            await call.send({"session_id": "before-move", "blocks": [0, 3], "max_length": 8})
            assert await call.receive() == {"ready": True, "position": 0}

            leave.set()
            await topic.wait_snapshot(lambda s: str(leaving.dht.peer_id) not in s.peer_ids)
            with pytest.raises(RemoteError) as raised:
                await call.receive()
            assert raised.value.remote_type == "ServerError"
            assert "moving" in raised.value.remote_message

            await topic.wait_snapshot(listed_as(mover_id, ServerState.ONLINE, range(3, 6)))
            assert mover.blocks == range(3, 6)
            assert mover.moves == 1
            # It serves its new blocks.
            hidden = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(0))
            output = await forward(connection, (3, 6), hidden)
            assert output.shape == hidden.shape


# -- leaving -----------------------------------------------------------------------------------


async def test_shutdown_ends_open_sessions_with_the_reason(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """Leaving ``open_server`` ends an open session with an error that says why."""
    with trio.fail_after(DEADLINE_S):
        async with open_node(host="127.0.0.1") as client, AsyncExitStack() as calls:
            async with open_server(
                server_config(server_llama, cache_dir, new_swarm=True, block_indices=(0, 6)),
                seed=0,
            ) as server:
                connection = await client.connect(server.multiaddrs[0])
                call = await calls.enter_async_context(open_call(connection, INFERENCE))
                await call.send({"session_id": "open", "blocks": [0, 6], "max_length": 8})
                assert await call.receive() == {"ready": True, "position": 0}
                assert server.block_server.open_sessions == 1
            with pytest.raises(RemoteError) as raised:
                await call.receive()
            assert raised.value.remote_type == "ServerError"
            assert "shutting down" in raised.value.remote_message


# -- scheduling --------------------------------------------------------------------------------


async def test_long_forward_never_delays_steps_or_pings(
    server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """While a forward pass over every block of 8 x 4000 tokens runs, a session's 20 steps and
    20 pings all complete: the forward's reply comes after all of them."""
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(8, 4000, 64, generator=generator)  # (B, T, hidden)
    tokens = torch.randn(1, 20, 64, generator=generator)  # (B, T, hidden)
    done: list[str] = []
    async with (
        open_server(
            server_config(
                server_llama,
                cache_dir,
                new_swarm=True,
                block_indices=(0, 6),
                limits=ServingLimits(),
            ),
            seed=0,
        ) as server,
        connect(server) as connection,
        session(connection, blocks=(0, 6), max_length=32, session_id="steps") as steps,
    ):
        sent = trio.Event()

        async def long_forward() -> None:
            async with open_call(connection, FORWARD) as call:
                await send_tensors(call.send, {"blocks": [0, 6]}, {"hidden_states": big})
                sent.set()
                _, tensors = await receive_tensors(call.receive, max_elements=1 << 24)
            assert tensors["hidden_states"].shape == big.shape
            done.append("forward")

        async def step_all() -> None:
            await sent.wait()
            for index in range(20):
                output = await steps.step(tokens[:, index : index + 1])
                assert output.shape == (1, 1, 64)
                done.append(f"step {index}")

        async def ping_all() -> None:
            await sent.wait()
            for index in range(20):
                reply = await call_unary(connection, "dht.ping", {"client": True})
                assert reply["peer_id"] == str(server.dht.peer_id)
                done.append(f"ping {index}")

        with trio.fail_after(DEADLINE_S * 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_forward)
                nursery.start_soon(step_all)
                nursery.start_soon(ping_all)
    assert len(done) == 41
    assert done[-1] == "forward", done
