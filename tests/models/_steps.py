"""Helpers shared by the tests that compare a block's decode paths: perturbed weights, twin
sessions (equal caches to run two ways) and the eager reference step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from petals_core.models import BloomBlock, EagerSteps, KVCache, LlamaBlock


def perturbed(block: nn.Module, seed: int, *, scale: float = 0.15) -> nn.Module:
    """``block`` with weights pushed far from their near-identity init (so that every part of
    the block shows in its outputs), in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in block.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("layernorm.weight"):
                param.copy_(1 + 0.2 * noise)
            else:
                param.copy_(scale * noise)
    return block.eval()


def twin_cache(cache: KVCache) -> KVCache:
    """A copy of ``cache``: the same contents and length, other buffers."""
    copy = KVCache(cache.keys.clone(), cache.values.clone())
    copy.length = cache.length
    return copy


def twin(sessions: Sequence[Sequence[KVCache]]) -> list[list[KVCache]]:
    """:func:`twin_cache` of every cache of every session."""
    return [[twin_cache(cache) for cache in caches] for caches in sessions]


def eager_steps(
    blocks: Sequence[LlamaBlock | BloomBlock],
    xs: list[torch.Tensor],
    sessions: Sequence[Sequence[KVCache]],
) -> list[torch.Tensor]:
    """The sessions' steps through ``blocks`` with ``forward_many``, block after block."""
    with torch.inference_mode():
        return EagerSteps(blocks).step(0, len(blocks), xs, sessions)
