"""Decode steps computed with numpy (``models._cpu_decode``) against the blocks' torch path."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from transformers import BloomConfig, LlamaConfig

from petals_core import kernels
from petals_core.models import BloomBlock, LlamaBlock
from petals_core.models._cache import KVCache
from petals_core.models._cpu_decode import MAX_ROWS

Block = LlamaBlock | BloomBlock

CONFIGS: dict[str, Callable[[], Block]] = {
    "llama-gqa": lambda: LlamaBlock(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
        ),
        1,
    ),
    "llama-mha-biases": lambda: LlamaBlock(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=80,
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_bias=True,
            mlp_bias=True,
        ),
        0,
    ),
    "llama-dynamic-rope": lambda: LlamaBlock(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=6,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
        0,
    ),
    "bloom": lambda: BloomBlock(BloomConfig(hidden_size=64, n_head=4), 2),
    "bloom-residual-after-norm": lambda: BloomBlock(
        BloomConfig(hidden_size=64, n_head=8, apply_residual_connection_post_layernorm=True), 0
    ),
}


def _block(name: str) -> Block:
    torch.manual_seed(sum(map(ord, name)))
    block = CONFIGS[name]().eval()
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.2)
    return block


@pytest.fixture(autouse=True)
def _switch_restored() -> Iterator[None]:
    kernels.set_cpu_blas(True)
    yield
    kernels.set_cpu_blas(True)


@pytest.fixture
def numpy_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each block step since was computed with numpy (the real method, watched)."""
    taken: list[bool] = []
    for cls in (LlamaBlock, BloomBlock):
        original = cls._numpy_step

        def watched(self: Any, *args: Any, _original: Any = original) -> Any:
            result = _original(self, *args)
            taken.append(result is not None)
            return result

        monkeypatch.setattr(cls, "_numpy_step", watched)
    return taken


def _torch_path(step: Callable[[], torch.Tensor]) -> torch.Tensor:
    kernels.set_cpu_blas(False)
    try:
        return step()
    finally:
        kernels.set_cpu_blas(True)


def _prefilled(block: Block, batch: int, tokens: int, max_length: int = 32) -> list[KVCache]:
    """Two caches holding the same ``tokens`` positions."""
    prompt = torch.randn(batch, tokens, 64, dtype=next(block.parameters()).dtype)
    caches = [block.allocate_cache(batch, max_length) for _ in range(2)]
    for cache in caches:
        _torch_path(lambda cache=cache: block(prompt, cache=cache))
    return caches


def _assert_caches_equal(a: KVCache, b: KVCache) -> None:
    assert a.length == b.length
    torch.testing.assert_close(a.keys[:, :, : a.length], b.keys[:, :, : b.length])
    torch.testing.assert_close(a.values[:, :, : a.length], b.values[:, :, : b.length])


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("batch", "lengths"), [(1, [1, 1, 2, 1, 1]), (2, [1, 1, 1])])
def test_steps_match_the_torch_path(
    name: str, batch: int, lengths: list[int], numpy_steps: list[bool]
) -> None:
    assert batch * max(lengths) <= MAX_ROWS  # every step is decode-sized
    block = _block(name)
    # The dynamic-rope config rescales past 6 positions: the steps cross that line.
    reference, cache = _prefilled(block, batch, 4)
    for new in lengths:
        got, expected = _step_both(
            block, torch.randn(batch, new, 64), reference, cache, numpy_steps
        )
        assert numpy_steps == [True]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        _assert_caches_equal(cache, reference)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_sessions_match_the_torch_path(name: str, numpy_steps: list[bool]) -> None:
    """forward_many with two sessions of one row each, at different lengths."""
    block = _block(name)
    first, first_reference = _prefilled(block, 1, 3)
    second, second_reference = _prefilled(block, 1, 6)
    with torch.inference_mode():
        for _ in range(3):
            xs = [torch.randn(1, 1, 64), torch.randn(1, 1, 64)]
            expected = _torch_path(
                lambda xs=xs: block.forward_many(xs, [first_reference, second_reference])
            )
            numpy_steps.clear()
            got = block.forward_many(xs, [first, second])
            assert numpy_steps == [True]
            for g, e in zip(got, expected, strict=True):
                assert g.shape == e.shape
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    _assert_caches_equal(first, first_reference)
    _assert_caches_equal(second, second_reference)


def _step_both(
    block: Block, x: torch.Tensor, reference: KVCache, cache: KVCache, numpy_steps: list[bool]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``block``'s step of ``x`` through the torch path (on ``reference``) and as it comes (on
    ``cache``), in inference mode; ``numpy_steps`` then holds the latter's path only."""
    with torch.inference_mode():
        expected = _torch_path(lambda: block(x, cache=reference))
        numpy_steps.clear()
        got = block(x, cache=cache)
    return got, expected


