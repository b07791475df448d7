"""Swarms for the tests of the distributed models and the client: tiny LLaMA (grouped-query
attention), BLOOM, Falcon (new decoder architecture) and Mixtral (8 experts, top 2) checkpoints,
each served by two in-process servers holding blocks 0:3 and 3:6, in fp32.

The servers run in one trio program on a daemon thread (``trio.run``), for the whole test
session; the models under test are sync and reach them through the client bridge's own thread.
``tests/conftest.py`` makes them the session fixtures ``served``, ``served_llama``,
``served_bloom``, ``served_falcon`` and ``served_mixtral``, importing this module only when a
test asks for one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio
from transformers import BloomForCausalLM, FalconForCausalLM, LlamaForCausalLM, MixtralForCausalLM

from petals_core.server import ServerConfig, open_server
from petals_core.testing import tiny_falcon_config, tiny_mixtral_config

from ._trio_thread import TrioThread
from .models.conftest import (
    SHARD_SIZE,
    TinyCheckpoint,
    _save,
    tiny_bloom_config,
    tiny_llama_config,
)

START_TIMEOUT_S = 120.0


@attrs.frozen(kw_only=True)
class ServedModel:
    """A checkpoint and the multiaddrs of the first server of its swarm."""

    checkpoint: TinyCheckpoint
    initial_peers: tuple[str, ...]
    dht_prefix: str

    @property
    def folder(self) -> Path:
        return self.checkpoint.folder


class InProcessSwarm(TrioThread):
    """Servers for several checkpoints, in a trio program on a daemon thread."""

    def __init__(self, checkpoints: dict[str, TinyCheckpoint], cache_dir: Path) -> None:
        super().__init__(
            "the test swarm", thread_name="test-swarm", start_timeout_s=START_TIMEOUT_S
        )
        self._checkpoints = checkpoints
        self._cache_dir = cache_dir
        self._started: trio.Event | None = None
        self.served: dict[str, ServedModel] = {}

    def __enter__(self) -> InProcessSwarm:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    async def _program(self) -> None:
        self._started = trio.Event()
        async with trio.open_nursery() as nursery:
            # Each swarm in its own task, so that they start and stop concurrently.
            for name, checkpoint in self._checkpoints.items():
                nursery.start_soon(self._serve, name, checkpoint)
            while len(self.served) < len(self._checkpoints):
                await self._started.wait()
                self._started = trio.Event()
            self._serving()

    async def _serve(self, name: str, checkpoint: TinyCheckpoint) -> None:
        common: dict[str, Any] = {
            "model": str(checkpoint.folder),
            "host": "127.0.0.1",
            "throughput": 1.0,
            "torch_dtype": "float32",
            # On the CPU on a CUDA machine too: a client's backward on the GPU holds torch's CUDA
            # autograd thread while it waits for the server, whose own backward on the GPU in the
            # same process would queue behind it.
            "device": "cpu",
            "quant_type": "none",  # the tests compare with unquantised models, on CUDA too
            "cache_dir": str(self._cache_dir / name),
        }
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(
                open_server(ServerConfig(new_swarm=True, block_indices=(0, 3), **common))
            )
            peers = tuple(str(address) for address in first.multiaddrs)
            await stack.enter_async_context(
                open_server(ServerConfig(initial_peers=peers, block_indices=(3, 6), **common))
            )
            self.served[name] = ServedModel(
                checkpoint=checkpoint, initial_peers=peers, dht_prefix=first.dht_prefix
            )
            assert self._started is not None and self._stop is not None
            self._started.set()
            await self._stop.wait()


@contextmanager
def open_client_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSwarm]:
    """A swarm of each family (``served["llama"]``, ``served["bloom"]``, ``served["falcon"]``,
    ``served["mixtral"]``) until the block ends."""
    torch.manual_seed(20)
    llama = LlamaForCausalLM(tiny_llama_config(pad_token_id=0))
    torch.manual_seed(21)
    bloom = BloomForCausalLM(tiny_bloom_config())
    torch.manual_seed(22)
    falcon = FalconForCausalLM(tiny_falcon_config(pad_token_id=0))
    torch.manual_seed(23)
    mixtral = MixtralForCausalLM(tiny_mixtral_config())
    checkpoints = {
        "llama": _save(llama, tmp_path_factory.mktemp("client-llama"), max_shard_size=SHARD_SIZE),
        "bloom": _save(bloom, tmp_path_factory.mktemp("client-bloom"), max_shard_size=SHARD_SIZE),
        "falcon": _save(
            falcon, tmp_path_factory.mktemp("client-falcon"), max_shard_size=SHARD_SIZE
        ),
        "mixtral": _save(
            mixtral, tmp_path_factory.mktemp("client-mixtral"), max_shard_size=SHARD_SIZE
        ),
    }
    with InProcessSwarm(checkpoints, tmp_path_factory.mktemp("client-cache")) as swarm:
        yield swarm
