"""int8 and nf4 blocks on a GPU against the same blocks unquantised in bf16 on that GPU.

The bounds are the CPU tests' (``test_quantize.py``): bitsandbytes' CUDA kernels quantise with
the same formats, and bf16's own rounding (about 1e-2 relative on a block) adds little to them.
Skipped without CUDA and under Triton's interpreter; ``python -m bench gpu`` runs this file.
"""

from __future__ import annotations

import pytest
import torch

from petals_core.models._quantize import quantize_block

from .._cuda import CUDA_MARKS
from .test_quantize import (
    BLOCK_BOUND,
    LINEAR_BOUND,
    MIXTRAL_BLOCK_BOUND,
    QUANTIZED_CLASS,
    inputs,
    pair,
    relative_error,
)

pytestmark = CUDA_MARKS

QUANT_TYPES = ["int8", "nf4"]


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_a_quantised_linear_on_the_gpu_is_close(quant_type: str) -> None:
    errors = []
    for seed in range(3):
        reference, block = pair("bloom", seed)
        reference.to("cuda", torch.bfloat16)
        block.to("cuda", torch.bfloat16)
        quantize_block(block, quant_type)  # type: ignore[arg-type]
        layer = block.mlp.dense_h_to_4h
        assert type(layer) is QUANTIZED_CLASS[quant_type]
        x = inputs(2, 8, seed=seed + 100).to("cuda", torch.bfloat16)
        with torch.no_grad():
            errors.append(relative_error(layer(x), reference.mlp.dense_h_to_4h(x)))
    assert max(errors) < LINEAR_BOUND[quant_type], errors


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("family", ["bloom", "llama", "falcon"])
def test_quantised_blocks_on_the_gpu_are_close_to_bf16(family: str, quant_type: str) -> None:
    errors = []
    for seed in range(3):
        reference, block = pair(family, seed)
        reference.to("cuda", torch.bfloat16)
        block.to("cuda", torch.bfloat16)
        quantize_block(block, quant_type)  # type: ignore[arg-type]
        x = inputs(2, 8, seed=seed + 100).to("cuda", torch.bfloat16)
        with torch.no_grad():
            errors.append(relative_error(block(x), reference(x)))
    assert max(errors) < BLOCK_BOUND[quant_type], errors


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
@pytest.mark.parametrize("family", ["bloom", "llama", "falcon", "mixtral"])
def test_quantised_blocks_decode_on_the_gpu(family: str, quant_type: str) -> None:
    """Prefill then one token at a time through the cache, as a server runs them."""
    reference, block = pair(family, seed=0)
    reference.to("cuda", torch.bfloat16)
    block.to("cuda", torch.bfloat16)
    quantize_block(block, quant_type)  # type: ignore[arg-type]
    x = inputs(2, 8, seed=1).to("cuda", torch.bfloat16)
    cache = block.allocate_cache(2, 8)  # type: ignore[operator]
    assert cache.keys.dtype == torch.bfloat16 and cache.keys.is_cuda
    with torch.inference_mode():
        steps = [block(x[:, :5], cache=cache)]
        steps += [block(x[:, t : t + 1], cache=cache) for t in range(5, 8)]
        expected = reference(x)
    bound = (MIXTRAL_BLOCK_BOUND if family == "mixtral" else BLOCK_BOUND)[quant_type]
    assert relative_error(torch.cat(steps, dim=1), expected) < bound


@pytest.mark.parametrize("quant_type", QUANT_TYPES)
def test_gradients_flow_through_quantised_blocks_on_the_gpu(quant_type: str) -> None:
    reference, block = pair("llama", seed=0)
    reference.to("cuda", torch.bfloat16)
    block.to("cuda", torch.bfloat16)
    quantize_block(block, quant_type)  # type: ignore[arg-type]
    cotangent = inputs(2, 8, seed=2).to("cuda", torch.bfloat16)
    grads = []
    for module in (reference, block):
        x = inputs(2, 8, seed=1).to("cuda", torch.bfloat16).requires_grad_(True)
        (module(x).float() * cotangent.float()).sum().backward()
        grads.append(x.grad)
    assert relative_error(grads[1], grads[0]) < 2 * BLOCK_BOUND[quant_type]
