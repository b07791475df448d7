"""FalconBlock against transformers' Falcon, layer for layer, with the same weights.

The reference is a tiny ``FalconModel`` (transformers' default attention for Falcon, SDPA; final
norm removed) fed ``inputs_embeds`` with a ``DynamicCache``: its layers' outputs are what a chain
of our blocks must produce, in every layout the config admits.  With ALiBi, transformers' model
folds ``alibi / sqrt(head_dim)`` into the mask it gives its layers, which SDPA adds to the scaled
scores; its eager path adds the ALiBi term to the scores itself as well, so a whole model in eager
mode counts ALiBi twice.  Our blocks compute what the SDPA model computes, and what one eager layer
given the model's ``alibi`` and a plain causal mask computes: ``(q.k + alibi) / sqrt(head_dim)``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import DynamicCache, FalconConfig, FalconModel
from transformers.models.falcon import modeling_falcon as hf_falcon

from petals_core.models import FalconBlock

from ._pairs import (
    BlockPair,
    assert_close_to_scale,
    bfloat16_pieces,
    check_forward_many,
    check_left_padded_batch,
    check_prefill_chunk_and_decode,
    reorder_and_decode,
    roll_back_and_resume,
    soft_prompt_gradients,
)

torch.set_num_threads(1)

HIDDEN = 64
ATOL = 1e-5


def _config(**overrides: Any) -> FalconConfig:
    settings: dict[str, Any] = dict(
        hidden_size=HIDDEN,
        num_attention_heads=8,
        num_hidden_layers=2,
        vocab_size=16,
        max_position_embeddings=64,
    )
    return FalconConfig(**{**settings, **overrides})


CONFIGS = {
    # Falcon-40B/180B: 8 query heads in 2 groups, each with one key/value head.
    "new-2ln": _config(new_decoder_architecture=True, num_kv_heads=2),
    "new-1ln": _config(
        new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1, bias=True
    ),
    # Falcon-7B: one key/value head, parallel attention and MLP.
    "7b": _config(multi_query=True, parallel_attn=True, rope_theta=500.0, ffn_hidden_size=96),
    "sequential": _config(
        multi_query=False, parallel_attn=False, bias=True, layer_norm_epsilon=1e-3
    ),
    # Falcon-RW: ALiBi, one key/value per head, sequential.  16 heads: slopes that are not powers
    # of two, which bf16 rounds.
    "alibi": _config(
        num_attention_heads=16, alibi=True, multi_query=False, parallel_attn=False, bias=True
    ),
    "alibi-multi-query": _config(alibi=True, multi_query=True, parallel_attn=True),
}


class Pair(BlockPair):
    """transformers' FalconModel and a chain of our blocks holding the same random weights."""

    model_class, block_class = FalconModel, FalconBlock
    layers_name, final_norm = "h", "ln_f"

    @staticmethod
    def is_norm(name: str) -> bool:
        return ".ln_" in name or "layernorm" in name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_names_are_transformers_layer_names(name: str) -> None:
    config = CONFIGS[name]
    hf_layer = FalconModel(config).h[0]
    block = FalconBlock(config)
    assert list(block.state_dict()) == list(hf_layer.state_dict())
    block.load_state_dict(hf_layer.state_dict())  # strict


def test_layouts_transformers_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="new_decoder_architecture needs parallel_attn"):
        FalconBlock(_config(new_decoder_architecture=True, parallel_attn=False))
    with pytest.raises(ValueError, match="num_ln_in_parallel_attn=2 needs"):
        FalconBlock(_config(num_ln_in_parallel_attn=2))
    with pytest.raises(ValueError, match="8 heads cannot share 3"):
        FalconBlock(_config(new_decoder_architecture=True, num_kv_heads=3))


