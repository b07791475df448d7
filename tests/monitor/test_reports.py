"""The monitor shows fraud reports that other servers confirm, against the server they name."""

from __future__ import annotations

from pathlib import Path

import torch
import trio

from petals_core.client import book_of
from petals_core.monitor import MonitorConfig, open_monitor

from ..client._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    Model,
    add_liar_and_two_honest,
    checking_client,
    in_process_swarm,
)


async def test_the_monitor_shows_a_reported_liar_once_other_servers_confirm(
    model: Model, tmp_path: Path
) -> None:
    torch.manual_seed(13)
    x = torch.randn(1, 4, HIDDEN)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar_id = await add_liar_and_two_honest(swarm)
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            async with checking_client(servers, x) as checking:
                await book_of(checking).wait_published(1)
                config = MonitorConfig(
                    initial_peers=(str(servers[0].multiaddrs[0]),),
                    refresh_period_s=0.5,
                    dht_host="127.0.0.1",
                )
                async with open_monitor(config) as monitor:
                    version = -1
                    while True:
                        state = await monitor.wait_state(version)
                        assert state is not None
                        rows = {row.peer_id: row for m in state.models for row in m.servers}
                        if liar_id in rows and rows[liar_id].reports:
                            break
                        version = state.version
                    assert rows[liar_id].reports == 1
                    assert rows[liar_id].report is not None
                    assert rows[liar_id].report.startswith(f"blocks 0:{N_BLOCKS} off by")
                    honest = [row for peer, row in rows.items() if peer != liar_id]
                    assert len(honest) == 2 and not any(row.reports for row in honest)
                    (model_state,) = state.models
                    assert model_state.refused_reports == 0
