"""``EagerSteps``: the blocks' ``forward_many`` block after block, which takes every step."""

from __future__ import annotations

import pytest
import torch

from petals_core.models import EagerSteps, LlamaBlock

from ._steps import perturbed, twin
from .conftest import HIDDEN, tiny_llama_config


def _span() -> list[LlamaBlock]:
    blocks = [LlamaBlock(tiny_llama_config(), index) for index in range(3)]
    for index, block in enumerate(blocks):
        perturbed(block, index)
    return blocks


def test_steps_are_forward_many_block_after_block() -> None:
    blocks = _span()
    sessions = [
        [block.allocate_cache(1, 8) for block in blocks],
        [block.allocate_cache(2, 8) for block in blocks],
    ]
    reference = twin(sessions)
    xs = [torch.randn(1, 3, HIDDEN), torch.randn(2, 1, HIDDEN)]
    with torch.inference_mode():
        got = EagerSteps(blocks).step(0, 3, xs, sessions)
        expected = xs
        for index, block in enumerate(blocks):
            expected = block.forward_many(expected, [caches[index] for caches in reference])
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
    with torch.inference_mode():  # a sub-span: the items' caches of blocks 1 and 2
        (got_tail,) = EagerSteps(blocks).step(1, 3, [xs[1]], [sessions[1][1:]])
    assert [cache.length for cache in sessions[1]] == [1, 2, 2]
    assert got_tail.shape == (2, 1, HIDDEN)


def test_bad_spans_and_items_are_refused_before_anything_is_written() -> None:
    blocks = _span()
    steps = EagerSteps(blocks)
    caches = [block.allocate_cache(1, 8) for block in blocks]
    x = torch.randn(1, 1, HIDDEN)
    with torch.inference_mode():
        with pytest.raises(ValueError, match=r"blocks \[2, 4\) are not among the 3 held"):
            steps.step(2, 4, [x], [caches])
        with pytest.raises(ValueError, match="1 hidden states for 2 sessions"):
            steps.step(0, 3, [x], [caches, caches])
        with pytest.raises(ValueError, match="a cache for each of the 3 blocks"):
            steps.step(0, 3, [x], [caches[:2]])
    assert [cache.length for cache in caches] == [0, 0, 0]
