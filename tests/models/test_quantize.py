"""quantize_block: bitsandbytes layers in place of nn.Linear, with bounded error and memory.

The error bounds come from measurements on these shapes (bitsandbytes 0.50 on CPU, 5-8 seeds):

======================  =============  ============  ==========  ===========
relative error          one Linear     BloomBlock    LlamaBlock  FalconBlock
======================  =============  ============  ==========  ===========
int8                    0.004          0.011-0.015   0.014-0.016 0.009-0.010
nf4                     0.085-0.09     0.16-0.18     0.22-0.25   0.14-0.17
======================  =============  ============  ==========  ===========

and agree with what the formats promise.  int8 rounds each weight row and each input row to 255
levels of its absmax: for Gaussian rows of 64 values (absmax ~2.5 sigma) that is ~0.3% of sigma per
rounding, two roundings per product.  nf4 has 16 levels placed at normal quantiles, which leaves
~9% RMS error on Gaussian weights (QLoRA's figure).  A block chains four (BLOOM) or seven (LLaMA,
whose gate multiplies two noisy projections) such products through softmax and GELU/SiLU, which
about doubles the error.  The bounds below leave another factor of ~1.5-2 for other seeds.

MixtralBlock (its router kept unquantised): int8 0.013-0.016, nf4 0.31-0.37, with an outlier
per eight seeds (0.08, 0.43) where the attention's rounding moves a token to another expert: a
discrete change that no rounding bound covers.  Its bounds are wider.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from bitsandbytes.nn import Linear4bit, Linear8bitLt
from torch import nn

from petals_core.models._quantize import quantize_block
from petals_core.models.bloom import BloomBlock
from petals_core.models.falcon import FalconBlock
from petals_core.models.mixtral import MixtralBlock
from petals_core.testing import (
    tiny_bloom_config,
    tiny_falcon_config,
    tiny_llama_config,
    tiny_mixtral_config,
)

LINEAR_BOUND = {"int8": 0.01, "nf4": 0.13}
BLOCK_BOUND = {"int8": 0.03, "nf4": 0.35}
MIXTRAL_BLOCK_BOUND = {"int8": 0.1, "nf4": 0.5}
QUANTIZED_CLASS = {"int8": Linear8bitLt, "nf4": Linear4bit}


def randomize_(module: nn.Module, seed: int) -> None:
    """Gaussian weights of unit-variance outputs, so that attention and the MLP both matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if p.dim() == 1:
                p.copy_(
                    1 + 0.1 * noise if _is_norm(name) and name.endswith("weight") else 0.1 * noise
                )
            else:
                p.copy_(1.5 * noise / math.sqrt(p.shape[-1]))


def _is_norm(name: str) -> bool:
    return "norm" in name or name.startswith("ln_")


def bloom_block() -> nn.Module:
    return BloomBlock(tiny_bloom_config(n_layer=1))


def llama_block() -> nn.Module:
    llama = pytest.importorskip("petals_core.models.llama")
    block: nn.Module = llama.LlamaBlock(tiny_llama_config(num_hidden_layers=1, rms_norm_eps=1e-5))
    return block


def falcon_block() -> nn.Module:
    return FalconBlock(tiny_falcon_config(num_hidden_layers=1))


def mixtral_block() -> nn.Module:
    return MixtralBlock(tiny_mixtral_config(num_hidden_layers=1, rms_norm_eps=1e-5))


FAMILIES = {
    "bloom": bloom_block,
    "llama": llama_block,
    "falcon": falcon_block,
    "mixtral": mixtral_block,
}


def pair(family: str, seed: int) -> tuple[nn.Module, nn.Module]:
    """The same block twice: one to keep in float32, one to quantise."""
    make: Callable[[], nn.Module] = FAMILIES[family]
    reference, quantized = make(), make()
    randomize_(reference, seed)
    quantized.load_state_dict(reference.state_dict())
    return reference, quantized


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


