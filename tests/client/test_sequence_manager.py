"""The sequence manager: a frozen config that nothing changes, slices that keep every setting and
share state, nothing started before first use, bans that double, exponential capped backoff,
the retry budget, and a missing block named after ``request_timeout_s`` (real in-process servers).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import attrs
import pytest
import torch
import trio
from hypothesis import given, strategies as st

from petals_core import ConfigError
from petals_core.client import (
    RemoteSequenceManager,
    RemoteSequential,
    SequenceManagerConfig,
    remote_forward,
)
from petals_core.dht import PeerTableSnapshot
from petals_core.protocol import PUSH_GRANTS
from petals_core.routing import MissingBlocksError, RouteSpan

from ..dht._swarm import wait_until
from ..routing._servers import server
from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    Model,
    in_process_swarm,
    manager_for,
)

PEER = "QmPeerThatFailed"


def config(**fields: object) -> SequenceManagerConfig:
    settings: dict[str, object] = {
        "initial_peers": ("/ip4/127.0.0.1/udp/1/quic-v1/p2p/QmNobody",),
        "dht_prefix": "tiny",
        "request_timeout_s": 7.0,
        "ban_timeout_s": 10.0,
        "max_retries": 2,
    }
    settings.update(fields)
    return SequenceManagerConfig(**settings)  # type: ignore[arg-type]


def test_config_is_frozen_and_validated() -> None:
    settings = config()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.request_timeout_s = 1.0  # type: ignore[misc]
    assert settings.initial_peers == ("/ip4/127.0.0.1/udp/1/quic-v1/p2p/QmNobody",)
    assert config(allowed_servers=["a", "b"]).allowed_servers == frozenset({"a", "b"})
    for bad in (
        {"request_timeout_s": 0},
        {"ban_timeout_s": -1.0},
        {"min_backoff_s": 5.0, "max_backoff_s": 1.0},
        {"max_retries": -1},
    ):
        with pytest.raises(ConfigError):
            config(**bad)
    with pytest.raises(ConfigError, match="dht_prefix"):
        RemoteSequenceManager(config(dht_prefix=None), N_BLOCKS)
    with pytest.raises(ConfigError, match="block_indices"):
        RemoteSequenceManager(config(), N_BLOCKS, block_indices=range(4, 8))


def test_slices_keep_every_setting_and_share_state() -> None:
    settings = config()
    before = attrs.asdict(settings)
    manager = RemoteSequenceManager(settings, N_BLOCKS)
    part = manager[1:3]
    assert part.config is manager.config
    assert part.config.request_timeout_s == 7.0
    assert part.block_indices == range(1, 3)
    assert part.state is manager.state
    assert part[1:].block_indices == range(2, 3)
    assert part[1:].config is settings
    assert [m.block_indices for m in manager[4:]] == [range(4, 5), range(5, 6)]
    assert manager[-1].block_indices == range(5, 6)
    for bad in (slice(3, 3), slice(0, 6, 2)):
        with pytest.raises(IndexError):
            manager[bad]
    with pytest.raises(IndexError):
        manager[6]
    # A ban made through a slice is the parent's (and every other slice's).
    part.on_request_failure(PEER)
    assert manager.is_banned(PEER)
    assert manager[4:].is_banned(PEER)
    manager.on_request_success(PEER)
    assert not part.is_banned(PEER)
    # Slicing a module slices its manager the same way.
    seq = RemoteSequential(manager)
    assert seq[1:3].sequence_manager.config is settings
    assert seq[1:3].sequence_manager.state is manager.state
    assert len(seq[3:]) == 3
    # Nothing above changed the config.
    assert attrs.asdict(settings) == before
    assert manager.config is settings


def test_construction_starts_nothing() -> None:
    threads = set(threading.enumerate())
    manager = RemoteSequenceManager(config(), N_BLOCKS)
    seq = RemoteSequential(manager)
    seq[2:4]
    assert set(threading.enumerate()) <= threads  # none started (others may have ended)
    assert manager.state.loop_token is None
    assert manager.state.started is None
    assert manager.state.dht is None
    assert not manager.running
    with pytest.raises(RuntimeError, match="not running"):
        manager.servers()


def test_bans_double_and_success_clears() -> None:
    manager = RemoteSequenceManager(config(ban_timeout_s=10.0), N_BLOCKS)
    manager.on_request_failure(None)  # a failure nobody caused bans nobody
    assert not manager.state.bans
    began = time.monotonic()
    manager.on_request_failure(PEER)
    ended = time.monotonic()
    first = manager.state.bans[PEER]
    assert first.failures == 1
    assert began + 10.0 <= first.until <= ended + 10.0
    began = time.monotonic()
    manager[2:3].on_request_failure(PEER)
    ended = time.monotonic()
    second = manager.state.bans[PEER]
    assert second.failures == 2
    assert began + 20.0 <= second.until <= ended + 20.0
    manager.on_request_failure(PEER)
    assert manager.state.bans[PEER].failures == 3
    assert manager.state.bans[PEER].until >= ended + 40.0
    manager.on_request_success(PEER)
    assert PEER not in manager.state.bans
    assert not manager.is_banned(PEER)


@given(
    min_backoff_s=st.floats(0.01, 10.0),
    factor=st.floats(1.0, 100.0),
    attempt=st.integers(1, 60),
)
def test_retry_delay_is_exponential_and_capped(
    min_backoff_s: float, factor: float, attempt: int
) -> None:
    manager = RemoteSequenceManager(
        config(min_backoff_s=min_backoff_s, max_backoff_s=min_backoff_s * factor), N_BLOCKS
    )
    delay = manager.retry_delay(attempt)
    assert manager.retry_delay(0) == 0.0
    assert delay == min(min_backoff_s * 2 ** (attempt - 1), min_backoff_s * factor)
    assert min_backoff_s <= delay <= min_backoff_s * factor
    assert manager.retry_delay(attempt + 1) >= delay
    if delay < min_backoff_s * factor / 2:
        assert manager.retry_delay(attempt + 1) == 2 * delay


def test_max_retries() -> None:
    limited = RemoteSequenceManager(config(max_retries=2), N_BLOCKS)
    assert [limited.may_retry(attempt) for attempt in (1, 2, 3)] == [True, True, False]
    assert not RemoteSequenceManager(config(max_retries=0), N_BLOCKS).may_retry(1)
    forever = RemoteSequenceManager(config(max_retries=None), N_BLOCKS)
    assert forever.may_retry(10**6)


async def test_missing_block_is_named_after_missing_blocks_timeout(
    model: Model, tmp_path: Path
) -> None:
    """Nobody serves blocks 3:6: routes over them wait ``missing_blocks_timeout_s`` (not
    ``request_timeout_s``), then name them and the servers seen; a forward raises that error
    itself (not an exception group)."""
    async with in_process_swarm(model, tmp_path, [(0, 3)]) as swarm:
        manager = manager_for(
            list(swarm.servers.values()),
            missing_blocks_timeout_s=1.0,
            request_timeout_s=10 * DEADLINE_S,
            max_retries=1,
        )
        settings = attrs.asdict(manager.config)
        with trio.fail_after(DEADLINE_S):
            async with RemoteSequential(manager):
                route = await manager[:3].make_sequence()
                assert [(s.start, s.end) for s in route] == [(0, 3)]
                with pytest.raises(MissingBlocksError) as missing:
                    await manager.make_sequence(mode="max_throughput")
                assert missing.value.blocks == (3, 4, 5)
                (server,) = swarm.servers
                assert missing.value.servers_seen == (f"{server} [0:3) usable",)
                assert str(missing.value) == (
                    f"no server holds blocks 3, 4, 5 (of [0, 6)) of the model "
                    f"{manager.config.dht_prefix!r}; servers seen: {server} [0:3) usable"
                )
                with pytest.raises(MissingBlocksError) as missing:
                    await remote_forward(manager[2:5], torch.zeros(1, 2, HIDDEN))
                assert missing.value.blocks == (3, 4)
                assert not manager.state.bans  # nobody failed: nobody is banned
        assert attrs.asdict(manager.config) == settings


async def test_a_route_is_used_while_its_new_servers_are_pinged(
    model: Model, tmp_path: Path
) -> None:
    """The pings that measure a route's servers for later routes run beside the route's use:
    the route comes back before its new server has answered a ping."""
    async with in_process_swarm(model, tmp_path, [(0, 6)]) as swarm:
        manager = manager_for(list(swarm.servers.values()))
        (server,) = swarm.servers
        with trio.fail_after(DEADLINE_S):
            async with RemoteSequential(manager):
                route = await manager.make_sequence(mode="min_latency")
                assert [span.peer_id for span in route] == [server]
                assert server not in manager.state.pings
                await wait_until(lambda: server in manager.state.pings)
                assert not manager.state.pinging


@pytest.mark.parametrize(
    ("rates", "tokens", "nbytes", "expected"),
    [
        # No announcement seen: the floor, plus the transfer at 1 MB/s (ten times).
        (None, 1, 0, 5.0),
        (None, 1, 50_000, 5.0 + 10 * 0.1),
        # A decode step at the announced inference speed: 1 token x 4 blocks / 2 per second.
        ({"inference_rps": 2.0, "forward_rps": 1000.0}, 1, 0, 5.0 + 10 * 2.0),
        # A prefill at the forward speed, capped by request_timeout_s.
        ({"inference_rps": 2.0, "forward_rps": 8.0}, 8, 0, 5.0 + 10 * 4.0),
        ({"inference_rps": 2.0, "forward_rps": 1.0}, 64, 0, 120.0),
        # Speeds not announced: the throughput.
        ({}, 50, 0, 5.0 + 10 * 2.0),
    ],
)
def test_the_step_timeout_scales_with_the_expected_compute(
    rates: dict[str, float] | None, tokens: int, nbytes: int, expected: float
) -> None:
    manager = manager_for(dht_prefix="model", request_timeout_s=120.0)
    span = RouteSpan(peer_id="peer", start=1, end=5)
    if rates is not None:
        blocks = {block: {"peer": server(0, 6, **rates)} for block in range(6)}
        manager.state.snapshot = PeerTableSnapshot(
            prefix="model", now=0.0, version=1, blocks=blocks
        )
    assert manager.step_timeout(span, tokens=tokens, nbytes=nbytes) == pytest.approx(expected)


def test_a_servers_announcement_is_found_under_any_block_of_a_table_still_filling() -> None:
    """Routes are planned from a peer table that may hold a server under some of its blocks
    only (the table fills as the DHT answers): what the server announces is still found for a
    span that starts at a block the table lacks."""
    manager = manager_for(dht_prefix="model")
    span = RouteSpan(peer_id="peer", start=0, end=3)
    announced = attrs.evolve(server(0, 3, inference_rps=40.0), push_grants=PUSH_GRANTS)
    assert manager.announced_rate(span, tokens=1) is None
    assert not manager.knows_push_grants(span)
    manager.state.snapshot = PeerTableSnapshot(
        prefix="model", now=0.0, version=1, blocks={2: {"peer": announced}}
    )
    assert manager.announced_rate(span, tokens=1) == 40.0
    assert manager.knows_push_grants(span)
    other = attrs.evolve(announced, push_grants=PUSH_GRANTS + 1)
    manager.state.snapshot = attrs.evolve(manager.state.snapshot, blocks={1: {"peer": other}})
    assert not manager.knows_push_grants(span)
