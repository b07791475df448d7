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

__all__ = ["rotary", "rotary_append"]


@triton.jit
def _rotate(
    src,
    dst,
    stride_src_t,
    stride_dst_t,
    tokens,
    cols,
    half,
    mask,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
):
    """dst[t] = src[t] * cos + rotate_half(src[t]) * sin for one head's (BLOCK_T, head_dim) tile."""
    lo_src = src + tokens[:, None] * stride_src_t + cols[None, :]
    x_lo = tl.load(lo_src, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(lo_src + half, mask=mask, other=0.0).to(tl.float32)
    lo_dst = dst + tokens[:, None] * stride_dst_t + cols[None, :]
    out_lo = x_lo * cos_lo - x_hi * sin_lo
    out_hi = x_hi * cos_hi + x_lo * sin_hi
    tl.store(lo_dst, out_lo.to(dst.dtype.element_ty), mask=mask)
    tl.store(lo_dst + half, out_hi.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["start"])  # a new position every step: do not recompile
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

    cos = Cos + batch * stride_cos_b + tokens[:, None] * stride_cos_t + cols[None, :]
    sin = Sin + batch * stride_sin_b + tokens[:, None] * stride_sin_t + cols[None, :]
    cos_lo = tl.load(cos, mask=mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos + half, mask=mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin, mask=mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin + half, mask=mask, other=0.0).to(tl.float32)

    if head < n_head:
        _rotate(
            Q + batch * stride_qb + head * stride_qh,
            QOut + batch * stride_qob + head * stride_qoh,
            stride_qt, stride_qot, tokens, cols, half, mask, cos_lo, cos_hi, sin_lo, sin_hi,
        )  # fmt: skip
    elif HAS_KV:
        kv_head = head - n_head
        _rotate(
            K + batch * stride_kb + kv_head * stride_kh,
            Keys + batch * stride_keys_b + kv_head * stride_keys_h + start * stride_keys_t,
            stride_kt, stride_keys_t, tokens, cols, half, mask, cos_lo, cos_hi, sin_lo, sin_hi,
        )  # fmt: skip
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


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, heads, T, head_dim), any strides with the last one 1; cos, sin: (B or 1, T, head_dim).

    Returns a new contiguous tensor in ``promote_types(x.dtype, cos.dtype)``, as the reference.
    """
    cos, sin = _check(x, cos, sin)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    _launch(x, out, None, cos, sin, start=0)
    return out


def rotary_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """Rotate q and k; write the rotated k and v into ``keys/values[:, :, start:start+T]``.

    q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim); cos, sin: (B or 1, T,
    head_dim); keys, values: the cache, (B, n_kv_head, max_length, head_dim), written in place
    (cast to its dtype).  All with the last stride 1.  Returns the rotated q, contiguous, in
    ``promote_types(q.dtype, cos.dtype)``.
    """
    cos, sin = _check(q, cos, sin)
    new_tokens, head_dim = k.shape[2:]
    if start < 0 or start + new_tokens > keys.shape[2]:
        raise ValueError(
            f"positions {start} .. {start + new_tokens - 1} do not fit a cache of {keys.shape[2]}"
        )
    assert v.shape == k.shape and k.shape[0] == q.shape[0] and k.shape[2:] == q.shape[2:]
    assert keys.shape == values.shape and keys.shape[:2] == k.shape[:2]
    assert keys.shape[3] == head_dim
    assert k.stride(-1) == v.stride(-1) == keys.stride(-1) == values.stride(-1) == 1
    assert k.device == v.device == keys.device == values.device == q.device
    out = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, cos.dtype), device=q.device)
    _launch(q, out, (k, v, keys, values), cos, sin, start=start)
    return out


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Validate; returns cos and sin broadcast to (B, T, head_dim) (a stride-0 batch, no copy)."""
    batch, _, new_tokens, head_dim = x.shape
    assert head_dim % 2 == 0, "rotary needs an even head_dim"
    assert cos.shape == sin.shape and cos.dim() == 3, "cos, sin: (B or 1, T, head_dim)"
    assert cos.shape[0] in (1, batch) and cos.shape[1:] == (new_tokens, head_dim)
    assert x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1, "head_dim must be contiguous"
    assert x.device == cos.device == sin.device, "x, cos and sin must be on one device"
    return cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)


def _launch(
    q: torch.Tensor,
    q_out: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    start: int,
) -> None:
    batch, n_head, new_tokens, head_dim = q.shape
    if q.numel() == 0:
        return
    # Without k/v the kernel never touches those pointers; q stands in for them.
    k, v, keys, values = kv or (q, q, q, q)
    n_kv_head = 0 if kv is None else k.shape[1]
    block_t = min(triton.next_power_of_2(new_tokens), 16)
    block_half = triton.next_power_of_2(head_dim // 2)
    grid = (batch * (n_head + n_kv_head), triton.cdiv(new_tokens, block_t))
    _rotary_kernel[grid](
        q, q_out, k, v, keys, values, cos, sin,
        n_head, n_kv_head, new_tokens, head_dim // 2, start,
        *q.stride()[:3], *q_out.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *keys.stride()[:3], *values.stride()[:3], *cos.stride()[:2], *sin.stride()[:2],
        HAS_KV=kv is not None, BLOCK_T=block_t, BLOCK_HALF=block_half,
        num_warps=4 if block_t * block_half >= 1024 else 1,
    )  # fmt: skip
