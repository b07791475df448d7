"""A kernel with the mistake that once broke the row-table append on every GPU: a name defined
under a constexpr branch and used under a branch decided at run time.  With SCALE off and no row
to scale, the interpreter never enters that branch and the kernel runs; the compiler builds both
sides of a run-time branch and rejects it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from petals_core.kernels._launch import Launch


@triton.jit
def _scaled_copy_kernel(X, Out, n_scaled, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask)
    if SCALE:
        factor = 2.0
    if row < n_scaled:
        x = x * factor
    tl.store(Out + row * n + cols, x, mask=mask)


def plan_scaled_copy(x: torch.Tensor, out: torch.Tensor, *, scale: bool) -> Launch:
    """Copy ``x`` (rows, n) into ``out``, doubled when ``scale``."""
    rows, n = x.shape
    return Launch(
        kernel=_scaled_copy_kernel,
        grid=(rows,),
        args=(x, out, rows if scale else 0, n),
        constexprs={"SCALE": scale, "BLOCK": triton.next_power_of_2(n)},
        num_warps=1,
    )
