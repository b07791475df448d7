"""Shared helpers of the client tests: a tiny checkpoint with its blocks held locally (the
reference every remote output is compared with), in-process servers on loopback, and a real
process swarm with PeerIDs.

Fixtures-as-functions: each test module wraps what it needs in its own fixtures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
import trio
from transformers import LlamaForCausalLM

from petals_core.client import RemoteSequenceManager, SequenceManagerConfig
from petals_core.dht import PeerTableSnapshot
from petals_core.models import LlamaBlock
from petals_core.server import Server, ServerConfig, ServingLimits, open_server
from petals_core.testing import LocalSwarm, SwarmProcess, fixed_server_args

from ..models.conftest import TinyCheckpoint, _save, tiny_llama_config

if TYPE_CHECKING:
    from petals_core.client import RemoteSequential

#: Deadline of every wait in these tests; far above what any of them takes.
DEADLINE_S = 60.0
HIDDEN = 64
N_BLOCKS = 6
#: Outputs of remote blocks equal local ones up to this (fp32 on CPU, same kernels).
ATOL = 1e-5
#: The model's name in process swarms.
PROCESS_PREFIX = "tiny-llama-client-tests"


@attrs.frozen(kw_only=True)
class Model:
    """A saved tiny LLaMA and its blocks, loaded here for reference."""

    checkpoint: TinyCheckpoint
    blocks: list[LlamaBlock]

    @property
    def folder(self) -> str:
        return str(self.checkpoint.folder)

    def forward(
        self,
        x: torch.Tensor,
        prompts: torch.Tensor | None = None,
        blocks: range | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, hidden)`` through ``blocks`` (default: all), with deep prompts
        ``(len(blocks), B or 1, P, hidden)`` added to the first P positions (those there)
        before each block;
        differentiable."""
        chosen = blocks if blocks is not None else range(len(self.blocks))
        for i, index in enumerate(chosen):
            if prompts is not None:
                length = min(prompts.shape[2], x.shape[1])
                x = torch.cat([x[:, :length] + prompts[i, :, :length], x[:, length:]], dim=1)
            x = self.blocks[index](x)
        return x


def make_model(folder: Path, seed: int = 20) -> Model:
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(tiny_llama_config())
    checkpoint = _save(hf_model, folder, max_shard_size="100KB")
    blocks = []
    for i in range(N_BLOCKS):
        block = LlamaBlock(hf_model.config, i)
        block.load_state_dict(hf_model.model.layers[i].state_dict())
        block.eval()
        blocks.append(block)
    return Model(checkpoint=checkpoint, blocks=blocks)


def server_config(model: Model, cache_dir: Path, **fields: Any) -> ServerConfig:
    """An fp32 CPU server on loopback whose throughput is given (nothing is measured)."""
    settings: dict[str, Any] = {
        "model": model.folder,
        "host": "127.0.0.1",
        "throughput": 1.0,
        "torch_dtype": "float32",
        "device": "cpu",
        "cache_dir": str(cache_dir),
        "update_period_s": 0.5,
        # Long enough that a loaded machine does not turn a slow answer into a failure; the
        # tests of stalls use the clients' timeouts.
        "limits": ServingLimits(request_timeout_s=10.0),
        "balance_quality": 0.0,
    }
    settings.update(fields)
    return ServerConfig(**settings)


class InProcessSwarm:
    """In-process servers, each run by its own task so that any one can leave (``leave``)."""

    def __init__(self, model: Model, cache_dir: Path, nursery: trio.Nursery, **fields: Any) -> None:
        self.model = model
        self.cache_dir = cache_dir
        #: ServerConfig fields of every server, beside :func:`server_config`'s.
        self.fields = fields
        self.servers: dict[str, Server] = {}
        self._nursery = nursery
        self._stops: dict[str, tuple[trio.Event, trio.Event]] = {}

    async def add(self, span: tuple[int, int], **fields: Any) -> Server:
        """Start a server of ``span`` (``fields``: ServerConfig fields of this one only)."""
        fields = {**self.fields, **fields}
        if self.servers:
            first = next(iter(self.servers.values()))
            config = server_config(
                self.model,
                self.cache_dir,
                block_indices=span,
                initial_peers=(str(first.multiaddrs[0]),),
                **fields,
            )
        else:
            config = server_config(
                self.model, self.cache_dir, block_indices=span, new_swarm=True, **fields
            )
        stop, stopped = trio.Event(), trio.Event()

        async def run(task_status: trio.TaskStatus[Server]) -> None:
            try:
                async with open_server(config) as server:
                    task_status.started(server)
                    await stop.wait()
            finally:
                stopped.set()

        server: Server = await self._nursery.start(run)
        peer = str(server.dht.peer_id)
        self.servers[peer], self._stops[peer] = server, (stop, stopped)
        return server

    async def leave(self, peer: str) -> None:
        """The server leaves the swarm (as ``open_server`` does on exit) and is gone."""
        del self.servers[peer]
        stop, stopped = self._stops.pop(peer)
        stop.set()
        await stopped.wait()


