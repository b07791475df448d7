"""The monitor against a real swarm: server processes on loopback, the monitor in this trio
program, read over HTTP as a browser would (JSON API and server-sent events).

Nothing sleeps to wait: each wait polls its condition (or reads the event stream) under a
generous deadline, as starting processes takes a while on a busy machine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from petals_core import ConfigError, PeerUnreachable, __version__
from petals_core.dht import DHTNode, ModelInfo, ServerInfo, ServerState, register_model
from petals_core.monitor import MonitorConfig, SwarmMonitor, open_monitor
from petals_core.testing import open_local_swarm

from ..dht._swarm import FakeClock, swarm as dht_swarm
from ._http_client import get, get_json, open_events
from ._swarm import REFRESH_S, add_servers, monitor_config, peer_id, save_tiny_llama, start_monitor

#: Deadline of a whole test: a swarm of processes starts, changes and stops within it.
DEADLINE_S = 180.0


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("monitor-llama"))


async def wait_state(url: str, condition: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Poll ``GET /api/v1/state`` until ``condition`` holds; the caller's deadline bounds it."""
    while True:
        state = await get_json(f"{url}/api/v1/state")
        if condition(state):
            return state
        await trio.sleep(REFRESH_S / 2)


def servers(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rows of every model's servers, by PeerID."""
    return {row["peer_id"]: row for model in state["models"] for row in model["servers"]}


def online_per_block(state: dict[str, Any]) -> list[int]:
    (model,) = state["models"]
    return [block["online"] for block in model["blocks"]]


async def test_the_api_shows_servers_and_coverage_and_follows_a_departure(
    model_folder: str,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(model_folder, []) as swarm, trio.open_nursery() as nursery:
            started = await add_servers(swarm, model_folder, {"first": (0, 3), "second": (2, 6)})
            stop = trio.Event()
            url = await start_monitor(nursery, swarm, stop)
            both = {peer_id(process) for process in swarm.servers}
            state = await wait_state(
                url,
                lambda s: (
                    set(servers(s)) == both and all(row["reachable"] for row in servers(s).values())
                ),
            )

            (model,) = state["models"]
            assert model["num_blocks"] == 6
            assert model["repository"] is None  # a local folder
            assert model["model_type"] == "llama"
            assert model["dht_prefix"] == Path(model_folder).name.replace(".", "-")
            assert online_per_block(state) == [1, 1, 2, 1, 1, 1]
            assert model["served_blocks"] == 6
            spans = [(r["public_name"], r["start_block"], r["end_block"]) for r in model["servers"]]
            assert spans == [("first", 0, 3), ("second", 2, 6)]
            rows = {row["public_name"]: row for row in model["servers"]}
            for row in rows.values():
                assert row["short_id"] == "…" + row["peer_id"][-8:]
                assert row["state"] == "online"
                assert row["throughput"] == 1.0
                assert (row["torch_dtype"], row["quant_type"]) == ("float32", "none")
                assert row["version"] == __version__
                assert row["cache_tokens_left"] > 0
                assert row["rtt_ms"] > 0

            # The event stream starts with the state as it is, then follows the change.
            async with open_events(f"{url}/api/v1/events") as events:
                first = await anext(events)
                assert first.event == "state"
                assert set(servers(first.json())) == both
                second = started["second"]
                assert peer_id(second) == rows["second"]["peer_id"]
                assert await second.stop() == 0
                async for event in events:
                    if peer_id(second) not in servers(event.json()):
                        break
                assert event.event == "state"
                assert int(event.id or 0) > int(first.id or 0)
                assert event.json()["version"] == int(event.id or 0)

            state = await wait_state(url, lambda s: peer_id(second) not in servers(s))
            assert online_per_block(state) == [1, 1, 1, 0, 0, 0]
            assert state["models"][0]["served_blocks"] == 3

            page = await get(f"{url}/")
            assert page.status == 200
            assert "script-src 'sha256-" in page.headers["content-security-policy"]
            assert b"new EventSource(" in page.body
            assert (await get(f"{url}/api/v1/nothing")).status == 404
            stop.set()


async def test_a_swarm_without_models_is_an_empty_state_and_a_dead_one_an_error(
    model_folder: str,
) -> None:
    """Only a bootstrap node: no model is registered.  No peer answering: PeerUnreachable."""
    with trio.fail_after(DEADLINE_S):
        async with (
            open_local_swarm(model_folder, []) as swarm,
            open_monitor(monitor_config(swarm.initial_peers)) as monitor,
        ):
            assert monitor.state.models == ()
            assert monitor.state.to_json()["models"] == []
        # The swarm has stopped: its bootstrap node answers no more.
        dead = attrs.evolve(monitor_config(swarm.initial_peers), request_timeout_s=0.5)
        with pytest.raises(PeerUnreachable, match="none of the initial peers answered"):
            async with open_monitor(dead):
                pytest.fail("the monitor started without a swarm")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"initial_peers": ()}, "give the multiaddr of at least one peer"),
        ({"initial_peers": ("/ip4/127.0.0.1/tcp/1",)}, "invalid multiaddr"),
        ({"refresh_period_s": 0}, "refresh_period_s must be positive"),
        ({"ping_timeout_s": -1.0}, "ping_timeout_s must be positive"),
        ({"max_models": 0}, "max_models must be positive"),
    ],
)
def test_the_config_refuses_what_cannot_work(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        attrs.evolve(monitor_config(["/ip4/127.0.0.1/udp/1/quic-v1"]), **fields)


@asynccontextmanager
async def monitor_on_dht(
    clock: FakeClock, **config: Any
) -> AsyncIterator[tuple[list[DHTNode], SwarmMonitor]]:
    """3 DHT nodes on ``clock`` and a monitor on a client node of theirs, whose rounds the test
    runs itself (:meth:`SwarmMonitor.refresh`)."""
    async with (
        dht_swarm(clock, 3, with_client=True) as (nodes, client),
        trio.open_nursery() as nursery,
    ):
        assert client is not None
        settings = MonitorConfig(initial_peers=[str(nodes[0].listen_multiaddr)], **config)
        monitor = SwarmMonitor(client, settings, nursery, clock=clock)
        yield nodes, monitor
        monitor.close()
        nursery.cancel_scope.cancel()


async def test_the_monitor_follows_the_registry_as_models_come_go_and_change() -> None:
    """A model the registry drops, with no server left, is no longer followed (so a monitor at
    its limit of models takes up the next one); a model given another block count is shown
    with it."""
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with monitor_on_dht(clock, max_models=1) as (nodes, monitor):

            async def shown() -> dict[str, int]:
                await monitor.refresh()
                return {m.dht_prefix: m.num_blocks for m in monitor.state.models}

            assert await register_model(
                nodes[1], "alpha", ModelInfo(num_blocks=6), expiration=clock.now + 60
            )
            assert await shown() == {"alpha": 6}
            assert await register_model(
                nodes[1], "alpha", ModelInfo(num_blocks=8), expiration=clock.now + 90
            )
            assert await shown() == {"alpha": 8}

            clock.now += 120  # alpha's entry expires
            assert await register_model(
                nodes[2], "beta", ModelInfo(num_blocks=4), expiration=clock.now + 60
            )
            assert await shown() == {"beta": 4}


async def test_a_server_joining_a_model_nobody_serves_shows_within_rounds() -> None:
    """Nobody gossips about a model no server announces: the monitor reads its blocks from the
    DHT each round (at most once per refresh period) to see one that joins."""
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with monitor_on_dht(clock) as (nodes, monitor):
            info = ModelInfo(num_blocks=4)
            assert await register_model(nodes[1], "gamma", info, expiration=clock.now + 600)
            await monitor.refresh()
            (model,) = monitor.state.models
            assert model.servers == ()

            server = ServerInfo(
                state=ServerState.ONLINE,
                throughput=1.0,
                start_block=0,
                end_block=4,
                version=__version__,
                torch_dtype="float32",
            )
            assert await nodes[2].announce("gamma", server, expiration=clock.now + 600)
            # Well before the model's own periodic read (every 30 s) would see it.
            with trio.fail_after(10):
                while not monitor.state.models[0].servers:
                    clock.now += monitor.config.refresh_period_s
                    await monitor.refresh()
                    await trio.sleep(0.05)
            (row,) = monitor.state.models[0].servers
            assert row.peer_id == str(nodes[2].peer_id)