def test_rotary_equals_transformers() -> None:
    config = CONFIGS["7b"]  # rope_theta 500
    rotary = FalconBlock(config).rotary
    assert rotary is not None
    x = torch.zeros(1)
    for position, length in [(0, 10), (7, 3), (39, 1)]:
        position_ids = torch.arange(position, position + length)[None]
        expected = hf_falcon.FalconRotaryEmbedding(config)(x, position_ids)
        got = rotary(position, length, device=x.device, dtype=torch.float32)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_alibi_terms_equal_transformers_bit_for_bit() -> None:
    """transformers rounds slope * position to bf16: with 16 heads and 300 positions that is far
    from BLOOM's float32 product, and ours is transformers' bit for bit, padded rows included."""
    config = CONFIGS["alibi"]
    block = FalconBlock(config)
    head_dim = config.hidden_size // config.num_attention_heads
    mask = torch.ones(3, 300, dtype=torch.long)
    padding = torch.tensor([0, 5, 2])
    for row, pad in enumerate(padding.tolist()):
        mask[row, :pad] = 0
    hf = hf_falcon.build_alibi_tensor(mask, config.num_attention_heads, torch.float32)
    expected = hf.view(3, config.num_attention_heads, 300) / math.sqrt(head_dim)
    key_bias = block.positions.key_bias
    assert key_bias is not None
    plain = key_bias(290, 10, 0, torch.device("cpu"), None)
    padded = key_bias(290, 10, 0, torch.device("cpu"), padding)
    assert torch.equal(plain[0], expected[0])
    assert torch.equal(padded, expected)
    exact = block._slopes[:, None] * torch.arange(300) / math.sqrt(head_dim)
    assert (plain[0] - exact).abs().max() > 0.01  # the rounding matters


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_chunk_and_decode_match_transformers(name: str) -> None:
    check_prefill_chunk_and_decode(Pair(CONFIGS[name]))


def test_alibi_past_256_positions_where_bf16_rounds_positions() -> None:
    pair = Pair(CONFIGS["alibi"])
    x = pair.inputs(1, 300)
    hf_cache, caches = DynamicCache(config=pair.config), pair.caches(1, 300)
    with torch.no_grad():
        prefill = x[:, :296]
        assert_close_to_scale(pair.run(prefill, caches), pair.hf_run(prefill, hf_cache), "prefill")
        for t in range(296, 300):
            step = x[:, t : t + 1]
            assert_close_to_scale(pair.run(step, caches), pair.hf_run(step, hf_cache), t)


@pytest.mark.parametrize("name", ["alibi", "7b"])
def test_one_layer_equals_transformers_layer_with_eager_attention(name: str) -> None:
    """transformers' FalconDecoderLayer itself, eager, given what its model computes: the ALiBi
    tensor (or rotary angles) and an additive causal mask."""
    config = FalconConfig(**{**CONFIGS[name].to_dict(), "attn_implementation": "eager"})
    pair = Pair(config)
    layer, block = pair.hf.h[0], pair.blocks[0]
    x = pair.inputs(2, 9)
    causal = torch.full((9, 9), torch.finfo(torch.float32).min).triu(1).expand(2, 1, 9, 9)
    ids = torch.arange(9)[None]
    alibi = None
    if config.alibi:
        alibi = hf_falcon.build_alibi_tensor(
            torch.ones(2, 9, dtype=torch.long), config.num_attention_heads, x.dtype
        )
    angles = hf_falcon.FalconRotaryEmbedding(config)(x, ids)
    with torch.no_grad():
        expected = layer(
            x, alibi=alibi, attention_mask=causal, position_ids=ids, position_embeddings=angles
        )[0]
        assert_close_to_scale(block(x), expected)


@pytest.mark.parametrize("name", ["new-2ln", "alibi"])
def test_batch_of_three_reordered_by_hypo_ids(name: str) -> None:
    pair = Pair(CONFIGS[name])
    got = reorder_and_decode(pair, pair.inputs(3, 14), torch.tensor([2, 0, 0]), prefill=9)
    got.assert_close()


@pytest.mark.parametrize("name", ["new-1ln", "alibi"])
def test_rollback_then_continue_equals_a_fresh_run(name: str) -> None:
    pair = Pair(CONFIGS[name])
    x, continuation = pair.inputs(2, 12), pair.inputs(2, 6, seed=2)
    got = roll_back_and_resume(pair, x, continuation, prefill=9, keep=6)
    got.assert_close()