def _one_step_path(block: Block, x: torch.Tensor, numpy_steps: list[bool]) -> bool:
    """Whether ``block``'s step of ``x`` ran with numpy; checks its result against the torch
    path's either way."""
    reference, cache = _prefilled(block, x.shape[0], 3)
    got, expected = _step_both(block, x, reference, cache, numpy_steps)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_caches_equal(cache, reference)
    return numpy_steps == [True]


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_more_rows_than_a_decode_step_take_the_torch_path(
    name: str, numpy_steps: list[bool]
) -> None:
    block = _block(name)
    assert not _one_step_path(block, torch.randn(1, MAX_ROWS + 1, 64), numpy_steps)
    assert not _one_step_path(block, torch.randn(MAX_ROWS + 1, 1, 64), numpy_steps)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_switched_off_takes_the_torch_path(name: str, numpy_steps: list[bool]) -> None:
    block = _block(name)
    reference, cache = _prefilled(block, 1, 3)
    x = torch.randn(1, 1, 64)
    numpy_steps.clear()
    with torch.inference_mode():
        kernels.set_cpu_blas(False)
        got = block(x, cache=cache)
        expected = block(x, cache=reference)
    assert numpy_steps == [False, False]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_hooked_layers_take_the_torch_path_and_their_hooks_run(
    name: str, numpy_steps: list[bool]
) -> None:
    block = _block(name)
    layer = next(module for module in block.modules() if isinstance(module, nn.Linear))
    reference, cache = _prefilled(block, 1, 3)
    x = torch.randn(1, 1, 64)
    calls: list[str] = []
    handle = layer.register_forward_hook(lambda *_: calls.append("hook"))
    try:
        with torch.inference_mode():
            expected = _torch_path(lambda: block(x, cache=reference))
            calls.clear()
            numpy_steps.clear()
            got = block(x, cache=cache)
    finally:
        handle.remove()
    assert numpy_steps == [False]
    assert calls == ["hook"]
    assert torch.equal(got, expected)
    assert _one_step_path(block, torch.randn(1, 1, 64), numpy_steps)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_a_global_module_hook_keeps_the_torch_path(name: str, numpy_steps: list[bool]) -> None:
    block = _block(name)
    seen: list[type] = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, _: seen.append(type(module))
    )
    try:
        assert not _one_step_path(block, torch.randn(1, 1, 64), numpy_steps)
    finally:
        handle.remove()
    assert seen


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_replaced_layers_take_the_torch_path(name: str, numpy_steps: list[bool]) -> None:
    """A layer that is not the library's own (as adapters and quantisation wrap them)."""
    block = _block(name)
    parent = block.self_attn if isinstance(block, LlamaBlock) else block.self_attention
    attribute = "o_proj" if isinstance(block, LlamaBlock) else "dense"
    own = getattr(parent, attribute)
    foreign = nn.Linear(own.in_features, own.out_features, bias=own.bias is not None)
    foreign.load_state_dict(own.state_dict())
    setattr(parent, attribute, foreign)
    assert not _one_step_path(block, torch.randn(1, 1, 64), numpy_steps)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_other_dtypes_and_padding_take_the_torch_path(name: str, numpy_steps: list[bool]) -> None:
    block = _block(name).to(torch.float64)
    assert not _one_step_path(block, torch.randn(1, 1, 64, dtype=torch.float64), numpy_steps)
    block = _block(name)
    reference, cache = _prefilled(block, 2, 4)
    for each in (reference, cache):
        each.set_padding(torch.tensor([0, 2]))
    got, expected = _step_both(block, torch.randn(2, 1, 64), reference, cache, numpy_steps)
    assert numpy_steps == [False]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_a_full_cache_is_refused_before_anything_is_written(
    name: str, numpy_steps: list[bool]
) -> None:
    block = _block(name)
    cache = block.allocate_cache(1, 4)
    with torch.inference_mode():
        block(torch.randn(1, 4, 64), cache=cache)
        keys = cache.keys.clone()
        with pytest.raises(ValueError, match="do not fit"):
            block(torch.randn(1, 1, 64), cache=cache)
    assert cache.length == 4
    assert torch.equal(cache.keys, keys)
    assert numpy_steps[-1] is False


def test_inputs_that_require_grad_step_without_a_graph(numpy_steps: list[bool]) -> None:
    block = _block("llama-gqa")
    reference, cache = _prefilled(block, 1, 3)
    x = torch.randn(1, 1, 64, requires_grad=True)
    expected = _torch_path(lambda: block(x, cache=reference))
    numpy_steps.clear()
    got = block(x, cache=cache)
    assert numpy_steps == [True]
    assert not got.requires_grad
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_rotary_angle_tables_hold_the_angles_of_every_position() -> None:
    """The numpy step's angles, read from a table that grows, equal the rotary's own."""
    block = _block("llama-gqa")
    rotary = block.rotary
    with torch.inference_mode():
        for position, length in [(0, 1), (5, 2), (255, 2), (700, 1), (3, 1)]:
            cos, sin = rotary.numpy_angles(position, length)
            expected_cos, expected_sin = rotary(
                position, length, device=torch.device("cpu"), dtype=torch.float32
            )
            assert cos.shape == sin.shape == (1, 1, length, rotary.inv_freq.shape[0] * 2)
            torch.testing.assert_close(torch.from_numpy(cos[0]), expected_cos)
            torch.testing.assert_close(torch.from_numpy(sin[0]), expected_sin)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_steps_past_the_first_position_tables_match_the_torch_path(
    name: str, numpy_steps: list[bool]
) -> None:
    """Rotary angles and ALiBi terms come from tables that start at 256 positions and grow."""
    block = _block(name)
    sessions = [_prefilled(block, 1, 5), _prefilled(block, 1, 300, max_length=600)]
    for reference, cache in sessions:  # a short session first: the smallest tables
        got, expected = _step_both(block, torch.randn(1, 1, 64), reference, cache, numpy_steps)
        assert numpy_steps == [True]
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        _assert_caches_equal(cache, reference)
