"""Servers behind real NATs (network namespaces, nftables routers): served through relays and
punched holes, with tokens identical to the model's own.

Every process runs inside a host of a :class:`~petals_core.testing.Topology`: bootstrap DHT nodes
(relays too) on the "Internet", servers and clients behind cone or symmetric NATs whose routers
let in only replies.  The client is a Petals-style script (``open_host_client``).  Needs root,
iproute2 and nftables (CI installs nftables; elsewhere the tests skip, saying how to install it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch
import trio
from transformers import AutoModelForCausalLM

from petals_core.testing import (
    Host,
    HostClient,
    LocalSwarm,
    SwarmProcess,
    Topology,
    open_host_client,
    open_local_swarm,
)

from ..client._swarm_helpers import PROCESS_PREFIX, Model, peer_id_of, process_server_args
from ..distributed._causal_lm import random_ids

DEADLINE_S = 240


def reference(model: Model, prompt: torch.Tensor, new_tokens: int) -> list[list[int]]:
    """The model's own greedy tokens for ``prompt``."""
    hf = AutoModelForCausalLM.from_pretrained(model.folder, dtype=torch.float32)
    with torch.no_grad():
        output = hf.generate(
            prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    result: list[list[int]] = output.tolist()
    return result


@asynccontextmanager
async def client_in(
    host: Host, swarm: LocalSwarm, model: Model, prompt: torch.Tensor, new_tokens: int
) -> AsyncIterator[HostClient]:
    settings = {
        "folder": model.folder,
        "initial_peers": swarm.initial_peers,
        "dht_prefix": PROCESS_PREFIX,
        "prompt": prompt.tolist(),
        "max_new_tokens": new_tokens,
    }
    async with open_host_client(host, settings) as client:
        yield client


def server_args(span: tuple[int, int]) -> list[str]:
    return process_server_args(span)


async def relayed_through(server: SwarmProcess, count: int = 1) -> None:
    """Wait until ``server`` holds ``count`` relay reservations."""
    start = 0
    for _ in range(count):
        line = await server.wait_output("reachable through relay", start=start)
        start = server.output.index(line) + 1


def relays_of(report: dict[str, Any], peer: str) -> list[str | None]:
    return [relay for connected, relay in report["connections"] if connected == peer]


async def test_cone_nats_on_both_sides_a_punched_hole_carries_the_session(
    model: Model, topology: Topology
) -> None:
    """A server behind a home router, a client behind another: the client reaches the server
    through the bootstrap node's relay, punches a hole, and the session's activations go
    directly (the relay's host sees none of them); tokens are the model's own."""
    boot = topology.public("boot")
    home = topology.behind_nat("home", "cone")
    away = topology.behind_nat("away", "cone")
    prompt = random_ids(1, 96, seed=0)
    expected = reference(model, prompt, 8)
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(model.folder, [], bootstrap_host=boot) as swarm:
            server = await swarm.add_server(model.folder, server_args((0, 6)), host=home)
            await relayed_through(server)
            peer = peer_id_of(server)
            async with client_in(away, swarm, model, prompt, 8) as client:
                first = await client.generate()
                assert first["tokens"] == expected
                assert relays_of(first, peer) == [None]
                # Again, on the punched connection: what crosses the relay's host meanwhile is
                # the DHT's chatter, not the prompt's activations (96 x 64 float32 = 24 KiB each
                # way, and 8 steps).
                before = sum(topology.interface_bytes(boot))
                client_before = sum(topology.interface_bytes(away))
                again = await client.generate()
                relay_bytes = sum(topology.interface_bytes(boot)) - before
                client_bytes = sum(topology.interface_bytes(away)) - client_before
            assert again["tokens"] == expected
            assert client_bytes > 48 << 10
            assert relay_bytes < client_bytes / 4, (relay_bytes, client_bytes)


async def test_a_symmetric_nat_is_served_through_a_relay_that_fails_over(
    model: Model, topology: Topology
) -> None:
    """Behind a carrier-grade NAT (a new port per destination) no hole can be punched: the
    server says so, holds reservations with both relays, and serves through one.  Killing that
    relay mid-generation costs a few seconds, and the tokens stay the model's own."""
    boot = topology.public("boot")
    spare = topology.public("spare")
    cgnat = topology.behind_nat("cgnat", "symmetric")
    away = topology.behind_nat("away", "cone")
    prompt = random_ids(1, 16, seed=1)
    expected = reference(model, prompt, 24)
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(model.folder, [], bootstrap_host=boot) as swarm:
            second = await swarm.add_bootstrap(host=spare)
            server = await swarm.add_server(model.folder, server_args((0, 6)), host=cgnat)
            await server.wait_output("behind a symmetric NAT")
            await relayed_through(server, 2)
            peer = peer_id_of(server)
            async with client_in(away, swarm, model, prompt, 24) as client:
                first = await client.generate()
                assert first["tokens"] == expected
                (relay,) = relays_of(first, peer)
                assert relay in (peer_id_of(swarm.bootstrap), peer_id_of(second))
                used = swarm.bootstrap if relay == peer_id_of(swarm.bootstrap) else second

                async def kill_after_tokens() -> None:
                    start = len(client.process.output)
                    for _ in range(4):
                        line = await client.process.wait_output("TOKEN", start=start)
                        start = client.process.output.index(line, start) + 1
                    used.kill()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(kill_after_tokens)
                    during = await client.generate()
            assert during["tokens"] == expected
            gaps = [b - a for a, b in zip(during["times"], during["times"][1:], strict=False)]
            assert max(gaps) < 5.0, during["times"]
            assert relays_of(during, peer) == [
                peer_id_of(second if used is swarm.bootstrap else swarm.bootstrap)
            ]


async def test_servers_behind_two_nats_push_to_each_other_and_outlive_expired_mappings(
    model: Model, topology: Topology
) -> None:
    """Blocks 0:3 behind a home router, 3:6 behind a carrier-grade NAT: the first pushes each
    step to the second (through its relay), and the tokens are the model's own.  Both routers
    forget an idle mapping after 3 s; after 8 s of quiet the next generation still works
    (the relays' reservations keep their mappings; connections whose mappings died are noticed
    and made anew)."""
    boot = topology.public("boot")
    spare = topology.public("spare")
    home = topology.behind_nat("home", "cone")
    cgnat = topology.behind_nat("cgnat", "symmetric")
    away = topology.behind_nat("away", "cone")
    for name in ("home", "cgnat"):
        topology.routers[name].set_udp_timeout(3)
    prompt = random_ids(2, 12, seed=2)
    expected = reference(model, prompt, 6)
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(model.folder, [], bootstrap_host=boot) as swarm:
            await swarm.add_bootstrap(host=spare)
            first = await swarm.add_server(model.folder, server_args((0, 3)), host=home)
            second = await swarm.add_server(model.folder, server_args((3, 6)), host=cgnat)
            await relayed_through(first)
            await relayed_through(second)
            async with client_in(away, swarm, model, prompt, 6) as client:
                assert (await client.generate())["tokens"] == expected
                # Every step went on from the first server to the second by itself.
                assert not [line for line in first.output if "cannot push" in line]
                # Quiet for well past the routers' 3 s: the scenario, not a wait for an event.
                await trio.sleep(8)
                assert (await client.generate())["tokens"] == expected


async def test_a_forwarded_port_is_found_and_announced_without_relays(
    model: Model, topology: Topology
) -> None:
    """A home router forwarding the server's UDP port: the server learns the router's address
    from its peers, a dial-back from a stranger's socket gets through, and it announces that
    address first, holding no relay; a client elsewhere dials it directly."""
    boot = topology.public("boot")
    home = topology.behind_nat("home", "cone")
    office = topology.public("office")
    port = 31400
    topology.forward_port("home", port)
    prompt = random_ids(1, 8, seed=3)
    expected = reference(model, prompt, 4)
    wan = topology.routers["home"].wan_address
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(model.folder, [], bootstrap_host=boot) as swarm:
            args = [*server_args((0, 6)), "--port", str(port)]
            server = await swarm.add_server(model.folder, args, host=home)
            await server.wait_output(f"reachable at /ip4/{wan}/udp/{port}/quic-v1 (dialled back")
            peer = peer_id_of(server)
            async with client_in(office, swarm, model, prompt, 4) as client:
                report = await client.generate()
            assert report["tokens"] == expected
            assert relays_of(report, peer) == [None]
            assert not [line for line in server.output if "through relay" in line]
