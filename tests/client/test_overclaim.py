"""A server claiming a throughput it cannot deliver does not draw every request for ever: the
client measures what servers deliver and routes an overclaiming one by its measured speed."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import attrs
import pytest
import torch
import trio

from petals_core.client import RemoteSequential, remote_forward
from petals_core.client._sequence_manager import OVERCLAIM_FACTOR
from petals_core.routing import make_route_max_throughput

from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    Model,
    in_process_swarm,
    manager_for,
    wait_for_servers,
)


async def test_an_overclaiming_server_is_routed_by_its_measured_speed(
    model: Model, tmp_path: Path
) -> None:
    async with in_process_swarm(model, tmp_path, [(0, 6)]) as swarm:
        (liar_server,) = swarm.servers.values()
        liar = str(liar_server.dht.peer_id)
        manager = manager_for([liar_server])
        async with RemoteSequential(manager):
            with trio.fail_after(DEADLINE_S):
                await wait_for_servers(manager, 1)
                announced = manager.servers()[liar]
                for _ in range(3):
                    await remote_forward(manager, torch.randn(2, 8, HIDDEN))
                measured = manager.state.measured_rps[liar]
                assert measured > 0
                honest = manager.servers()[liar]
                # Its real claim (1 rps) is far below what it delivers: left as announced.
                assert honest.throughput == announced.throughput
                # The same measurements against a claim of 1e9 rps (far beyond what a tiny
                # block on a CPU does): cut to the measured speed.
                claim = 1e9
                overclaimed = manager._as_measured(liar, attrs.evolve(honest, throughput=claim))
                span = honest.end_block - honest.start_block
                assert overclaimed.throughput == pytest.approx(measured / ((span + 1) / 2))
                assert overclaimed.throughput < claim / OVERCLAIM_FACTOR


async def test_shares_follow_measured_speed_once_measured(model: Model, tmp_path: Path) -> None:
    async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
        first, second = (str(s.dht.peer_id) for s in swarm.servers.values())
        manager = manager_for(list(swarm.servers.values()))
        async with RemoteSequential(manager):
            with trio.fail_after(DEADLINE_S):
                await wait_for_servers(manager, 2)
                servers = manager.servers()
                # "first" claims 1e9 rps, "second" 1e3; both deliver 3.5e3 token-blocks per second
                # (what 1e3 rps over a 6-block span means).
                claims = {first: 1e9, second: 1e3}
                lying = {p: attrs.evolve(info, throughput=claims[p]) for p, info in servers.items()}

                def shares() -> Counter[str]:
                    rng = random.Random(0)
                    table = {p: manager._as_measured(p, info) for p, info in lying.items()}
                    return Counter(
                        make_route_max_throughput(table, 0, 6, rng=rng)[0].peer_id
                        for _ in range(2000)
                    )

                before = shares()
                assert before[second] < 10  # the liar draws everything
                for peer in (first, second):
                    manager.on_forward_measured(peer, tokens=3500, blocks=1, seconds=1.0)
                after = shares()
                assert 800 < after[second] < 1200  # now about even
