"""Sessions over a lossy network give the same outputs as over a clean one.

The transport's sockets are real UDP, so the lossy network is a relay on loopback: a trio task
per server that forwards datagrams between the client and the server, drops 5% of them and holds
back another 5% for a few milliseconds (so that later ones overtake them), from a seeded
``random.Random``.  The client dials the relay's address with the server's PeerID in the
multiaddr: the server still proves its identity through the relay.

(``petals_core.testing.MemoryNetwork`` drives sans-IO endpoints on a virtual clock; a server and
a client run on trio with real sockets and real time, so the relay is the faithful way here.)

Only the requests to servers (inference sessions, forward, backward, pings) go through the
relays: the client's own DHT node, which reads the peer table, talks to the servers directly.
:class:`RelayedManager` does that by dialing a relay, from a node of its own, where a manager
dials the address the server announced; everything else is the sequence manager's.
"""

from __future__ import annotations

import random
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from petals_core.client import (
    InferenceSession,
    RemoteSequenceManager,
    RemoteSequential,
    SequenceManagerConfig,
    remote_backward,
    remote_forward,
)
from petals_core.server import Server
from petals_core.transport import Connection, Multiaddr, Node, open_node

from ..client._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    Model,
    assert_close,
    in_process_swarm,
    local_grads,
    manager_for,
    training_inputs,
    wait_for_servers,
)

LOSS = 0.05
REORDER = 0.05
#: How long a held-back datagram waits, at most (loopback delivers in microseconds).
MAX_HOLD_S = 0.005
Address = tuple[str, int]


@attrs.frozen(kw_only=True)
class RelayStatistics:
    forwarded: int
    dropped: int
    reordered: int


class LossyRelay:
    """Forwards UDP datagrams between clients and the server at ``target``, losing ``loss`` of
    them and delaying ``reorder`` of them by up to ``MAX_HOLD_S`` (both directions).

    Each client address gets a socket of its own towards the server, so the server sees one
    peer address per client, as through a NAT.  Run :meth:`serve` in a nursery.
    """

    def __init__(self, target: Address, *, loss: float, reorder: float, rng: random.Random) -> None:
        self.target = target
        self.loss = loss
        self.reorder = reorder
        self._rng = rng
        self._front = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._backs: dict[Address, trio.socket.SocketType] = {}
        self._counts = [0, 0, 0]

    @property
    def address(self) -> Address:
        host, port = self._front.getsockname()[:2]
        return (host, port)

    def statistics(self) -> RelayStatistics:
        forwarded, dropped, reordered = self._counts
        return RelayStatistics(forwarded=forwarded, dropped=dropped, reordered=reordered)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._front.bind(("127.0.0.1", 0))
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    data, client = await self._front.recvfrom(1 << 16)
                    back = self._backs.get(client)
                    if back is None:
                        back = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                        await back.bind(("127.0.0.1", 0))
                        self._backs[client] = back
                        nursery.start_soon(self._answers, back, client, nursery)
                    await self._pass(nursery, back, data, self.target)
        finally:
            self._front.close()
            for back in self._backs.values():
                back.close()

    async def _answers(
        self, back: trio.socket.SocketType, client: Address, nursery: trio.Nursery
    ) -> None:
        while True:
            data, _ = await back.recvfrom(1 << 16)
            await self._pass(nursery, self._front, data, client)

    async def _pass(
        self,
        nursery: trio.Nursery,
        sock: trio.socket.SocketType,
        data: bytes,
        destination: Address,
    ) -> None:
        draw = self._rng.random()
        if draw < self.loss:
            self._counts[1] += 1
            return
        if draw < self.loss + self.reorder:
            self._counts[2] += 1
            nursery.start_soon(
                self._later, sock, data, destination, self._rng.random() * MAX_HOLD_S
            )
            return
        self._counts[0] += 1
        await sock.sendto(data, destination)

    async def _later(
        self, sock: trio.socket.SocketType, data: bytes, destination: Address, delay_s: float
    ) -> None:
        await trio.sleep(delay_s)  # the hold-back itself: later datagrams overtake this one
        self._counts[0] += 1
        await sock.sendto(data, destination)


class RelayedManager(RemoteSequenceManager):
    """A sequence manager whose requests to a server go through its relay, from ``node``."""

    def __init__(
        self,
        config: SequenceManagerConfig,
        num_blocks: int,
        *,
        node: Node,
        relays: dict[str, Multiaddr],
        **kwargs: Any,
    ) -> None:
        super().__init__(config, num_blocks, **kwargs)
        self.node = node
        self.relays = relays

    def __getitem__(self, index: int | slice) -> RelayedManager:
        part = super().__getitem__(index)
        return RelayedManager(
            self.config,
            self.num_blocks,
            node=self.node,
            relays=self.relays,
            block_indices=part.block_indices,
            state=self.state,
        )

    async def connect(self, peer: str) -> Connection:
        with trio.fail_after(self.config.connect_timeout_s):
            return await self.node.connect(self.relays[peer])


