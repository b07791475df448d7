"""Triton rotary embeddings (HF LLaMA's halves layout), alone or fused with the KV-cache append.

One launch rotates the queries, rotates the new keys into the cache and copies the new values
next to them, which is three reads and three writes instead of the eager path's dozen.  Same
semantics as :func:`rotary_reference` / :func:`rotary_append_reference`, computed in fp32 and
rounded once on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launch, launcher
from ._reference import check_cache_room

__all__ = ["plan_rotary", "plan_rotary_append", "rotary", "rotary_append"]


@triton.jit
def _load_halves(ptr, half, mask):
    """The two halves (at ``ptr`` and ``ptr + half``) of a tile of rows, in fp32."""
    lo = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def _rotated(x_lo, x_hi, cos_lo, cos_hi, sin_lo, sin_hi):
    """x * cos + rotate_half(x) * sin, by halves."""
    return x_lo * cos_lo - x_hi * sin_lo, x_hi * cos_hi + x_lo * sin_hi


@triton.jit
def _rotate(src, dst, half, mask, cos_lo, cos_hi, sin_lo, sin_hi):
    """dst = src * cos + rotate_half(src) * sin for a tile of rows; ``src`` and ``dst`` point at
    the first halves' elements."""
    x_lo, x_hi = _load_halves(src, half, mask)
    out_lo, out_hi = _rotated(x_lo, x_hi, cos_lo, cos_hi, sin_lo, sin_hi)
    tl.store(dst, out_lo.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + half, out_hi.to(dst.dtype.element_ty), mask=mask)


