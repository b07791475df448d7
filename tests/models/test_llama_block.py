"""LlamaBlock against transformers' own LLaMA, layer for layer, with the same weights.

The reference is a tiny ``LlamaModel`` (transformers' default SDPA attention, final norm removed)
fed ``inputs_embeds`` with a ``DynamicCache``: its layers' outputs are what a chain of our blocks
must produce.  Our CPU attention calls SDPA the way transformers does, so fp32 agrees to 1e-5
even with the large activations these tests use on purpose.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from petals_core._hf_compat import cache_kwargs
from petals_core.models._cache import KVCache
from petals_core.models.llama import LlamaBlock, LlamaRotary
from petals_core.testing import smollm2_135m_config, tiny_llama_config

from ._pairs import (
    BlockPair,
    reorder_and_decode,
    roll_back_and_resume,
    soft_prompt_gradients,
)
from .conftest import HIDDEN

torch.set_num_threads(1)

ATOL = 1e-5


def _config(**overrides: Any) -> LlamaConfig:
    settings: dict[str, Any] = dict(
        num_hidden_layers=2,
        vocab_size=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        attn_implementation="sdpa",
    )
    return tiny_llama_config(**{**settings, **overrides})


CONFIGS = {
    "gqa": _config(),
    "mha": _config(num_key_value_heads=4),
    "biases": _config(attention_bias=True, mlp_bias=True),
    "linear": _config(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # max_position_embeddings is the length past which dynamic NTK rescales; the tests go past it.
    "dynamic": _config(
        max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    ),
    "llama3": _config(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "yarn": _config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ),
}


class Pair(BlockPair):
    """transformers' LlamaModel and a chain of our blocks holding the same random weights."""

    model_class, block_class = LlamaModel, LlamaBlock
    layers_name, final_norm = "layers", "norm"

    @staticmethod
    def is_norm(name: str) -> bool:
        return name.endswith("norm.weight")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("bias", [False, True])