def stored_bytes(module: nn.Module) -> int:
    """Everything the layers keep: weights, biases, scales, code tables."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def inputs(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, length, 64, generator=torch.Generator().manual_seed(seed))


def test_unknown_quant_type_raises() -> None:
    block = bloom_block()
    with pytest.raises(ValueError, match="unknown quant_type 'fp8'; expected one of"):
        quantize_block(block, "fp8")  # type: ignore[arg-type]
    assert type(block.self_attention.query_key_value) is nn.Linear


def test_none_leaves_the_block_alone() -> None:
    block = bloom_block()
    before = dict(block.named_modules())
    assert quantize_block(block, "none") is block
    assert dict(block.named_modules()) == before


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_a_quantized_linear_is_close(quant_type: str) -> None:
    errors = []
    for seed in range(3):
        reference, quantized = nn.Linear(64, 256), nn.Linear(64, 256)
        randomize_(reference, seed)
        quantized.load_state_dict(reference.state_dict())
        holder = quantize_block(nn.Sequential(quantized), quant_type)  # type: ignore[arg-type]
        x = inputs(2, 8, seed=seed + 100)
        with torch.no_grad():
            errors.append(relative_error(holder(x), reference(x)))
    assert max(errors) < LINEAR_BOUND[quant_type], errors


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
@pytest.mark.parametrize("family", ["bloom", "llama", "falcon", "mixtral"])
def test_block_output_error_is_bounded(family: str, quant_type: str) -> None:
    errors = []
    for seed in range(3):
        reference, block = pair(family, seed)
        keep = set(getattr(block, "keep_unquantized", ()))
        linears = {
            name
            for name, m in block.named_modules()
            if isinstance(m, nn.Linear) and name not in keep
        }
        biases = {name: m.bias for name, m in block.named_modules() if name in linears}
        assert quantize_block(block, quant_type) is block  # type: ignore[arg-type]
        replaced = {name: m for name, m in block.named_modules() if name in linears}
        assert all(type(m) is QUANTIZED_CLASS[quant_type] for m in replaced.values())
        assert all(replaced[name].bias is bias for name, bias in biases.items())
        x = inputs(2, 8, seed=seed + 100)
        with torch.no_grad():
            errors.append(relative_error(block(x), reference(x)))
    bound = (MIXTRAL_BLOCK_BOUND if family == "mixtral" else BLOCK_BOUND)[quant_type]
    assert max(errors) < bound, errors
    if family == "mixtral":
        assert type(block.block_sparse_moe.gate) is nn.Linear  # the router, kept


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_quantized_blocks_decode_with_a_cache(family: str, quant_type: str) -> None:
    reference, block = pair(family, seed=0)
    quantize_block(block, quant_type)  # type: ignore[arg-type]
    x = inputs(2, 8, seed=1)
    cache = block.allocate_cache(2, 8)  # type: ignore[operator]
    assert cache.keys.dtype == torch.float32  # from the LayerNorm, not the int8/uint8 weights
    with torch.no_grad():
        steps = [block(x[:, :5], cache=cache)]
        steps += [block(x[:, t : t + 1], cache=cache) for t in range(5, 8)]
        assert relative_error(torch.cat(steps, dim=1), reference(x)) < BLOCK_BOUND[quant_type]


def test_nf4_computes_in_the_block_dtype() -> None:
    reference, block = pair("bloom", seed=0)
    block.to(torch.bfloat16)
    quantize_block(block, "nf4")
    assert block.mlp.dense_h_to_4h.compute_dtype == torch.bfloat16
    x = inputs(2, 8, seed=1)
    with torch.no_grad():
        y = block(x.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        # bf16's own rounding (~1e-2, see test_bloom_block) adds little to nf4's
        assert relative_error(y, reference(x)) < BLOCK_BOUND["nf4"]


@pytest.mark.parametrize("quant_type", ["int8", "nf4"])
def test_gradients_flow_through_a_quantized_block(quant_type: str) -> None:
    """Prompt tuning backpropagates through frozen, quantised servers' blocks."""
    reference, block = pair("bloom", seed=0)
    quantize_block(block, quant_type)  # type: ignore[arg-type]
    cotangent = inputs(2, 8, seed=2)
    grads = []
    for module in (reference, block):
        x = inputs(2, 8, seed=1).requires_grad_(True)
        (module(x) * cotangent).sum().backward()
        grads.append(x.grad)
    assert relative_error(grads[1], grads[0]) < 2 * BLOCK_BOUND[quant_type]


@pytest.mark.parametrize(("quant_type", "bound"), [("int8", 0.26), ("nf4", 0.135)])
def test_memory_shrinks(quant_type: str, bound: float) -> None:
    # A 1024-wide layer shows the formats' own ratios: int8 is 1/4 of float32 plus a float32 scale
    # per row, nf4 1/8 plus a byte per 64 weights and ~1 KiB of code tables; float32 biases stay.
    layer = nn.Sequential(nn.Linear(1024, 1024))
    before = stored_bytes(layer)
    quantize_block(layer, quant_type)  # type: ignore[arg-type]
    assert stored_bytes(layer) < bound * before
    # At hidden 64 the per-row scales and per-layer code tables weigh more: looser bounds.
    block = bloom_block()
    before = stored_bytes(block.self_attention) + stored_bytes(block.mlp)
    quantize_block(block, quant_type)  # type: ignore[arg-type]
    after = stored_bytes(block.self_attention) + stored_bytes(block.mlp)
    assert after < {"int8": 0.28, "nf4": 0.175}[quant_type] * before


def test_quantizing_twice_raises() -> None:
    block = quantize_block(bloom_block(), "int8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_block(block, "nf4")
