"""Triton RMSNorm forward, with :func:`rms_norm_reference`'s rounding: the sum of squares in fp32,
the normalized row rounded to x's dtype, then multiplied by the weight and rounded once more."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launch, launcher

__all__ = ["plan_rms_norm", "rms_norm"]

# Rows up to this many elements are held in registers and read once; longer ones are read twice.
MAX_BLOCK = 8192


@triton.jit
def _scale_and_store(X, W, Out, cols, mask, rstd):
    x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    weight = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + cols, (normed * weight).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    # pointers
    X,
    W,
    Out,
    # sizes
    n_cols,
    eps,
    # strides
    stride_x,
    stride_out,
    # meta
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """One program per row."""
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Out += row * stride_out
    cols = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = cols < n_cols
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
        _scale_and_store(X, W, Out, cols, mask, rstd)  # the row is still in cache
    else:
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(X + start + cols, mask=mask, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.math.rsqrt(tl.sum(squares, 0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            _scale_and_store(X, W, Out, start + cols, start + cols < n_cols, rstd)


def plan_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, block: int | None = None
) -> tuple[torch.Tensor, list[Launch]]:
    """x: (..., hidden), the last dimension contiguous; weight: (hidden,).

    The output, x's shape in ``promote_types(x.dtype, weight.dtype)`` as the reference's
    (allocated, not yet written), and the launch that writes it (:func:`rms_norm` runs it).
    ``block`` (elements a step, a power of two) defaults to the whole row up to 8192.
    """
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), f"weight must be ({hidden},), got {tuple(weight.shape)}"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported {x.dtype}"
    assert weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert x.stride(-1) == 1 and weight.is_contiguous(), "the hidden dimension must be contiguous"
    assert x.device == weight.device, "x and weight must be on one device"
    rows = x.reshape(-1, hidden)  # a view unless the leading dimensions cannot be merged
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if out.numel() == 0:
        return out.view(x.shape), []
    block = block or min(triton.next_power_of_2(hidden), MAX_BLOCK)
    launch = Launch(
        kernel=_rms_norm_kernel,
        grid=(rows.shape[0],),
        args=(rows, weight, out, hidden, eps, rows.stride(0), out.stride(0)),
        constexprs={"BLOCK": block, "ONE_PASS": block >= hidden},
        num_warps=min(max(block // 256, 1), 16),
    )
    return out.view(x.shape), [launch]


rms_norm = launcher(plan_rms_norm)
