"""``BlockBackend``: the decode backend it chooses for its blocks, and its steps either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig

from petals_core.models import CpuDecode, LlamaBlock, LoraAdapter, MixtralBlock, add_adapter
from petals_core.server._backend import BlockBackend
from petals_core.testing import tiny_mixtral_config

HIDDEN = 64
CPU = torch.device("cpu")
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}


def _blocks(count: int = 3, dtype: torch.dtype = torch.float32) -> list[LlamaBlock]:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    blocks = [LlamaBlock(config, index) for index in range(count)]
    with torch.no_grad():
        for block in blocks:
            for parameter in block.parameters():
                parameter.normal_(0.0, 0.2)
    return [block.to(dtype) for block in blocks]


def _backend(blocks: list[LlamaBlock], **kw: object) -> BlockBackend:
    dtype = blocks[0].input_layernorm.weight.dtype
    return BlockBackend(
        blocks,
        start=10,
        hidden_size=HIDDEN,
        dtype=dtype,
        device=CPU,
        **kw,  # type: ignore[arg-type]
    )


def _adapter(path: str, index: int) -> LoraAdapter:
    generator = torch.Generator().manual_seed(index)
    return LoraAdapter(
        name="tuned",
        rank=2,
        scaling=1.0,
        target_modules=frozenset({path}),
        weights={
            index: {
                path: (
                    torch.randn(2, HIDDEN, generator=generator),
                    torch.randn(HIDDEN, 2, generator=generator),
                )
            }
        },
    )


def test_fp32_cpu_blocks_get_the_numpy_backend_unless_told_torch() -> None:
    blocks = _blocks()
    numpy = _backend(blocks)
    assert isinstance(numpy.decode_steps, CpuDecode)
    assert numpy.decode_steps.numpy_blocks == 3
    assert _backend(blocks, cpu_decode="torch").decode_steps is None
    assert _backend(_blocks(dtype=torch.bfloat16)).decode_steps is None
    with pytest.raises(ValueError, match="cpu_decode must be one of numpy, torch, not 'fast'"):
        _backend(blocks, cpu_decode="fast")


def test_blocks_with_adapters_keep_their_torch_path() -> None:
    blocks, same = _blocks(), _blocks()
    for each in (blocks, same):
        add_adapter(each[1], _adapter("self_attn.q_proj", 11), 11)
    backend = _backend(blocks, adapters=["tuned"])
    assert isinstance(backend.decode_steps, CpuDecode)
    assert backend.decode_steps.numpy_blocks == 2
    reference = _backend(same, adapters=["tuned"], cpu_decode="torch")
    _compare_steps(backend, reference, adapter="tuned")
    (only,) = _blocks(1)
    add_adapter(only, _adapter("self_attn.q_proj", 10), 10)
    assert _backend([only], adapters=["tuned"]).decode_steps is None


def _compare_steps(
    backend: BlockBackend, reference: BlockBackend, *, adapter: str | None = None
) -> None:
    """A prefill, then decode steps one session at a time and two at once, on both backends."""
    first = [backend.allocate_caches(10, 13, 1, 16), reference.allocate_caches(10, 13, 1, 16)]
    second = [backend.allocate_caches(11, 13, 2, 16), reference.allocate_caches(11, 13, 2, 16)]
    prompt = torch.randn(1, 4, HIDDEN)
    for owner, caches in zip((backend, reference), first, strict=True):
        owner.inference_step(10, 13, prompt, caches, adapter=adapter)
    for _ in range(3):
        x = torch.randn(1, 1, HIDDEN)
        got, expected = (
            owner.inference_step(10, 13, x, caches, adapter=adapter)
            for owner, caches in zip((backend, reference), first, strict=True)
        )
        torch.testing.assert_close(got, expected, **TOL)
        xs = [torch.randn(1, 1, HIDDEN, dtype=torch.float64), torch.randn(2, 1, HIDDEN)]
        results = [
            owner.inference_steps(
                11, 13, [(xs[0], first_caches[1:]), (xs[1], second_caches)], adapter=adapter
            )
            for owner, first_caches, second_caches in zip(
                (backend, reference), first, second, strict=True
            )
        ]
        for got, expected in zip(*results, strict=True):
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, **TOL)
    for caches, others in ((first[0], first[1]), (second[0], second[1])):
        for cache, other in zip(caches, others, strict=True):
            assert cache.length == other.length
            torch.testing.assert_close(cache.keys, other.keys, **TOL)


def test_steps_on_the_numpy_backend_equal_the_torch_path() -> None:
    _compare_steps(_backend(_blocks()), _backend(_blocks(), cpu_decode="torch"))


def test_steps_with_prompts_and_long_steps_take_the_torch_path() -> None:
    backend, reference = _backend(_blocks()), _backend(_blocks(), cpu_decode="torch")
    caches = [owner.allocate_caches(10, 13, 1, 16) for owner in (backend, reference)]
    prompts = torch.randn(3, 1, 1, HIDDEN)
    x = torch.randn(1, 3, HIDDEN)
    got, expected = (
        owner.inference_step(10, 13, x, each, prompts=prompts)
        for owner, each in zip((backend, reference), caches, strict=True)
    )
    assert torch.equal(got, expected)


def test_a_failed_step_rolls_every_cache_back() -> None:
    """The numpy backend writes block 10's cache, then block 11's refuses: both are as before."""
    backend = _backend(_blocks())
    caches = backend.allocate_caches(10, 13, 1, 8)
    backend.inference_step(10, 13, torch.randn(1, 4, HIDDEN), caches)
    caches[1] = backend.blocks[1].allocate_cache(1, 4)
    caches[1].length = 4
    with pytest.raises(ValueError, match="do not fit"):
        backend.inference_step(10, 13, torch.randn(1, 1, HIDDEN), caches)
    assert [cache.length for cache in caches] == [4, 4, 4]
    with pytest.raises(ValueError, match="do not fit"):
        backend.inference_steps(10, 13, [(torch.randn(1, 1, HIDDEN), caches)])
    assert [cache.length for cache in caches] == [4, 4, 4]


def test_the_backward_estimate_counts_the_experts_a_token_goes_through() -> None:
    """A Mixtral block's tokens each pass through 2 of its 8 experts: its activations per token
    are the attention's projections, the router and a quarter of the experts' outputs."""
    config = tiny_mixtral_config(num_hidden_layers=1)
    mixtral = _backend([MixtralBlock(config)])  # type: ignore[list-item]
    llama = _backend(_blocks(1))
    inner, kv = config.intermediate_size, config.num_key_value_heads * (HIDDEN // 4)
    attention = HIDDEN + 2 * kv + HIDDEN  # q, k, v, o
    experts = 8 * (2 * inner + HIDDEN) * 2 // 8  # w1, w3, w2 of 2 experts in 8
    per_token = attention + 8 + experts + 6 * HIDDEN  # router: one score per expert
    attention_scores = 2 * 4 * 5  # 2 x heads x keys
    assert mixtral.activation_bytes(1, 5) == 5 * (per_token + attention_scores) * 4
    # The same width and heads, one MLP of the same width: the same attention, fewer outputs.
    assert llama.activation_bytes(1, 5) < mixtral.activation_bytes(1, 5)
    assert mixtral.activation_bytes(1, 5) < 2 * llama.activation_bytes(1, 5)