@asynccontextmanager
async def in_process_swarm(
    model: Model, cache_dir: Path, spans: list[tuple[int, int]], **fields: Any
) -> AsyncIterator[InProcessSwarm]:
    async with trio.open_nursery() as nursery:
        swarm = InProcessSwarm(model, cache_dir, nursery, **fields)
        for span in spans:
            await swarm.add(span)
        yield swarm
        for peer in reversed(list(swarm.servers)):
            await swarm.leave(peer)


async def add_liar_and_two_honest(
    swarm: InProcessSwarm, lies: tuple[str, ...] = ("forward",)
) -> str:
    """A liar (announcing the highest speed, so routes prefer it) and two honest servers, each
    holding every block; the liar's PeerID."""
    from petals_core.testing import make_liar

    liar = await swarm.add((0, N_BLOCKS), throughput=1000.0)
    for _ in range(2):
        await swarm.add((0, N_BLOCKS))
    make_liar(liar, lies=lies)
    return str(liar.dht.peer_id)


@asynccontextmanager
async def sequential_over(
    servers: Sequence[Server], **manager_fields: Any
) -> AsyncIterator[RemoteSequential]:
    """A :class:`RemoteSequential` over the swarm of ``servers`` (its manager of its own, see
    :func:`manager_for`, given ``manager_fields``), once its peer table shows them all."""
    from petals_core.client import RemoteSequential

    async with RemoteSequential(manager_for(servers, **manager_fields)) as sequential:
        await wait_for_servers(sequential.sequence_manager, len(servers))
        yield sequential


@asynccontextmanager
async def checking_client(
    servers: Sequence[Server], x: torch.Tensor
) -> AsyncIterator[RemoteSequenceManager]:
    """A client checking every answer that has sent ``x`` through the swarm of ``servers`` (a
    liar on its route is caught, and its report filed), running until the block ends."""
    from petals_core.client import remote_forward

    async with sequential_over(servers, verify="all") as checking:
        await remote_forward(checking.sequence_manager, x)
        yield checking.sequence_manager


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


def training_inputs(
    seed: int, rows: int, length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drawn after seeding torch with ``seed``: hidden states ``(rows, length, HIDDEN)``, deep
    prompts of two positions for every block (one row, shared by all) and an output gradient."""
    torch.manual_seed(seed)
    x = torch.randn(rows, length, HIDDEN)
    prompts = torch.randn(N_BLOCKS, 1, 2, HIDDEN) * 0.5
    grad_output = torch.randn(rows, length, HIDDEN)
    return x, prompts, grad_output


def local_grads(
    model: Model,
    x: torch.Tensor,
    grad_output: torch.Tensor,
    prompts: torch.Tensor | None = None,
    blocks: range | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Output, input gradient and prompt gradient of the local blocks."""
    x = x.clone().requires_grad_(True)
    p = None if prompts is None else prompts.clone().requires_grad_(True)
    output = model.forward(x, p, blocks)
    output.backward(grad_output)
    assert x.grad is not None
    return output.detach(), x.grad, None if p is None else p.grad


def manager_for(
    servers: Sequence[Server] | None = None,
    *,
    initial_peers: Sequence[str] = (),
    dht_prefix: str | None = None,
    **fields: Any,
) -> RemoteSequenceManager:
    """A fresh manager (own state) of the swarm of ``servers`` (or of ``initial_peers``), quick
    to retry."""
    if servers is not None:
        initial_peers = [str(servers[0].multiaddrs[0])]
        dht_prefix = servers[0].dht_prefix
    settings: dict[str, Any] = {
        "initial_peers": tuple(initial_peers),
        "dht_prefix": dht_prefix,
        "min_backoff_s": 0.05,
        "max_backoff_s": 0.2,
        "request_timeout_s": 10.0,
        "connect_timeout_s": 2.0,
        "update_period_s": 0.5,
    }
    settings.update(fields)
    return RemoteSequenceManager(SequenceManagerConfig(**settings), N_BLOCKS, hidden_size=HIDDEN)


async def wait_for_servers(manager: RemoteSequenceManager, count: int) -> None:
    """Wait until the manager's peer table shows ``count`` usable servers (it must be running)."""
    topic = manager.state.topic
    assert topic is not None
    with trio.fail_after(DEADLINE_S):
        while len(manager.servers()) < count:
            await topic.wait_snapshot(_newer_than(topic.snapshot().version))


def _newer_than(version: int) -> Callable[[PeerTableSnapshot], bool]:
    return lambda snapshot: snapshot.version > version


def peer_id_of(process: SwarmProcess) -> str:
    """The PeerID a swarm process printed in its address (``.../p2p/<PeerID>``)."""
    return process.address.rsplit("/p2p/", 1)[1]


def process_of(swarm: LocalSwarm, peer_id: str) -> SwarmProcess:
    for process in swarm.servers:
        if peer_id_of(process) == peer_id:
            return process
    raise LookupError(f"no process of the swarm has PeerID {peer_id}")


def process_server_args(span: tuple[int, int]) -> list[str]:
    return fixed_server_args(span, update_period=0.5, dht_prefix=PROCESS_PREFIX, request_timeout=5)
