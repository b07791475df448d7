"""What a server loads for the MODEL it is given, and whether peers can reach it."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import attrs
import pytest
import trio

from petals_core.server import ServerConfig
from petals_core.server._cli_args import config_from_args, parse_args
from petals_core.server._server import _report_reachability, resolve_model
from petals_core.transport import Multiaddr

from ..client._swarm_helpers import DEADLINE_S, Model, in_process_swarm


@pytest.mark.parametrize(
    ("model", "loaded"),
    [
        # Petals' converted BLOOM repos hold no weights any more: their originals do.
        ("bigscience/bloom-petals", "bigscience/bloom"),
        ("bigscience/bloomz-7b1-petals", "bigscience/bloomz-7b1"),
        ("bigscience/bloom-7b1", "bigscience/bloom-7b1"),
        ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf"),
    ],
)
def test_the_repo_loaded_for_a_model_name(model: str, loaded: str) -> None:
    config = ServerConfig(model=model, new_swarm=True)
    assert resolve_model(config) == (loaded, config)


async def test_a_server_warns_when_its_announced_address_cannot_be_dialled_back(
    model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
            first, second = swarm.servers.values()
            config = attrs.evolve(second.config, initial_peers=(str(first.multiaddrs[0]),))
            node = second.dht.node
            with caplog.at_level(logging.INFO, logger="petals_core.server"):
                await _report_reachability(node, second.multiaddrs, config)
                assert f"reachable at {second.multiaddrs[0]}" in caplog.text
                # What a server behind NAT announces: an address where nobody answers for it.
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:
                    silent.bind(("127.0.0.1", 0))
                    behind_nat = Multiaddr("127.0.0.1", silent.getsockname()[1])
                    await _report_reachability(node, [behind_nat], config)
            (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert f"cannot reach this server at {behind_nat}" in warning.getMessage()
            assert "--announce_host" in warning.getMessage()
            assert "--skip_reachability_check" in warning.getMessage()


def test_skip_reachability_check_turns_the_check_off() -> None:
    args = ["m", "--new_swarm", "--skip_reachability_check"]
    assert not config_from_args(parse_args(args)).check_reachability
    assert config_from_args(parse_args(["m", "--new_swarm"])).check_reachability
