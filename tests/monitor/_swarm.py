"""What the monitor's tests against real swarms share (the API's and the page's): a tiny
checkpoint, server processes started together, and the monitor served in the test's trio
program."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
import trio
from transformers import LlamaForCausalLM

from petals_core.monitor import MonitorConfig, serve_monitor
from petals_core.testing import LocalSwarm, SwarmProcess, fixed_server_args

from ..models.conftest import _save, tiny_llama_config

#: How often the monitor looks at the swarm in tests.
REFRESH_S = 0.5


def save_tiny_llama(folder: Path) -> str:
    """A tiny 6-block LLaMA in several shards, in ``folder``."""
    torch.manual_seed(40)
    _save(LlamaForCausalLM(tiny_llama_config()), folder, max_shard_size="100KB")
    return str(folder)


def monitor_config(initial_peers: Sequence[str]) -> MonitorConfig:
    """A monitor of the loopback swarm that looks every :data:`REFRESH_S` and waits little for
    peers that left."""
    return MonitorConfig(
        initial_peers=tuple(initial_peers),
        refresh_period_s=REFRESH_S,
        ping_timeout_s=2.0,
        request_timeout_s=2.0,
        dht_host="127.0.0.1",
    )


def peer_id(process: SwarmProcess) -> str:
    return process.address.rsplit("/p2p/", 1)[1]


async def add_servers(
    swarm: LocalSwarm, model: str, spans: dict[str, tuple[int, int]]
) -> dict[str, SwarmProcess]:
    """Start a server per entry (its public name: its span), all at once; the processes by
    name."""
    started: dict[str, SwarmProcess] = {}

    async def add(name: str, span: tuple[int, int]) -> None:
        started[name] = await swarm.add_server(model, fixed_server_args(span, public_name=name))

    async with trio.open_nursery() as nursery:
        for name, span in spans.items():
            nursery.start_soon(add, name, span)
    return started


async def start_monitor(nursery: trio.Nursery, swarm: LocalSwarm, stop: trio.Event) -> str:
    """Serve the monitor of ``swarm`` on a free loopback port until ``stop``; its URL."""
    serve = partial(
        serve_monitor,
        monitor_config(swarm.initial_peers),
        host="127.0.0.1",
        port=0,
        shutdown_trigger=stop.wait,
    )
    (url,) = await nursery.start(serve)
    return str(url)
