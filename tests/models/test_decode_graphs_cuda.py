"""Decode graphs captured and replayed on a GPU, against the eager path on the same GPU.

Skipped without CUDA, and under Triton's interpreter (which the default test run selects for
the CPU parity tests): ``python -m bench gpu`` runs this file with compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

from petals_core.models import (
    Block,
    BloomBlock,
    DecodeGraphs,
    DecodeGraphsConfig,
    FalconBlock,
    KVCache,
    LlamaBlock,
    MixtralBlock,
)
from petals_core.models._quantize import quantize_block
from petals_core.testing import tiny_falcon_config, tiny_mixtral_config

from .._cuda import CUDA_MARKS
from ._steps import eager_steps, twin
from .conftest import tiny_bloom_config, tiny_llama_config

pytestmark = CUDA_MARKS

HIDDEN, HEADS, KV_HEADS = 512, 8, 2  # head_dim 64
SPAN = 4
#: The LLaMA and Mixtral blocks' shape: grouped-query attention, positions up to 4096.
GROUPED = dict(
    hidden_size=HIDDEN,
    intermediate_size=2 * HIDDEN,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=4096,
)


def _blocks(family: str, dtype: torch.dtype) -> list[Block]:
    torch.manual_seed(0)
    blocks: list[Block] = []
    for index in range(SPAN):
        if family == "llama":
            block: Block = LlamaBlock(tiny_llama_config(**GROUPED), index)
        elif family == "mixtral":  # 8 experts, 2 per token: in a graph, each on every row
            block = MixtralBlock(tiny_mixtral_config(**GROUPED), index)
        elif family == "falcon":  # Falcon-40B's layout: 8 heads in 2 groups, two LayerNorms
            falcon = tiny_falcon_config(
                hidden_size=HIDDEN, num_attention_heads=HEADS, num_kv_heads=KV_HEADS
            )
            block = FalconBlock(falcon, index)
        else:
            block = BloomBlock(tiny_bloom_config(hidden_size=HIDDEN, n_head=HEADS), index)
        with torch.no_grad():
            for name, param in block.named_parameters():
                noise = torch.randn(param.shape)
                norm = name.endswith("weight") and ("layernorm" in name or name.startswith("ln_"))
                param.copy_(1 + 0.2 * noise if norm else 0.05 * noise)
        blocks.append(block.to("cuda", dtype).eval().requires_grad_(False))
    return blocks


def _sessions(blocks: list[Block], specs: list[tuple[int, int, int]]) -> list[list[KVCache]]:
    sessions = []
    for batch, max_length, filled in specs:
        caches = [block.allocate_cache(batch, max_length) for block in blocks]
        # Quantised layers hold their weights in integers: the norms keep the compute dtype.
        dtype = next(p.dtype for p in blocks[0].parameters() if p.is_floating_point())
        x = torch.randn(batch, filled, HIDDEN, device="cuda", dtype=dtype)
        with torch.inference_mode():
            for block, cache in zip(blocks, caches, strict=True):
                x = block(x, cache=cache)
        sessions.append(caches)
    return sessions


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same kernels and products, but other GEMM shapes (padded rows): a few roundings."""
    scale = expected.float().abs().max().item()
    assert (actual.float() - expected.float()).abs().max().item() <= 0.02 * scale


def test_fp32_spans_step_eagerly() -> None:
    """The row kernels take fp16 and bf16 on GPUs (fp32 is a parity mode there)."""
    blocks = _blocks("llama", torch.float32)
    assert "fp16 and bf16" in (DecodeGraphs.unsupported_reason(blocks) or "")
    with pytest.raises(ValueError, match="fp16 and bf16"):
        DecodeGraphs(blocks)


