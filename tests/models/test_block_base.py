"""What every family's block does the same way (:class:`CachedBlock`): the cache it allocates
follows its layout and its weights, and steps through a cache record no autograd graph."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from petals_core.models import BloomBlock, FalconBlock, LlamaBlock, MixtralBlock
from petals_core.models._block_base import CachedBlock
from petals_core.testing import (
    tiny_bloom_config,
    tiny_falcon_config,
    tiny_llama_config,
    tiny_mixtral_config,
)

torch.set_num_threads(1)

#: A block of each family and its cache's (kv_heads, head_dim).
BLOCKS: dict[str, tuple[Callable[[], CachedBlock], tuple[int, int]]] = {
    "bloom": (lambda: BloomBlock(tiny_bloom_config()), (4, 16)),
    "falcon": (lambda: FalconBlock(tiny_falcon_config()), (2, 8)),
    "llama": (lambda: LlamaBlock(tiny_llama_config()), (2, 16)),
    "mixtral": (lambda: MixtralBlock(tiny_mixtral_config()), (2, 16)),
}


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_allocate_cache_follows_the_layout_and_the_norm_weight(family: str) -> None:
    make, (kv_heads, head_dim) = BLOCKS[family]
    block = make().to(torch.bfloat16)
    assert block.cache_heads == (kv_heads, head_dim)
    assert block.norm_weight.dtype == torch.bfloat16
    cache = block.allocate_cache(3, 10)
    assert cache.keys.shape == (3, kv_heads, 10, head_dim)
    assert cache.keys.dtype == torch.bfloat16 and cache.length == 0
    assert block.allocate_cache(1, 4, dtype=torch.float32).keys.dtype == torch.float32
    assert block.allocate_cache(1, 4, device="meta").keys.device.type == "meta"


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_cache_path_records_no_graph(family: str) -> None:
    block = BLOCKS[family][0]()
    cache = block.allocate_cache(1, 4)
    y = block(torch.randn(1, 2, block.hidden_size, requires_grad=True), cache=cache)
    assert not y.requires_grad
    assert not cache.keys.requires_grad
    assert block(torch.randn(1, 2, block.hidden_size, requires_grad=True)).requires_grad