@pytest.mark.parametrize("name", ["7b", "alibi"])
def test_left_padded_batch_matches_transformers_with_a_mask(name: str) -> None:
    """Positions rotary or ALiBi, counted from each row's first real token."""
    check_left_padded_batch(Pair(CONFIGS[name]))


@pytest.mark.parametrize("name", ["new-2ln", "7b", "alibi"])
def test_forward_many_equals_one_by_one(name: str) -> None:
    check_forward_many(Pair(CONFIGS[name]).blocks[1], HIDDEN, atol=ATOL)


@pytest.mark.parametrize("name", ["new-2ln", "7b", "sequential", "alibi"])
def test_gradients_match_transformers(name: str) -> None:
    """Gradients w.r.t. the input, a soft prompt on the first positions and every weight."""
    ours, theirs = soft_prompt_gradients(Pair(CONFIGS[name]), length=12, prompt_length=3)
    assert len(ours) == len(theirs)
    # Weight gradients sum over many positions: compared relative to their scale.
    for i, (g_ours, g_theirs) in enumerate(zip(ours, theirs, strict=True)):
        assert_close_to_scale(g_ours, g_theirs, i)


@pytest.mark.parametrize(("name", "kv_heads"), [("new-2ln", 2), ("7b", 1), ("alibi", 16)])
def test_allocate_cache_follows_the_layout_and_weights(name: str, kv_heads: int) -> None:
    config = CONFIGS[name]
    block = FalconBlock(config).to(torch.bfloat16)
    cache = block.allocate_cache(3, 10)
    head_dim = config.hidden_size // config.num_attention_heads
    assert cache.keys.shape == (3, kv_heads, 10, head_dim) and cache.keys.dtype == torch.bfloat16
    assert block.allocate_cache(1, 4, dtype=torch.float32).keys.dtype == torch.float32
    assert block._slopes.dtype == torch.float32  # not a buffer: casting the block keeps it


def test_builds_on_the_meta_device_with_real_alibi_slopes() -> None:
    """Counting a block's parameters builds it on "meta"; the ALiBi slopes stay real."""
    with torch.device("meta"):
        block = FalconBlock(CONFIGS["alibi"])
    assert {parameter.device.type for parameter in block.parameters()} == {"meta"}
    torch.testing.assert_close(block._slopes, FalconBlock(CONFIGS["alibi"])._slopes)


def test_bfloat16_runs_close_to_float32() -> None:
    pair = Pair(CONFIGS["new-2ln"])
    got, exact = bfloat16_pieces(pair, pair.inputs(2, 12))
    assert (got - exact).abs().max().item() <= 5e-2 * exact.abs().max().item()


def test_misuse_raises_and_leaves_the_cache_alone() -> None:
    block = FalconBlock(CONFIGS["new-2ln"])
    cache = block.allocate_cache(2, 6)
    with torch.no_grad():
        block(torch.randn(2, 3, HIDDEN), cache=cache)
        for position in (2, 4):
            with pytest.raises(ValueError, match=f"the next one is 3, not {position}; roll"):
                block(torch.randn(2, 1, HIDDEN), cache=cache, position=position)
        with pytest.raises(ValueError, match=rf"\(batch, T >= 1, {HIDDEN}\), got \(2, 1, 65\)"):
            block(torch.randn(2, 1, HIDDEN + 1), cache=cache)
        with pytest.raises(ValueError, match="3 rows of hidden states for a cache of 2 rows"):
            block(torch.randn(3, 1, HIDDEN), cache=cache)
        with pytest.raises(ValueError, match="bfloat16"):
            block(torch.randn(2, 1, HIDDEN).bfloat16(), cache=cache)
        with pytest.raises(ValueError, match="position must be >= 0"):
            block(torch.randn(2, 1, HIDDEN), position=-1)
        with pytest.raises(ValueError, match="holds 6 positions; 3 are used and 4 more"):
            block(torch.randn(2, 4, HIDDEN), cache=cache)
        assert cache.length == 3
        block(torch.randn(2, 3, HIDDEN), cache=cache, position=3)  # exactly full is fine
    assert cache.length == 6