@pytest.mark.parametrize("family", ["llama", "bloom", "falcon", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_replays_equal_the_eager_path(family: str, dtype: torch.dtype) -> None:
    blocks = _blocks(family, dtype)
    specs = [(1, 600, 100), (2, 300, 7), (1, 2048, 1500)]
    eager = _sessions(blocks, specs)
    graphed = twin(eager)
    graphs = DecodeGraphs(blocks, config=DecodeGraphsConfig())
    assert graphs.capture
    for _ in range(6):
        xs = [torch.randn(b, 1, HIDDEN, device="cuda", dtype=dtype) for b, _, _ in specs]
        expected = eager_steps(blocks, xs, eager)
        actual = graphs.step(0, SPAN, xs, graphed)
        assert actual is not None, graphs.disabled_reason
        for got, want in zip(actual, expected, strict=True):
            _close(got, want)
    statistics = graphs.statistics()
    assert statistics.replays == 6 and statistics.failures == 0
    assert statistics.captured == 1  # 4 rows, length bucket 2048: one graph for every step


def test_a_graph_serves_new_sessions() -> None:
    """Sessions end and others start with caches elsewhere: the graph reads the new tables."""
    blocks = _blocks("llama", torch.bfloat16)
    graphs = DecodeGraphs(blocks)
    for round_ in range(3):
        eager = _sessions(blocks, [(1, 512, 10 + round_), (1, 256, 3)])
        graphed = twin(eager)
        xs = [torch.randn(1, 1, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        expected = eager_steps(blocks, xs, eager)
        actual = graphs.step(0, SPAN, xs, graphed)
        assert actual is not None
        for got, want in zip(actual, expected, strict=True):
            _close(got, want)
        del eager, graphed
        torch.cuda.empty_cache()
    assert graphs.statistics().captured == 1


@pytest.mark.parametrize("quant_type", ["nf4", "int8"])
def test_quantised_spans(quant_type: str) -> None:
    """nf4 layers are captured; int8 ones are refused up front and steps stay eager."""
    pytest.importorskip("bitsandbytes")
    blocks = _blocks("llama", torch.bfloat16)
    for block in blocks:
        quantize_block(block, quant_type)  # type: ignore[arg-type]
    if quant_type == "int8":
        with pytest.raises(ValueError, match="int8"):
            DecodeGraphs(blocks)
        return
    eager = _sessions(blocks, [(2, 256, 30)])
    graphed = twin(eager)
    graphs = DecodeGraphs(blocks)
    for _ in range(3):
        xs = [torch.randn(2, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)]
        expected = eager_steps(blocks, xs, eager)
        actual = graphs.step(0, SPAN, xs, graphed)
        if actual is None:  # this bitsandbytes cannot be captured: the eager path is used
            assert graphs.disabled_reason is not None
            return
        _close(actual[0], expected[0])


def test_graphs_captured_at_load_serve_the_steps() -> None:
    """What a server captures at load: every rows bucket at every length bucket up to its longest
    session; steps of any of those sizes then replay without capturing, equal to the eager path."""
    blocks = _blocks("llama", torch.bfloat16)
    config = DecodeGraphsConfig(max_rows=8, ahead_max_length=1024)
    graphs = DecodeGraphs(blocks, config=config)
    assert graphs.warm_up()
    assert graphs.capture_ahead() == 4 * 3  # rows 1, 2, 4, 8 at lengths 256, 512, 1024
    assert graphs.statistics().pool_bytes < config.ahead_pool_bytes
    for specs in ([(1, 1024, 3)], [(2, 600, 300), (1, 1024, 1000)], [(8, 300, 200)]):
        eager = _sessions(blocks, specs)
        graphed = twin(eager)
        xs = [torch.randn(b, 1, HIDDEN, device="cuda", dtype=torch.bfloat16) for b, _, _ in specs]
        expected = eager_steps(blocks, xs, eager)
        actual = graphs.step(0, SPAN, xs, graphed)
        assert actual is not None, graphs.disabled_reason
        for got, want in zip(actual, expected, strict=True):
            _close(got, want)
    assert graphs.statistics().captured == 12
