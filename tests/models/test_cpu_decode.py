"""The CPU decode backend (``CpuDecode``): numpy steps against the blocks' torch path.

Each test runs the same sessions twice, on twin caches: once through :class:`CpuDecode` and once
through :class:`EagerSteps` (the blocks' ``forward_many``), and compares the outputs (fp32
tolerance: numpy sums products in another order) and the caches afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from petals_core.models import (
    BloomBlock,
    CpuDecode,
    EagerSteps,
    KVCache,
    LlamaBlock,
    LoraAdapter,
    SpanSteps,
    add_adapter,
    quantize_block,
    using_adapter,
)
from petals_core.models._cpu_decode import MAX_ROWS
from petals_core.testing import tiny_bloom_config, tiny_llama_config

from ._steps import twin
from .conftest import HIDDEN

Block = LlamaBlock | BloomBlock

CONFIGS: dict[str, Callable[[int], Block]] = {
    "llama-gqa": lambda index: LlamaBlock(
        tiny_llama_config(intermediate_size=96, rms_norm_eps=1e-5), index
    ),
    "llama-mha-biases": lambda index: LlamaBlock(
        tiny_llama_config(
            intermediate_size=80, num_key_value_heads=4, attention_bias=True, mlp_bias=True
        ),
        index,
    ),
    "llama-dynamic-rope": lambda index: LlamaBlock(
        tiny_llama_config(
            intermediate_size=96,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=6,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
        index,
    ),
    "bloom": lambda index: BloomBlock(tiny_bloom_config(), index),
    "bloom-residual-after-norm": lambda index: BloomBlock(
        tiny_bloom_config(n_head=8, apply_residual_connection_post_layernorm=True), index
    ),
}
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}


def _blocks(name: str, count: int = 1) -> list[Block]:
    torch.manual_seed(sum(map(ord, name)))
    blocks = [CONFIGS[name](index).eval() for index in range(count)]
    with torch.no_grad():
        for block in blocks:
            for parameter in block.parameters():
                parameter.normal_(0.0, 0.2)
    return blocks


def _sessions(blocks: list[Block], specs: list[tuple[int, int]], **kw: int) -> list[list[KVCache]]:
    """One session per ``(rows, filled positions)``: a cache per block, filled eagerly."""
    max_length = kw.get("max_length", 32)
    sessions = []
    eager = EagerSteps(blocks)
    for batch, length in specs:
        caches = [block.allocate_cache(batch, max_length) for block in blocks]
        with torch.inference_mode():
            eager.step(0, len(blocks), [torch.randn(batch, length, HIDDEN)], [caches])
        sessions.append(caches)
    return sessions


def _assert_same_caches(a: list[list[KVCache]], b: list[list[KVCache]]) -> None:
    for caches, others in zip(a, b, strict=True):
        for cache, other in zip(caches, others, strict=True):
            assert cache.length == other.length
            torch.testing.assert_close(cache.keys, other.keys, **TOL)
            torch.testing.assert_close(cache.values, other.values, **TOL)


def _step_both(
    backend: CpuDecode, xs: list[torch.Tensor], sessions: list[list[KVCache]], **span: int
) -> tuple[list[torch.Tensor] | None, list[list[KVCache]]]:
    """``backend``'s step of ``xs`` on ``sessions``, compared with the eager step on twins of
    them when it is taken; returns its result and the twins."""
    start, end = span.get("start", 0), span.get("end", len(backend.blocks))
    reference = twin([caches[start:end] for caches in sessions])
    with torch.inference_mode():
        got = backend.step(start, end, xs, [caches[start:end] for caches in sessions])
        if got is not None:
            expected = EagerSteps(backend.blocks).step(start, end, xs, reference)
            for g, e in zip(got, expected, strict=True):
                assert g.shape == e.shape
                torch.testing.assert_close(g, e, **TOL)
            _assert_same_caches([caches[start:end] for caches in sessions], reference)
    return got, reference


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("batch", "lengths"), [(1, [1, 1, 2, 1, 1]), (2, [1, 1, 1])])
def test_steps_match_the_torch_path(name: str, batch: int, lengths: list[int]) -> None:
    assert batch * max(lengths) <= MAX_ROWS  # every step is decode-sized
    blocks = _blocks(name)
    backend = CpuDecode(blocks)
    assert backend.numpy_blocks == 1
    # The dynamic-rope config rescales past 6 positions: the steps cross that line.
    (session,) = _sessions(blocks, [(batch, 4)])
    for new in lengths:
        got, _ = _step_both(backend, [torch.randn(batch, new, HIDDEN)], [session])
        assert got is not None


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sessions_of_a_span_match_the_torch_path(name: str) -> None:
    """Two sessions of one row each, at different lengths, through three blocks and through a
    sub-span of them."""
    blocks = _blocks(name, 3)
    backend = CpuDecode(blocks)
    sessions = _sessions(blocks, [(1, 3), (1, 6)])
    for span in ({}, {"start": 1, "end": 3}, {"start": 0, "end": 1}):
        xs = [torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)]
        got, _ = _step_both(backend, xs, sessions, **span)
        assert got is not None
    assert [cache.length for cache in sessions[0]] == [5, 5, 5]


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_blocks_it_cannot_take_run_their_torch_path_inside_the_step(name: str) -> None:
    """A span whose middle block has a layer that is not the library's own, and whose last one
    holds a LoRA adapter: the other block computes with numpy, the step still matches."""
    blocks = _blocks(name, 3)
    parent = blocks[1].self_attn if isinstance(blocks[1], LlamaBlock) else blocks[1].self_attention
    attribute = "o_proj" if isinstance(blocks[1], LlamaBlock) else "dense"
    own = getattr(parent, attribute)

    class Foreign(nn.Linear):
        pass

    foreign = Foreign(own.in_features, own.out_features, bias=own.bias is not None)
    foreign.load_state_dict(own.state_dict())
    setattr(parent, attribute, foreign)
    path = "self_attn.q_proj" if name.startswith("llama") else "self_attention.query_key_value"
    target = blocks[2].get_submodule(path)
    assert isinstance(target, nn.Linear)
    generator = torch.Generator().manual_seed(7)
    adapter = LoraAdapter(
        name="tuned",
        rank=2,
        scaling=0.5,
        target_modules=frozenset({path}),
        weights={
            2: {
                path: (
                    torch.randn(2, target.in_features, generator=generator),
                    torch.randn(target.out_features, 2, generator=generator),
                )
            }
        },
    )
    add_adapter(blocks[2], adapter, 2)
    backend = CpuDecode(blocks)
    assert backend.numpy_blocks == 1
    sessions = _sessions(blocks, [(1, 3)])
    with using_adapter("tuned"):
        got, _ = _step_both(backend, [torch.randn(1, 1, HIDDEN)], sessions)
    assert got is not None


def _unchanged_when_declined(
    backend: CpuDecode, xs: list[torch.Tensor], sessions: list[list[KVCache]]
) -> None:
    before = twin(sessions)
    got, _ = _step_both(backend, xs, sessions)
    assert got is None
    for caches, saved in zip(sessions, before, strict=True):
        for cache, copy in zip(caches, saved, strict=True):
            assert cache.length == copy.length
            assert torch.equal(cache.keys, copy.keys) and torch.equal(cache.values, copy.values)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_it_declines_what_is_not_a_decode_step_and_changes_nothing(name: str) -> None:
    blocks = _blocks(name, 2)
    backend = CpuDecode(blocks)
    sessions = _sessions(blocks, [(1, 4)])
    _unchanged_when_declined(backend, [torch.randn(1, MAX_ROWS + 1, HIDDEN)], sessions)
    wide = _sessions(blocks, [(MAX_ROWS + 1, 4)])
    _unchanged_when_declined(backend, [torch.randn(MAX_ROWS + 1, 1, HIDDEN)], wide)
    _unchanged_when_declined(backend, [torch.randn(1, 1, HIDDEN, dtype=torch.float64)], sessions)
    padded = _sessions(blocks, [(2, 4)])
    for cache in padded[0]:
        cache.set_padding(torch.tensor([0, 2]))
    _unchanged_when_declined(backend, [torch.randn(2, 1, HIDDEN)], padded)
    _unchanged_when_declined(backend, [], [])
    with torch.inference_mode():
        assert backend.step(0, 3, [torch.randn(1, 1, HIDDEN)], sessions) is None  # past the end
        assert backend.step(0, 2, [torch.randn(1, 1, HIDDEN)], [sessions[0][:1]]) is None


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_a_full_cache_is_refused_before_it_is_written(name: str) -> None:
    (block,) = _blocks(name)
    backend = CpuDecode([block])
    (session,) = _sessions([block], [(1, 4)], max_length=4)
    keys = session[0].keys.clone()
    with torch.inference_mode(), pytest.raises(ValueError, match="do not fit"):
        backend.step(0, 1, [torch.randn(1, 1, HIDDEN)], [session])
    assert session[0].length == 4
    assert torch.equal(session[0].keys, keys)


def test_a_cache_of_another_layout_is_refused() -> None:
    (block,) = _blocks("llama-gqa")
    backend = CpuDecode([block])
    wrong = KVCache.allocate(batch=1, kv_heads=4, max_length=8, head_dim=16, dtype=torch.float32)
    with torch.inference_mode(), pytest.raises(ValueError, match="allocate it with"):
        backend.step(0, 1, [torch.randn(1, 1, HIDDEN)], [[wrong]])
    assert wrong.length == 0


def test_inputs_that_require_grad_step_without_a_graph() -> None:
    (block,) = _blocks("llama-gqa")
    backend = CpuDecode([block])
    (session,) = _sessions([block], [(1, 3)])
    reference = twin([session])
    x = torch.randn(1, 1, HIDDEN, requires_grad=True)
    got = backend.step(0, 1, [x], [session])
    assert got is not None
    assert not got[0].requires_grad
    (expected,) = EagerSteps([block]).step(0, 1, [x], reference)
    torch.testing.assert_close(got[0], expected, **TOL)


@pytest.mark.parametrize("name", ["llama-gqa", "bloom"])
def test_steps_past_the_first_tables_match_the_torch_path(name: str) -> None:
    """Rotary angles and ALiBi terms come from tables that start at 256 positions and grow."""
    blocks = _blocks(name)
    backend = CpuDecode(blocks)
    short = _sessions(blocks, [(1, 5)])
    long = _sessions(blocks, [(1, 300)], max_length=600)
    for sessions in (short, long, short):  # a short session first: the smallest tables
        got, _ = _step_both(backend, [torch.randn(1, 1, HIDDEN)], sessions)
        assert got is not None


def test_weights_are_views_taken_once() -> None:
    """A change in place (``load_state_dict`` copies into the parameters) is seen."""
    (block,) = _blocks("llama-gqa")
    backend = CpuDecode([block])
    block.load_state_dict({name: 2 * value for name, value in block.state_dict().items()})
    (session,) = _sessions([block], [(1, 3)])
    got, _ = _step_both(backend, [torch.randn(1, 1, HIDDEN)], [session])
    assert got is not None


def test_blocks_it_cannot_take_at_all_are_refused() -> None:
    (block,) = _blocks("llama-gqa")
    doubles = _blocks("bloom")[0].to(torch.float64)
    assert CpuDecode.unsupported_reason([doubles]) == (
        "block 0: its weights are not float32 on the CPU"
    )
    with pytest.raises(ValueError, match="not float32 on the CPU"):
        CpuDecode([doubles])
    assert CpuDecode.unsupported_reason([]) == "no blocks"
    assert CpuDecode.unsupported_reason([block, doubles]) is None  # one of them can
    gelu = LlamaBlock(tiny_llama_config(hidden_act="gelu"))
    assert CpuDecode.unsupported_reason([gelu]) == "block 0: its MLP's activation is not SiLU"
    assert "not a LlamaBlock or BloomBlock" in str(CpuDecode.unsupported_reason([nn.Linear(2, 2)]))


def test_quantised_blocks_are_refused() -> None:
    pytest.importorskip("bitsandbytes")
    (block,) = _blocks("bloom")
    quantize_block(block, "int8")
    reason = CpuDecode.unsupported_reason([block])
    assert reason is not None and reason.startswith("block 0: its ")


def test_every_backend_fits_the_interface() -> None:
    blocks = _blocks("llama-gqa")
    backends: list[SpanSteps] = [CpuDecode(blocks), EagerSteps(blocks)]
    session = _sessions(blocks, [(1, 2)])
    outputs = []
    for backend, sessions in zip(backends, [session, twin(session)], strict=True):
        with torch.inference_mode():
            got = backend.step(0, 1, [torch.ones(1, 1, HIDDEN)], sessions)
        assert got is not None
        outputs.append(got[0])
    torch.testing.assert_close(outputs[0], outputs[1], **TOL)
