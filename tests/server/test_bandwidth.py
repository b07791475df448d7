"""The network bandwidth a server announces its throughput with: measured to peers at start,
given by ``--network_bandwidth``, or assumed when no peer tells."""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import pytest
import trio

from petals_core.server import Server, ServingLimits
from petals_core.server._throughput import (
    BITS_PER_HIDDEN_VALUE,
    DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S,
    ThroughputInfo,
)

from ..client._swarm_helpers import DEADLINE_S, HIDDEN, Model, in_process_swarm
from ..dht._swarm import holding_speed_tests

MEASURED = re.compile(
    r"network bandwidth: (\d+) Mbit/s measured to 1 peer \(up (\d+), down (\d+)\)"
)


def _network_rps(server: Server) -> float:
    assert isinstance(server.throughput, ThroughputInfo)
    return server.throughput.network_rps


async def test_a_server_measures_its_bandwidth_to_peers_and_announces_it(
    model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.INFO, logger="petals_core.server"):
        async with in_process_swarm(model, tmp_path, [], throughput="auto") as swarm:
            first = await swarm.add((0, 3))
            # The first started the swarm: nobody to measure with.
            assert first.bandwidth is not None and first.bandwidth.source == "assumed"
            assert "network bandwidth: 100 Mbit/s assumed (no peer to run the speed test with)" in (
                caplog.text
            )
            assert _network_rps(first) == DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S / (
                HIDDEN * BITS_PER_HIDDEN_VALUE
            )
            second = await swarm.add((3, 6))
            bandwidth = second.bandwidth
            assert bandwidth is not None and bandwidth.source == "measured"
            assert math.isfinite(bandwidth.bits_per_s) and bandwidth.bits_per_s > 0
            assert bandwidth.report is not None
            (result,) = bandwidth.report.results
            assert result.peer == str(first.multiaddrs[0])
            # The log line says what was measured.
            (line,) = [m.groups() for m in MEASURED.finditer(caplog.text)]
            total, up, down = (int(x) for x in line)
            assert total == round(bandwidth.bits_per_s / 1e6) == min(up, down)
            # The announced throughput counts it: on loopback the network is faster than the
            # compute, which then decides.
            info = second.throughput
            assert isinstance(info, ThroughputInfo)
            assert info.network_rps == bandwidth.bits_per_s / (HIDDEN * BITS_PER_HIDDEN_VALUE)
            assert info.throughput == min(info.forward_rps / 2, info.network_rps)
            assert second.info().throughput == info.throughput


async def test_network_bandwidth_given_is_used_and_nothing_is_measured(
    model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.INFO, logger="petals_core.server"):
        async with in_process_swarm(model, tmp_path, [(0, 3)]) as swarm:
            server = await swarm.add((3, 6), throughput="auto", network_bandwidth_bits_per_s=5e6)
            assert server.bandwidth is not None
            assert (server.bandwidth.source, server.bandwidth.report) == ("given", None)
            assert "network bandwidth: 5 Mbit/s given by --network_bandwidth" in caplog.text
            assert "measured to" not in caplog.text
            assert _network_rps(server) == 5e6 / (HIDDEN * BITS_PER_HIDDEN_VALUE)


async def test_a_server_no_peer_measures_assumes_the_default(
    model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its only peer is busy with other speed tests and refuses: the server starts, assuming."""
    # Long enough a request timeout that the held tests outlast the second server's start.
    limits = ServingLimits(request_timeout_s=30.0)
    with trio.fail_after(DEADLINE_S), caplog.at_level(logging.INFO, logger="petals_core.server"):
        async with in_process_swarm(model, tmp_path, [(0, 3)], limits=limits) as swarm:
            (first,) = swarm.servers.values()
            async with holding_speed_tests(first.multiaddrs[0]):
                server = await swarm.add((3, 6), throughput="auto")
            assert server.bandwidth is not None and server.bandwidth.source == "assumed"
            assert "network bandwidth: 100 Mbit/s assumed (no peer answered the speed test" in (
                caplog.text
            )
            assert "busy with 2 other speed tests" in caplog.text
            assert _network_rps(server) == DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S / (
                HIDDEN * BITS_PER_HIDDEN_VALUE
            )