@asynccontextmanager
async def lossy_swarm(
    model: Model, cache_dir: Path, seed: int
) -> AsyncIterator[tuple[list[Server], RemoteSequenceManager, RelayedManager, list[LossyRelay]]]:
    """Two servers (blocks 0:3, 3:6), a relay in front of each, a direct manager and a relayed
    one (their network parts running)."""
    rng = random.Random(seed)
    async with (
        in_process_swarm(model, cache_dir, [(0, 3), (3, 6)]) as swarm,
        trio.open_nursery() as nursery,
        open_node() as node,
    ):
        servers = list(swarm.servers.values())
        relays: dict[str, Multiaddr] = {}
        relay_list = []
        for server in servers:
            relay = LossyRelay(
                server.multiaddrs[0].socket_address, loss=LOSS, reorder=REORDER, rng=rng
            )
            await nursery.start(relay.serve)
            host, port = relay.address
            relays[str(server.dht.peer_id)] = Multiaddr.from_socket_address(
                host, port, peer_id=server.dht.peer_id
            )
            relay_list.append(relay)
        direct = manager_for(servers, request_timeout_s=30.0)
        settings = attrs.evolve(direct.config, connect_timeout_s=30.0)
        relayed = RelayedManager(settings, N_BLOCKS, node=node, relays=relays)
        async with RemoteSequential(direct), RemoteSequential(relayed):
            await wait_for_servers(direct, 2)
            await wait_for_servers(relayed, 2)
            yield servers, direct, relayed, relay_list
        nursery.cancel_scope.cancel()


def _total(relays: list[LossyRelay]) -> RelayStatistics:
    stats = [relay.statistics() for relay in relays]
    return RelayStatistics(
        forwarded=sum(s.forwarded for s in stats),
        dropped=sum(s.dropped for s in stats),
        reordered=sum(s.reordered for s in stats),
    )


async def test_session_of_20_steps_through_lossy_relays_equals_direct(
    model: Model, tmp_path: Path
) -> None:
    torch.manual_seed(5)
    prefill = torch.randn(2, 4, HIDDEN)
    steps = [torch.randn(2, 1, HIDDEN) for _ in range(19)]
    with trio.fail_after(3 * DEADLINE_S):
        async with lossy_swarm(model, tmp_path, seed=5) as (_, direct, relayed, relays):
            outputs: dict[str, list[torch.Tensor]] = {}
            for name, manager in (("direct", direct), ("relayed", relayed)):
                async with InferenceSession(manager, max_length=32) as session:
                    outputs[name] = [await session.step(x) for x in [prefill, *steps]]
                    # QUIC recovered every loss: no request timed out, nothing was rerouted.
                    assert session.retries == 0
            stats = _total(relays)
    print(stats)
    assert stats.dropped > 0 and stats.reordered > 0, stats
    inputs = torch.cat([prefill, *steps], dim=1)
    with torch.no_grad():
        expected = model.forward(inputs)
    assert_close(torch.cat(outputs["direct"], dim=1), expected)
    for ours, theirs in zip(outputs["relayed"], outputs["direct"], strict=True):
        assert_close(ours, theirs)


async def test_forward_and_backward_through_lossy_relays_equal_direct(
    model: Model, tmp_path: Path
) -> None:
    x, prompts, grad_output = training_inputs(6, rows=3, length=8)
    results = {}
    with trio.fail_after(3 * DEADLINE_S):
        async with lossy_swarm(model, tmp_path, seed=6) as (_, direct, relayed, relays):
            for name, manager in (("direct", direct), ("relayed", relayed)):
                output, saved = await remote_forward(manager, x, prompts)
                grads = await remote_backward(manager, grad_output, saved, prompts)
                results[name] = (output, *grads)
            stats = _total(relays)
    print(stats)
    assert stats.dropped > 0, stats
    output, grad_input, grad_prompts = results["relayed"]
    assert grad_prompts is not None
    for ours, theirs in zip(results["relayed"], results["direct"], strict=True):
        assert ours is not None and theirs is not None
        assert_close(ours, theirs)
    # And both equal the blocks run locally.
    local, local_grad, local_prompt_grad = local_grads(model, x, grad_output, prompts)
    assert local_prompt_grad is not None
    assert_close(output, local)
    assert_close(grad_input, local_grad)
    assert_close(grad_prompts, local_prompt_grad)