# A new position every step, and sizes that vary by model and step: not specialized on.
@triton.jit(do_not_specialize=["n_head", "n_kv_head", "new_tokens", "start"])
def _rotary_kernel(
    # pointers
    Q,
    QOut,
    K,
    V,
    Keys,
    Values,
    Cos,
    Sin,
    # sizes
    n_head,
    n_kv_head,
    new_tokens,
    half,
    start,
    # strides
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qob,
    stride_qoh,
    stride_qot,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_keys_b,
    stride_keys_h,
    stride_keys_t,
    stride_values_b,
    stride_values_h,
    stride_values_t,
    stride_cos_b,
    stride_cos_t,
    stride_sin_b,
    stride_sin_t,
    # meta
    HAS_KV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program: BLOCK_T tokens of one head, a query head (< n_head) or a kv head after them."""
    pid_bh = tl.program_id(0)
    pid_t = tl.program_id(1)
    batch = (pid_bh // (n_head + n_kv_head)).to(tl.int64)
    head = pid_bh % (n_head + n_kv_head)
    tokens = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (tokens < new_tokens)[:, None] & (cols < half)[None, :]

    cos_lo, cos_hi = _load_halves(
        Cos + batch * stride_cos_b + tokens[:, None] * stride_cos_t + cols[None, :], half, mask
    )
    sin_lo, sin_hi = _load_halves(
        Sin + batch * stride_sin_b + tokens[:, None] * stride_sin_t + cols[None, :], half, mask
    )

    tokens_2d = tokens[:, None]
    cols_2d = cols[None, :]
    if head < n_head:
        q = Q + batch * stride_qb + head * stride_qh + tokens_2d * stride_qt + cols_2d
        q_out = QOut + batch * stride_qob + head * stride_qoh + tokens_2d * stride_qot + cols_2d
        _rotate(q, q_out, half, mask, cos_lo, cos_hi, sin_lo, sin_hi)
    elif HAS_KV:
        kv_head = head - n_head
        k = K + batch * stride_kb + kv_head * stride_kh + tokens_2d * stride_kt + cols_2d
        keys = (
            Keys
            + batch * stride_keys_b
            + kv_head * stride_keys_h
            + start * stride_keys_t
            + tokens_2d * stride_keys_t
            + cols_2d
        )
        _rotate(k, keys, half, mask, cos_lo, cos_hi, sin_lo, sin_hi)
        v = (
            V
            + batch * stride_vb
            + kv_head * stride_vh
            + tokens[:, None] * stride_vt
            + cols[None, :]
        )
        values = (
            Values
            + batch * stride_values_b
            + kv_head * stride_values_h
            + (start + tokens[:, None]).to(tl.int64) * stride_values_t
            + cols[None, :]
        )
        dtype = Values.dtype.element_ty
        tl.store(values, tl.load(v, mask=mask, other=0.0).to(dtype), mask=mask)
        tl.store(values + half, tl.load(v + half, mask=mask, other=0.0).to(dtype), mask=mask)


def plan_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, list[Launch]]:
    """x: (B, heads, T, head_dim), any strides with the last one 1; cos, sin: (B or 1, T, head_dim).

    The output, a new contiguous tensor in ``promote_types(x.dtype, cos.dtype)`` as the
    reference's (allocated, not yet written), and the launch that writes it (:func:`rotary`
    runs it).
    """
    cos, sin = _check(x, cos, sin)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    return out, _plan(x, out, None, cos, sin, start=0)


def plan_rotary_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
) -> tuple[torch.Tensor, list[Launch]]:
    """Rotate q and k; write the rotated k and v into ``keys/values[:, :, start:start+T]``.

    q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim); cos, sin: (B or 1, T,
    head_dim); keys, values: the cache, (B, n_kv_head, max_length, head_dim), written in place
    (cast to its dtype).  All with the last stride 1.  Returns the rotated q, contiguous, in
    ``promote_types(q.dtype, cos.dtype)`` (allocated, not yet written), and the launch that
    does it all (:func:`rotary_append` runs it).
    """
    cos, sin = _check(q, cos, sin)
    new_tokens, head_dim = k.shape[2:]
    check_cache_room(start, new_tokens, keys.shape[2])
    assert v.shape == k.shape and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
    assert keys.shape == values.shape and keys.shape[:2] == k.shape[:2]
    assert keys.shape[3] == head_dim
    assert k.stride(-1) == v.stride(-1) == keys.stride(-1) == values.stride(-1) == 1
    assert k.device == v.device == keys.device == values.device == q.device
    out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    return out, _plan(q, out, (k, v, keys, values), cos, sin, start=start)


rotary = launcher(plan_rotary)
rotary_append = launcher(plan_rotary_append)


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validate; returns cos and sin broadcast to (B, T, head_dim) (a stride-0 batch, no copy)."""
    batch, _, new_tokens, head_dim = x.shape
    assert head_dim % 2 == 0, "rotary needs an even head_dim"
    assert cos.shape == sin.shape and cos.dim() == 3, "cos, sin: (B or 1, T, head_dim)"
    assert cos.shape[0] in (1, batch) and cos.shape[1:] == (new_tokens, head_dim)
    assert x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1, "head_dim must be contiguous"
    assert x.device == cos.device == sin.device, "x, cos and sin must be on one device"
    return cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)


def _plan(
    q: torch.Tensor,
    q_out: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    start: int,
) -> list[Launch]:
    batch, n_head, new_tokens, head_dim = q.shape
    if q.numel() == 0:
        return []
    # Without k/v the kernel never touches those pointers; q stands in for them.
    k, v, keys, values = kv or (q, q, q, q)
    n_kv_head = 0 if kv is None else k.shape[1]
    # One token (a decode step) or up to 16 at a time: two compiled variants cover every T.
    block_t = 1 if new_tokens == 1 else 16
    block_half = triton.next_power_of_2(head_dim // 2)
    args = (
        q, q_out, k, v, keys, values, cos, sin,
        n_head, n_kv_head, new_tokens, head_dim // 2, start,
        *q.stride()[:3], *q_out.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *keys.stride()[:3], *values.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
    )  # fmt: skip
    launch = Launch(
        kernel=_rotary_kernel,
        grid=(batch * (n_head + n_kv_head), triton.cdiv(new_tokens, block_t)),
        args=args,
        constexprs={"HAS_KV": kv is not None, "BLOCK_T": block_t, "BLOCK_HALF": block_half},
        num_warps=4 if block_t * block_half >= 1024 else 1,
    )
    return [launch]
