"""Weight-only quantisation of a block's linear layers with bitsandbytes, done in place.

int8 is LLM.int8(): per-output-row absmax scales, with input columns holding an outlier above 6.0
computed in 16 bits.  nf4 is QLoRA's 4-bit NormalFloat, per-64-weight absmax scales, themselves
quantised ("double quantisation").  Everything else in the block (LayerNorms, embeddings, ALiBi
slopes) keeps its dtype, and so do the linears a block class names in ``keep_unquantized``
(Mixtral's router: a few weights whose rounding would move tokens to other experts).

bitsandbytes is imported only when a block is quantised, so clients and CPU-only tools never pay
for it.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from .._extras import require

__all__ = ["QuantType", "quantize_block", "quantized_linears"]

QuantType = Literal["none", "int8", "nf4"]

INT8_OUTLIER_THRESHOLD = 6.0  # LLM.int8()'s default, the one the paper's accuracy results use


def quantized_linears(block: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute name, layer) of each linear :func:`quantize_block` replaces: every
    ``nn.Linear`` but those whose path is in the block's ``keep_unquantized``."""
    keep = frozenset(getattr(block, "keep_unquantized", ()))
    return [
        (parent, name, child)
        for path, parent in block.named_modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear) and (f"{path}.{name}" if path else name) not in keep
    ]


def quantize_block(block: nn.Module, quant_type: QuantType) -> nn.Module:
    """Replace the ``nn.Linear`` layers of ``block`` (see :func:`quantized_linears`) by
    bitsandbytes layers with the same weights.

    Weights are quantised on the device they are on; biases are kept, unquantised.  nf4 layers
    compute in the dtype of the weights they replace.  Returns ``block``, modified in place.
    """
    if quant_type not in get_args(QuantType):
        raise ValueError(
            f"unknown quant_type {quant_type!r}; expected one of {get_args(QuantType)}"
        )
    if quant_type == "none":
        return block

    require("quant", "int8 and nf4 quantisation")
    from bitsandbytes.nn import Linear4bit, Linear8bitLt

    targets = quantized_linears(block)
    if any(isinstance(child, (Linear8bitLt, Linear4bit)) for _, _, child in targets):
        raise ValueError("the block is already quantised")
    convert = _to_int8 if quant_type == "int8" else _to_nf4
    for parent, name, linear in targets:
        setattr(parent, name, convert(linear).train(linear.training))
    return block


def _to_int8(linear: nn.Linear) -> nn.Module:
    from bitsandbytes.nn import Int8Params, Linear8bitLt

    # Built on "meta" so no throw-away random weights are allocated and initialised.
    quantized = Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=INT8_OUTLIER_THRESHOLD,
        device="meta",
    )
    device = linear.weight.device
    # Int8Params quantises on the first ``.to(device)`` only from a CPU tensor, so it starts there
    # (a no-op for CPU weights) and quantises on arrival at ``device``.
    weight = Int8Params(linear.weight.data.cpu(), requires_grad=False, has_fp16_weights=False)
    # bitsandbytes types ``to`` with an unbound self TypeVar that mypy rejects.
    quantized.weight = weight.to(device)  # type: ignore[misc]  # (out, in) int8, scales in .SCB
    quantized.bias = linear.bias
    return quantized


def _to_nf4(linear: nn.Linear) -> nn.Module:
    from bitsandbytes.nn import Linear4bit, Params4bit

    quantized = Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=linear.weight.dtype,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
        device="meta",
    )
    weight = Params4bit(
        linear.weight.data,
        requires_grad=False,
        compress_statistics=True,
        quant_type="nf4",
        quant_storage=torch.uint8,
        module=quantized,
    )
    # Params4bit quantises on its first ``.to(device)``, from any device; ignore as for int8.
    quantized.weight = weight.to(linear.weight.device)  # type: ignore[misc]  # (out*in/2, 1) uint8
    quantized.bias = linear.bias
    return quantized
