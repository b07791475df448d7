"""``forward_many``: several sessions' steps through one block at once equal one by one.

Each test builds the same sessions twice (twin caches with equal contents), runs one twin through
``block(h, cache=c)`` item by item and the other through ``block.forward_many``, and compares both
the outputs and the caches afterwards.  Weights are pushed far from their near-identity init so
that every part of the block shows in the outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from petals_core.models import BloomBlock, KVCache, LlamaBlock, QuantType, quantize_block
from petals_core.models._batched import join_rows, join_tokens

from ._steps import perturbed, twin_cache
from .conftest import HIDDEN, tiny_bloom_config, tiny_llama_config

torch.set_num_threads(1)

Block = LlamaBlock | BloomBlock
TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
MAX_LENGTH = 24

# (cache length before the step, rows, new tokens) for each session.
Spec = tuple[int, int, int]


BLOCKS: dict[str, Callable[[], Block]] = {
    "llama-gqa": lambda: LlamaBlock(tiny_llama_config()),  # 4 query heads share 2 kv heads
    "llama-mha": lambda: LlamaBlock(tiny_llama_config(num_key_value_heads=4)),
    # Dynamic NTK rescales past 8 positions: sessions on either side of it in one batch.
    "llama-dynamic": lambda: LlamaBlock(
        tiny_llama_config(
            max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        )
    ),
    "bloom": lambda: BloomBlock(tiny_bloom_config()),
    "bloom-residual-post-ln": lambda: BloomBlock(
        tiny_bloom_config(apply_residual_connection_post_layernorm=True)
    ),
}


def _block(name: str, seed: int = 0) -> Block:
    block = BLOCKS[name]()
    perturbed(block, seed)
    return block


def _sessions(block: Block, specs: list[Spec], seed: int) -> list[KVCache]:
    """A cache per session, filled by the single path with ``length`` random positions."""
    generator = torch.Generator().manual_seed(seed)
    dtype = block.input_layernorm.weight.dtype
    caches = []
    for length, rows, _ in specs:
        cache = block.allocate_cache(rows, MAX_LENGTH)
        if length:
            prefix = torch.randn(rows, length, HIDDEN, generator=generator).to(dtype)
            with torch.no_grad():
                block(prefix, cache=cache)
        caches.append(cache)
    return caches


def _steps(specs: list[Spec], seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, new, HIDDEN, generator=generator).to(dtype) for _, rows, new in specs]


def _one_by_one(
    block: Block, steps: list[torch.Tensor], caches: list[KVCache]
) -> list[torch.Tensor]:
    with torch.no_grad():
        return [block(h, cache=c) for h, c in zip(steps, caches, strict=True)]


def _batched_and_one_by_one(
    block: Block, specs: list[Spec], seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[KVCache], list[KVCache]]:
    """One step of each session of ``specs`` through ``forward_many``, and the same steps one
    session at a time on twin caches: (batched outputs, one-by-one outputs, caches, twins)."""
    caches = _sessions(block, specs, seed=seed)
    twins = [twin_cache(cache) for cache in caches]
    steps = _steps(specs, seed=seed + 1)
    expected = _one_by_one(block, steps, twins)
    return block.forward_many(steps, caches), expected, caches, twins


def _assert_caches_close(got: list[KVCache], expected: list[KVCache]) -> None:
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.length == theirs.length
        torch.testing.assert_close(ours.keys, theirs.keys, **TOL)
        torch.testing.assert_close(ours.values, theirs.values, **TOL)


SPECS: dict[str, list[Spec]] = {
    # Single-token decode steps of sessions at different lengths, 1 and 2 rows.
    "decode": [(5, 1, 1), (0, 2, 1), (11, 2, 1), (3, 1, 1), (9, 1, 1)],
    # Prefill chunks and decode steps together.
    "mixed": [(7, 1, 3), (0, 2, 5), (2, 2, 1), (9, 1, 1), (0, 1, 1)],
    "single-decode": [(6, 2, 1)],
    "single-chunk": [(4, 1, 4)],
}


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("block_name", sorted(BLOCKS))
def test_forward_many_equals_one_by_one(block_name: str, spec_name: str) -> None:
    block = _block(block_name)
    specs = SPECS[spec_name]
    caches = _sessions(block, specs, seed=1)
    twins = [twin_cache(cache) for cache in caches]
    for round_ in range(3):  # several steps in a row: the caches keep agreeing
        steps = _steps(specs if round_ == 0 else [(0, r, 1) for _, r, _ in specs], seed=2 + round_)
        expected = _one_by_one(block, steps, twins)
        got = block.forward_many(steps, caches)
        assert len(got) == len(expected)
        for ours, theirs, step in zip(got, expected, steps, strict=True):
            assert ours.shape == step.shape and ours.dtype == step.dtype
            torch.testing.assert_close(ours, theirs, **TOL)
        _assert_caches_close(caches, twins)


@settings(max_examples=15, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 12), st.integers(1, 2), st.integers(1, 4)), min_size=1, max_size=5
    ),
    family=st.sampled_from(["llama-gqa", "bloom"]),
)
def test_any_mix_of_sessions_equals_one_by_one(specs: list[Spec], family: str) -> None:
    block = _block(family)
    got, expected, caches, twins = _batched_and_one_by_one(block, specs, seed=3)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, **TOL)
    _assert_caches_close(caches, twins)


@pytest.mark.parametrize("block_name", ["llama-gqa", "bloom"])
def test_no_items_is_no_work(block_name: str) -> None:
    assert _block(block_name).forward_many([], []) == []


@pytest.mark.parametrize("block_name", ["llama-gqa", "bloom"])
def test_runs_without_autograd(block_name: str) -> None:
    block = _block(block_name)  # parameters require grad
    caches = _sessions(block, [(3, 1, 1), (0, 2, 2)], seed=5)
    steps = [h.requires_grad_() for h in _steps([(3, 1, 1), (0, 2, 2)], seed=6)]
    assert not any(out.requires_grad for out in block.forward_many(steps, caches))
    assert not any(cache.keys.requires_grad for cache in caches)


def _bad_batches(block: Block, caches: list[KVCache]) -> dict[str, tuple[Any, Any, str]]:
    """Ways to break the last of three good items: (hidden_states, caches, error pattern)."""
    good = _steps([(0, c.batch, 2) for c in caches], seed=7)
    a, b, c = caches
    kv_heads = c.keys.shape[1]
    wrong_layout = KVCache.allocate(
        batch=1, kv_heads=kv_heads + 1, max_length=MAX_LENGTH, head_dim=16, dtype=torch.float32
    )
    shared = KVCache(a.keys, a.values)  # another object over the first session's buffers
    return {
        "hidden size": ([*good[:2], torch.randn(1, 2, HIDDEN + 1)], caches, r"item 2: .*\(batch"),
        "dtype": ([*good[:2], good[2].bfloat16()], caches, "item 2: .*bfloat16"),
        "device": ([*good[:2], good[2].to("meta")], caches, "item 2: .*meta"),
        "rows": ([*good[:2], torch.randn(3, 1, HIDDEN)], caches, "item 2: 3 rows"),
        "no room": (
            [*good[:2], torch.randn(1, MAX_LENGTH, HIDDEN)],
            caches,
            f"item 2: .*holds {MAX_LENGTH} positions; 5 are used and {MAX_LENGTH} more",
        ),
        "cache dtype": (
            good,
            [a, b, block.allocate_cache(1, MAX_LENGTH, dtype=torch.bfloat16)],
            "item 2: .*allocate_cache",
        ),
        "cache layout": (good, [a, b, wrong_layout], "item 2: .*key/value heads"),
        "same cache twice": ([*good[:2], good[0]], [a, b, a], r"caches\[2\] .* caches\[0\]"),
        "shared buffers": ([*good[:2], good[0]], [a, b, shared], r"caches\[2\] .* caches\[0\]"),
        "count": (good[:2], caches, "2 hidden states for 3 caches"),
    }


BAD = ["hidden size", "dtype", "device", "rows", "no room", "cache dtype", "cache layout"]
BAD += ["same cache twice", "shared buffers", "count"]


@pytest.mark.parametrize("fault", BAD)
@pytest.mark.parametrize("block_name", ["llama-gqa", "bloom"])
def test_refused_batch_leaves_every_cache_untouched(block_name: str, fault: str) -> None:
    block = _block(block_name)
    caches = _sessions(block, [(4, 1, 2), (0, 2, 2), (5, 1, 2)], seed=8)
    before = [twin_cache(cache) for cache in caches]
    steps, given_caches, pattern = _bad_batches(block, caches)[fault]
    with pytest.raises(ValueError, match=pattern):
        block.forward_many(steps, given_caches)
    for cache, snapshot in zip(caches, before, strict=True):
        assert cache.length == snapshot.length
        assert torch.equal(cache.keys, snapshot.keys)
        assert torch.equal(cache.values, snapshot.values)


def test_a_cache_that_is_not_a_kvcache_is_refused() -> None:
    block = _block("llama-gqa")
    with pytest.raises(TypeError, match=r"caches\[0\] is a Tensor"):
        block.forward_many([torch.randn(1, 1, HIDDEN)], [torch.zeros(1)])  # type: ignore[list-item]


@pytest.mark.parametrize("block_name", ["llama-gqa", "bloom"])
def test_bfloat16_block(block_name: str) -> None:
    """bf16 runs, matches the bf16 one-by-one path closely and the fp32 result loosely."""
    specs: list[Spec] = [(5, 1, 1), (0, 2, 3), (9, 2, 1)]
    block32 = _block(block_name)
    block16 = _block(block_name).to(torch.bfloat16)
    caches32 = _sessions(block32, specs, seed=9)
    caches16 = _sessions(block16, specs, seed=9)
    twins16 = [twin_cache(cache) for cache in caches16]
    steps = _steps(specs, seed=10)
    exact = block32.forward_many(steps, caches32)
    got = block16.forward_many([h.bfloat16() for h in steps], caches16)
    one_by_one = _one_by_one(block16, [h.bfloat16() for h in steps], twins16)
    for ours, single, reference in zip(got, one_by_one, exact, strict=True):
        assert ours.dtype == torch.bfloat16 and ours.shape == reference.shape
        assert bool(ours.isfinite().all())
        # One bf16 rounding step apart at most, relative to the activations' size.
        scale = reference.abs().max().item()
        assert (ours.float() - single.float()).abs().max().item() <= 2e-2 * scale
        assert (ours.float() - reference).abs().max().item() <= 5e-2 * scale
    assert [c.length for c in caches16] == [c.length for c in twins16]


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
@pytest.mark.parametrize("block_name", ["llama-gqa", "bloom"])
def test_quantised_block(block_name: str, quant_type: QuantType) -> None:
    """bitsandbytes linears are called as modules, on the joined tokens.

    nf4 dequantises the weights and multiplies: the same as one by one.  LLM.int8() computes
    in 16 bits every input column holding an outlier (> 6.0) in *any* row of the matrix it is
    given, so joining sessions can move a column to the 16-bit side: a difference of the order of
    int8 rounding (~1e-3 relative here; int8's own error is ~1.5e-2, see test_quantize).
    """
    pytest.importorskip("bitsandbytes")
    block = _block(block_name)
    quantize_block(block, quant_type)  # in place
    specs: list[Spec] = [(5, 1, 1), (0, 2, 3), (9, 2, 1), (2, 1, 1)]
    got, expected, caches, twins = _batched_and_one_by_one(block, specs, seed=11)
    for ours, theirs in zip(got, expected, strict=True):
        if quant_type == "nf4":
            torch.testing.assert_close(ours, theirs, **TOL)
        else:
            scale = theirs.abs().max().item()
            assert (ours - theirs).abs().max().item() <= 5e-3 * scale
    _assert_caches_close(caches, twins)


def test_one_item_is_joined_without_a_copy_and_many_are_concatenated() -> None:
    one = torch.randn(2, 3, HIDDEN)
    joined = join_tokens([one])
    assert joined.shape == (1, 6, HIDDEN) and joined.data_ptr() == one.data_ptr()
    rows = torch.randn(4, HIDDEN)
    assert join_rows([rows]) is rows
    other = torch.randn(2, 1, HIDDEN)
    assert torch.equal(
        join_tokens([one, other]), torch.cat([one.view(1, 6, -1), other.view(1, 2, -1)], 1)
    )
    assert torch.equal(join_rows([rows, rows[:1]]), torch.cat([rows, rows[:1]]))


@pytest.mark.parametrize("block_name", ["llama", "bloom"])
def test_a_single_step_leaves_its_input_as_it_was(block_name: str) -> None:
    config = tiny_llama_config() if block_name == "llama" else tiny_bloom_config()
    block = (LlamaBlock if block_name == "llama" else BloomBlock)(config).eval()
    cache = block.allocate_cache(1, MAX_LENGTH)
    hidden = torch.randn(1, 3, HIDDEN)
    before = hidden.clone()
    (output,) = block.forward_many([hidden], [cache])
    assert torch.equal(hidden, before) and output.data_ptr() != hidden.data_ptr()