def test_parameter_names_are_transformers_layer_names(bias: bool) -> None:
    config = _config(attention_bias=bias, mlp_bias=bias)
    hf_layer = LlamaModel(config).layers[0]
    block = LlamaBlock(config)
    assert set(block.state_dict()) == set(hf_layer.state_dict())
    block.load_state_dict(hf_layer.state_dict())  # strict


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_builds_on_the_meta_device_with_real_frequencies(name: str) -> None:
    """Counting a block's parameters builds it on "meta"; the rotary frequencies stay real."""
    config = CONFIGS[name]
    with torch.device("meta"):
        block = LlamaBlock(config)
    assert {parameter.device.type for parameter in block.parameters()} == {"meta"}
    assert sum(p.numel() for p in block.parameters()) == sum(
        p.numel() for p in LlamaBlock(config).parameters()
    )
    torch.testing.assert_close(block.rotary.inv_freq, LlamaRotary(config).inv_freq, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rotary_equals_transformers(name: str) -> None:
    config = CONFIGS[name]
    ours = LlamaRotary(config)
    x = torch.zeros(1, dtype=torch.float32)
    for position, length in [(0, 10), (0, 40), (7, 3), (39, 1)]:
        # A fresh module per chunk: transformers' dynamic scaling keeps a high-water mark.
        theirs = LlamaRotaryEmbedding(config)
        position_ids = torch.arange(position, position + length)[None]
        expected = theirs(x, position_ids)
        got = ours(position, length, device=x.device, dtype=torch.float32)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rotary_reuses_the_last_angles_only_where_they_are_the_same(name: str) -> None:
    config = CONFIGS[name]
    first, second = LlamaRotary(config), LlamaRotary(config)  # two blocks of one model
    cpu, f32 = torch.device("cpu"), torch.float32
    with torch.no_grad():
        expected = first(5, 1, device=cpu, dtype=f32)
    with torch.inference_mode():
        computed = first(5, 1, device=cpu, dtype=f32)
        # The next block asks for the same positions: the very same tensors come back.
        reused = second(5, 1, device=cpu, dtype=f32)
        assert all(a is b for a, b in zip(reused, computed, strict=True))
        # Other positions, another dtype, or padding: computed anew.
        assert second(6, 1, device=cpu, dtype=f32)[0] is not computed[0]
        assert second(6, 1, device=cpu, dtype=torch.float64)[0].dtype == torch.float64
        padded = second(6, 1, device=cpu, dtype=f32, padding=torch.tensor([2]))
        assert padded[0] is not second(6, 1, device=cpu, dtype=f32)[0]
        torch.testing.assert_close(padded, first(4, 1, device=cpu, dtype=f32), atol=0, rtol=0)
    for got, want in zip(computed, expected, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    # Outside inference mode nothing is reused, so autograd never meets an inference tensor.
    with torch.no_grad():
        again = second(5, 1, device=cpu, dtype=f32)
    assert not again[0].is_inference() and again[0] is not computed[0]
    # A different rotary configuration never takes another's angles.
    other = LlamaRotary(_config(rope_parameters={"rope_type": "default", "rope_theta": 123.0}))
    with torch.inference_mode():
        mine = first(9, 2, device=cpu, dtype=f32)
        theirs = other(9, 2, device=cpu, dtype=f32)
    assert not torch.equal(mine[0], theirs[0])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_chunk_and_decode_match_transformers(name: str) -> None:
    pair = Pair(CONFIGS[name])
    batch, prefill, chunk, steps = 2, 12, 9, 8
    x = pair.inputs(batch, prefill + chunk + steps)
    hf_cache, caches = DynamicCache(config=pair.config), pair.caches(batch, 40)
    with torch.no_grad():
        # Without a cache, the whole sequence at once (the training path).
        assert _max_diff(pair.run(x), pair.hf_run(x)) <= ATOL
        pieces = [(0, prefill), (prefill, prefill + chunk)]
        pieces += [(t, t + 1) for t in range(prefill + chunk, x.shape[1])]
        for start, end in pieces:
            ours = pair.run(x[:, start:end], caches)
            theirs = pair.hf_run(x[:, start:end], hf_cache)
            assert _max_diff(ours, theirs) <= ATOL, (start, end)
    assert all(cache.length == x.shape[1] for cache in caches)


def test_dynamic_rope_prefill_longer_than_original_length() -> None:
    pair = Pair(CONFIGS["dynamic"])  # rescales past 16 positions
    x = pair.inputs(1, 30)
    hf_cache, caches = DynamicCache(config=pair.config), pair.caches(1, 32)
    with torch.no_grad():
        assert _max_diff(pair.run(x[:, :24], caches), pair.hf_run(x[:, :24], hf_cache)) <= ATOL
        for t in range(24, 30):
            ours, theirs = pair.run(x[:, t : t + 1], caches), pair.hf_run(x[:, t : t + 1], hf_cache)
            assert _max_diff(ours, theirs) <= ATOL, t


def test_batch_of_three_reordered_by_hypo_ids() -> None:
    pair = Pair(CONFIGS["gqa"])
    got = reorder_and_decode(pair, pair.inputs(3, 16), torch.tensor([2, 0, 0]), prefill=10)
    assert _max_diff(got.ours, got.hf) <= ATOL
    assert _max_diff(got.ours, got.fresh) <= ATOL


def test_rollback_then_continue_equals_a_fresh_run() -> None:
    pair = Pair(CONFIGS["gqa"])
    x, continuation = pair.inputs(2, 14), pair.inputs(2, 7, seed=2)
    got = roll_back_and_resume(pair, x, continuation, prefill=10, keep=7)
    assert _max_diff(got.resumed, got.fresh) <= ATOL
    assert _max_diff(got.resumed, got.hf_fresh) <= ATOL
    assert _max_diff(got.resumed[:, : got.chunk], got.hf_cropped) <= ATOL


@pytest.mark.parametrize("name", ["gqa", "mha", "dynamic"])
def test_gradients_match_transformers(name: str) -> None:
    """Gradients w.r.t. the input, a soft prompt on the first positions and every weight."""
    pair = Pair(CONFIGS[name])
    # 20 > 16: past the dynamic config's original length
    ours, theirs = soft_prompt_gradients(pair, length=20, prompt_length=4)
    assert len(ours) == len(theirs)
    for g_ours, g_theirs in zip(ours, theirs, strict=True):
        scale = max(1.0, g_theirs.abs().max().item())  # weight gradients sum over many positions
        assert _max_diff(g_ours, g_theirs) <= ATOL * scale


def test_smollm2_shaped_layer() -> None:
    config = smollm2_135m_config(num_hidden_layers=1, vocab_size=16, attn_implementation="sdpa")
    pair = Pair(config)
    x = pair.inputs(1, 20)
    hf_cache, caches = DynamicCache(config=config), pair.caches(1, 20)
    with torch.no_grad():
        assert _max_diff(pair.run(x[:, :16], caches), pair.hf_run(x[:, :16], hf_cache)) <= ATOL
        for t in range(16, 20):
            ours, theirs = pair.run(x[:, t : t + 1], caches), pair.hf_run(x[:, t : t + 1], hf_cache)
            # The outputs (tens here) agree to float32's relative precision, not to 1e-5 absolute.
            scale = max(1.0, theirs.abs().max().item())
            assert _max_diff(ours, theirs) <= ATOL * scale, t


def test_bfloat16_error_is_no_worse_than_transformers() -> None:
    """Ours and transformers in bf16, each compared with the float32 result of the same weights.

    bf16 rounds to 8 significant bits (~4e-3 relative per operation), so both drift visibly from
    float32 and no fixed tolerance separates rounding from a bug. What a correct block must do is
    round no worse than transformers: the same linears, norms and residual adds in the same dtype,
    with attention computed in float32 where transformers' eager path multiplies in bf16. Hence
    ours' error must be at most transformers', with 1.5x slack for the luck of individual roundings
    and a tiny absolute term for when both are near zero. Gross bugs (a wrong position, a dropped
    scale) are the float32 tests' job; this one catches a bf16 path that loses precision.
    """
    pair = Pair(CONFIGS["gqa"])
    # Weights and inputs representable in bf16, so the comparison measures computation only.
    with torch.no_grad():
        for module in [pair.hf, *pair.blocks]:
            for param in module.parameters():
                param.copy_(param.bfloat16().float())
    x = pair.inputs(2, 24).bfloat16().float()
    hf_bf16 = copy.deepcopy(pair.hf).to(torch.bfloat16)
    blocks_bf16 = [copy.deepcopy(block).to(torch.bfloat16) for block in pair.blocks]

    def decode(run: Any, make_cache: Any, dtype: torch.dtype) -> torch.Tensor:
        cache = make_cache()
        outputs = [run(x[:, :16].to(dtype), cache)]
        outputs += [run(x[:, t : t + 1].to(dtype), cache) for t in range(16, 24)]
        return torch.cat(outputs, dim=1).float()

    def run_ours(h: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        for block, cache in zip(blocks_bf16, caches, strict=True):
            h = block(h, cache=cache)
        return h

    def run_hf(h: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        return hf_bf16(inputs_embeds=h, use_cache=True, **cache_kwargs(cache)).last_hidden_state

    with torch.no_grad():
        exact = pair.run(x)
        ours = decode(
            run_ours, lambda: [b.allocate_cache(2, 24) for b in blocks_bf16], torch.bfloat16
        )
        theirs = decode(run_hf, lambda: DynamicCache(config=pair.config), torch.bfloat16)
    for reduce in (torch.max, torch.mean):
        ours_error = reduce((ours - exact).abs()).item()
        hf_error = reduce((theirs - exact).abs()).item()
        assert ours_error <= 1.5 * hf_error + 1e-4, (reduce.__name__, ours_error, hf_error)


def test_cache_overflow_raises() -> None:
    block = LlamaBlock(CONFIGS["gqa"])
    cache = block.allocate_cache(1, 8)
    x = torch.randn(1, 6, HIDDEN)
    with torch.no_grad():
        block(x, cache=cache)
        with pytest.raises(ValueError, match="holds 8 positions; 6 are used and 3 more do not fit"):
            block(x[:, :3], cache=cache)
        assert cache.length == 6
        block(x[:, :2], cache=cache)  # exactly full is fine
        with pytest.raises(ValueError, match="do not fit"):
            block(x[:, :1], cache=cache)


def test_position_must_continue_the_cache() -> None:
    block = LlamaBlock(CONFIGS["gqa"])
    cache = block.allocate_cache(1, 8)
    x = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        block(x, cache=cache, position=0)
        with pytest.raises(ValueError, match="roll the cache back"):
            block(x, cache=cache, position=1)
        block(x, cache=cache, position=3)
    assert cache.length == 6


def test_allocate_cache_follows_the_weights() -> None:
    block = LlamaBlock(CONFIGS["gqa"]).to(torch.bfloat16)
    cache = block.allocate_cache(3, 10)
    assert cache.keys.shape == (3, 2, 10, 16) and cache.keys.dtype == torch.bfloat16
    assert block.allocate_cache(1, 4, dtype=torch.float32).keys.dtype == torch.float32
    # The rotary frequencies are not a buffer: casting the block keeps them in float32.
    assert block.rotary.inv_freq.dtype == torch.float32


def test_unsupported_rope_type_is_refused() -> None:
    config = _config(
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 16,
        }
    )
    with pytest.raises(ValueError, match="longrope"):
        LlamaBlock(config)
