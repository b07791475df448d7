"""Triton attention over the KV cache: flash-decoding for a few new tokens, flash-attention tiles
for a prefill chunk.  Same semantics as :func:`attention_reference`.

Scores live in the base-2 domain (the scale and ALiBi slopes are premultiplied by log2(e)) so the
softmax uses ``exp2``.  Both kernels read keys and values through their strides, so a cache prefix
view ``keys[:, :, :length]`` is never copied.

On CUDA the dots take fp16/bf16 operands and accumulate in fp32 (tensor cores); fp32 inputs use
IEEE dots, not tf32, to keep fp32 parity.  CPU tensors can only reach a kernel through Triton's
interpreter, which multiplies bf16 bit patterns as integers, so there the operands are upcast
first: bf16 products are exact in fp32, so only the rounding of the probabilities differs.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ._launch import Launch, Target, launcher
from ._limits import MAX_DECODE_ROWS, MAX_DECODE_TOKENS
from ._reference import check_attention_shapes

__all__ = [
    "MAX_DECODE_ROWS",
    "MAX_DECODE_TOKENS",
    "decode_attention",
    "plan_decode_attention",
    "plan_prefill_attention",
    "prefill_attention",
]

_MAX_SPLITS = 128
# Splits the merge reads at a time.
_COMBINE_SPLITS = 16
_LOG2E = math.log2(math.e)


@triton.jit
def _attend(
    acc,
    m_i,
    l_i,
    q,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    slope,
    query_pos,
    lo,
    hi,
    head_dim,
    qk_scale,
    HAS_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with the keys lo .. hi-1, one BLOCK_N tile a step.

    q: (rows, BLOCK_D); slope, query_pos: (rows,); MASKED applies the causal and range masks.
    """
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    for start in range(lo, hi, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_mask = keys < hi
        k_t = tl.load(  # (BLOCK_D, BLOCK_N)
            k_base + keys[None, :].to(tl.int64) * stride_ks + dims[:, None],
            mask=key_mask[None, :] & dim_mask[:, None],
            other=0.0,
        )
        scores = tl.dot(q, k_t.to(DOT_DTYPE), input_precision=PRECISION) * qk_scale
        if HAS_ALIBI:
            scores += slope[:, None] * keys[None, :].to(tl.float32)
        if MASKED:
            visible = key_mask[None, :] & (keys[None, :] <= query_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row can see no key of this tile (split-K ranges, causal edge): keep it at zero, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + keys[:, None].to(tl.int64) * stride_vs + dims[None, :],
            mask=key_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(
            p.to(DOT_DTYPE), v.to(DOT_DTYPE), acc * alpha[:, None], input_precision=PRECISION
        )
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_split(
    q,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    Slopes,
    head,
    row_mask,
    query_pos,
    lo,
    hi,
    head_dim,
    qk_scale,
    out_tile,
    part,
    PartialAcc,
    PartialMax,
    PartialSum,
    num_splits,
    HAS_ALIBI: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A decode program's query rows (q: (BLOCK_R, BLOCK_D); head, row_mask, query_pos:
    (BLOCK_R,)) over the keys lo .. hi-1 of one split.  A single split writes the output tile
    ``out_tile``; otherwise the softmax partials go to row ``part`` of the partial arrays,
    (rows, head_dim) and (rows,), for :func:`_combine_kernel`.  (Decided at run time: one
    compiled kernel serves both.)"""
    if HAS_ALIBI:
        slope = tl.load(Slopes + head, mask=row_mask, other=0.0) * 1.4426950408889634
    else:
        slope = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc, m_i, l_i = _attend(
        tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32),
        tl.full([BLOCK_R], float("-inf"), dtype=tl.float32),
        tl.zeros([BLOCK_R], dtype=tl.float32),
        q.to(DOT_DTYPE),
        k_base,
        v_base,
        stride_ks,
        stride_vs,
        slope,
        query_pos,
        lo,
        hi,
        head_dim,
        qk_scale,
        HAS_ALIBI,
        True,
        BLOCK_N,
        BLOCK_D,
        DOT_DTYPE,
        PRECISION,
    )
    dims = tl.arange(0, BLOCK_D)
    tile_mask = row_mask[:, None] & (dims < head_dim)[None, :]
    if num_splits == 1:
        out = acc / l_i[:, None]
        tl.store(out_tile, out.to(out_tile.dtype.element_ty), mask=tile_mask)
    else:
        tl.store(PartialAcc + part[:, None] * head_dim + dims[None, :], acc, mask=tile_mask)
        tl.store(PartialMax + part, m_i, mask=row_mask)
        tl.store(PartialSum + part, l_i, mask=row_mask)


# Sizes that change from step to step, or from model to model, are not specialized on (their
# divisibility by 16, or being 1): one compiled kernel serves them all.
_VARYING = ["n_head", "n_kv_head", "new_tokens", "query_offset", "split_size", "num_splits"]


@triton.jit(do_not_specialize=_VARYING)
def _decode_kernel(
    # pointers
    Q,
    K,
    V,
    Out,
    PartialAcc,
    PartialMax,
    PartialSum,
    Slopes,
    # sizes
    n_head,
    n_kv_head,
    new_tokens,
    query_offset,
    head_dim,
    split_size,
    num_splits,
    qk_scale,
    # strides
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_ot,
    # meta
    HAS_ALIBI: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: every query row (head of the group, new token) of one (batch, kv head) over one
    split of the keys, so each key and value is read once per kv head."""
    pid_bkv = tl.program_id(0)
    split = tl.program_id(1)
    batch = pid_bkv // n_kv_head
    kv_head = pid_bkv % n_kv_head
    group = n_head // n_kv_head

    rows = tl.arange(0, BLOCK_R)
    row_mask = rows < group * new_tokens
    head = kv_head * group + rows // new_tokens
    token = rows % new_tokens
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    tile_mask = row_mask[:, None] & dim_mask[None, :]

    q_rows = batch.to(tl.int64) * stride_qb + head * stride_qh + token * stride_qt
    q = tl.load(Q + q_rows[:, None] + dims[None, :], mask=tile_mask, other=0.0)
    out_rows = batch.to(tl.int64) * stride_ob + head * stride_oh + token * stride_ot
    # Partials are (B, n_head, T, num_splits[, head_dim]), contiguous.
    part = ((batch.to(tl.int64) * n_head + head) * new_tokens + token) * num_splits + split
    lo = split * split_size
    _decode_split(
        q,
        K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh,
        V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh,
        stride_ks,
        stride_vs,
        Slopes,
        head,
        row_mask,
        query_offset + token,
        lo,
        tl.minimum(lo + split_size, query_offset + new_tokens),
        head_dim,
        qk_scale,
        Out + out_rows[:, None] + dims[None, :],
        part,
        PartialAcc,
        PartialMax,
        PartialSum,
        num_splits,
        HAS_ALIBI,
        BLOCK_R,
        BLOCK_N,
        BLOCK_D,
        DOT_DTYPE,
        PRECISION,
    )


@triton.jit(do_not_specialize=["n_head", "new_tokens", "num_splits"])
def _combine_kernel(
    # pointers
    PartialAcc,
    PartialMax,
    PartialSum,
    Out,
    # sizes
    n_head,
    new_tokens,
    head_dim,
    num_splits,
    # strides
    stride_ob,
    stride_oh,
    stride_ot,
    # meta
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (batch, head, token): merge the splits' softmax partials, BLOCK_SPLITS
    splits at a time (one compiled kernel for every number of splits)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    first = row * num_splits

    # Split 0 holds key 0, which every query sees, so the maximum is finite.
    top = tl.full([BLOCK_SPLITS], float("-inf"), dtype=tl.float32)
    for start in range(0, num_splits, BLOCK_SPLITS):
        split_mask = start + splits < num_splits
        m = tl.load(PartialMax + first + start + splits, mask=split_mask, other=float("-inf"))
        top = tl.maximum(top, m)
    top_max = tl.max(top, 0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = tl.zeros([BLOCK_SPLITS], dtype=tl.float32)
    for start in range(0, num_splits, BLOCK_SPLITS):
        split_mask = start + splits < num_splits
        m = tl.load(PartialMax + first + start + splits, mask=split_mask, other=float("-inf"))
        l_s = tl.load(PartialSum + first + start + splits, mask=split_mask, other=0.0)
        weight = tl.math.exp2(m - top_max)
        part = tl.load(
            PartialAcc + (first + start + splits[:, None]) * head_dim + dims[None, :],
            mask=split_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        acc += tl.sum(part * weight[:, None], 0)
        total += l_s * weight
    out = acc / tl.sum(total, 0)

    batch = row // (n_head * new_tokens)
    head = (row // new_tokens) % n_head
    token = row % new_tokens
    out_row = batch * stride_ob + head * stride_oh + token * stride_ot
    tl.store(Out + out_row + dims, out.to(Out.dtype.element_ty), mask=dim_mask)


@triton.jit(do_not_specialize=["n_head", "n_kv_head", "new_tokens", "query_offset"])
def _prefill_kernel(
    # pointers
    Q,
    K,
    V,
    Out,
    Slopes,
    # sizes
    n_head,
    n_kv_head,
    new_tokens,
    query_offset,
    head_dim,
    qk_scale,
    # strides
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_ob,
    stride_oh,
    stride_ot,
    # meta
    HAS_ALIBI: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: BLOCK_M queries of one (batch, head), over every key they may see."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = pid_bh // n_head
    head = pid_bh % n_head
    kv_head = head // (n_head // n_kv_head)

    first = pid_m * BLOCK_M
    tokens = first + tl.arange(0, BLOCK_M)
    token_mask = tokens < new_tokens
    dims = tl.arange(0, BLOCK_D)
    tile_mask = token_mask[:, None] & (dims < head_dim)[None, :]

    q_base = Q + batch.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    q = tl.load(q_base + tokens[:, None] * stride_qt + dims[None, :], mask=tile_mask, other=0.0)
    q = q.to(DOT_DTYPE)
    if HAS_ALIBI:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(Slopes + head) * 1.4426950408889634
    else:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = K + batch.to(tl.int64) * stride_kb + kv_head.to(tl.int64) * stride_kh
    v_base = V + batch.to(tl.int64) * stride_vb + kv_head.to(tl.int64) * stride_vh
    query_pos = query_offset + tokens

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Whole tiles before the first query's position are visible to every row: no mask there.
    unmasked_end = (query_offset + first) // BLOCK_N * BLOCK_N
    end = query_offset + tl.minimum(first + BLOCK_M, new_tokens)
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, slope, query_pos,
        0, unmasked_end, head_dim, qk_scale,
        HAS_ALIBI, False, BLOCK_N, BLOCK_D, DOT_DTYPE, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend(
        acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, slope, query_pos,
        unmasked_end, end, head_dim, qk_scale,
        HAS_ALIBI, True, BLOCK_N, BLOCK_D, DOT_DTYPE, PRECISION,
    )  # fmt: skip

    out = acc / l_i[:, None]
    o_base = Out + batch.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(
        o_base + tokens[:, None] * stride_ot + dims[None, :],
        out.to(Out.dtype.element_ty),
        mask=tile_mask,
    )


def plan_decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    query_offset: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    target: Target | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """Flash-decoding: the keys cut into ``num_splits`` ranges attended in parallel, then merged.

    q: (B, n_head, T, head_dim), T <= 16; k, v: (B, n_kv_head, S, head_dim), any strides with the
    last one 1 (a cache prefix view).  See :func:`attention_reference` for the semantics.
    ``block_n`` (keys per tile) and ``num_splits`` default to a choice for ``target`` (by
    default q's device).  Returns the output (allocated, not yet written) and the launches that
    write it (:func:`decode_attention` runs them).
    """
    target = Target.of(q.device) if target is None else target
    batch, n_head, new_tokens, head_dim = q.shape
    n_kv_head = k.shape[1]
    slopes = _check(q, k, v, query_offset, alibi_slopes)
    if q.numel() == 0:
        return torch.empty_like(q), []
    rows = (n_head // n_kv_head) * new_tokens
    assert new_tokens <= MAX_DECODE_TOKENS, f"decode takes up to {MAX_DECODE_TOKENS} new tokens"
    assert rows <= MAX_DECODE_ROWS, f"{rows} query rows per kv head, at most {MAX_DECODE_ROWS}"
    block_n = block_n or _decode_tiles(q.dtype, head_dim)[0]
    length = query_offset + new_tokens  # keys past the last query are never seen
    split_size, num_splits = _splits(target, batch * n_kv_head, length, block_n, num_splits)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    partials = _partials(out, num_splits)
    args = (
        q, k, v, out, *partials, slopes,
        n_head, n_kv_head, new_tokens, query_offset, head_dim, split_size, num_splits,
        _qk_scale(scale, head_dim),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
    )  # fmt: skip
    launches = _decode_launches(
        _decode_kernel, (batch * n_kv_head, num_splits), args, partials, out,
        alibi=alibi_slopes is not None, rows=rows, block_n=block_n, target=target,
    )  # fmt: skip
    return out, launches


def _decode_launches(
    kernel: object,
    grid: tuple[int, int],
    args: tuple[object, ...],
    partials: tuple[torch.Tensor, ...],
    out: torch.Tensor,
    *,
    alibi: bool,
    rows: int,
    block_n: int,
    target: Target,
) -> list[Launch]:
    """The launch of a decode kernel (this module's or the row tables') over ``grid``
    (programs, splits): ``rows`` query rows per program, keys ``block_n`` at a time; then, with
    more than one split, the merge of the splits' ``partials`` into ``out`` (B, n_head, T,
    head_dim)."""
    head_dim, dtype, num_splits = out.shape[-1], out.dtype, grid[1]
    launch = Launch(
        kernel=kernel,
        grid=grid,
        args=args,
        constexprs=_constexprs(
            alibi, head_dim, dtype, target, BLOCK_R=_block_r(rows), BLOCK_N=block_n
        ),
        # With 4 warps, 16 rows of head_dim 128 spill 344 bytes a thread; with 8, none.
        num_warps=8,
        num_stages=_decode_tiles(dtype, head_dim)[1],
    )
    if num_splits == 1:
        return [launch]
    return [launch, _plan_combine(partials, out, num_splits)]


def _constexprs(
    alibi: bool, head_dim: int, dtype: torch.dtype, target: Target, **blocks: int
) -> dict[str, object]:
    """An attention kernel's constexprs: its tiles' sizes ``blocks`` (``BLOCK_N``, ...) and
    what follows from ALiBi, the head size, the dtype and the target."""
    dot_dtype, precision = _dot_config(dtype, target)
    return {
        "HAS_ALIBI": alibi,
        **blocks,
        "BLOCK_D": _block_d(head_dim),
        "DOT_DTYPE": dot_dtype,
        "PRECISION": precision,
    }


def plan_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    query_offset: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    target: Target | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """Flash-attention tiles: BLOCK_M queries of one head against BLOCK_N keys at a time.

    q: (B, n_head, T, head_dim), any T; k, v: (B, n_kv_head, S, head_dim), any strides with the
    last one 1.  See :func:`attention_reference` for the semantics.  Returns the output
    (allocated, not yet written) and the launch that writes it, for ``target`` (by default q's
    device; :func:`prefill_attention` runs it).
    """
    target = Target.of(q.device) if target is None else target
    batch, n_head, new_tokens, head_dim = q.shape
    slopes = _check(q, k, v, query_offset, alibi_slopes)
    if q.numel() == 0:
        return torch.empty_like(q), []
    default_block_m, default_block_n, num_warps, num_stages = _prefill_tiles(q.dtype, head_dim)
    block_m = block_m or default_block_m
    block_n = block_n or default_block_n
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    args = (
        q, k, v, out, slopes,
        n_head, k.shape[1], new_tokens, query_offset, head_dim, _qk_scale(scale, head_dim),
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
    )  # fmt: skip
    launch = Launch(
        kernel=_prefill_kernel,
        grid=(triton.cdiv(new_tokens, block_m), batch * n_head),
        args=args,
        constexprs=_constexprs(
            alibi_slopes is not None, head_dim, q.dtype, target, BLOCK_M=block_m, BLOCK_N=block_n
        ),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, [launch]


decode_attention = launcher(plan_decode_attention)
prefill_attention = launcher(plan_prefill_attention)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_offset: int,
    alibi_slopes: torch.Tensor | None,
) -> torch.Tensor:
    """Validate the inputs (the reference's errors, then the kernels' limits); returns the slopes
    as float32 on q's device, or q itself as a never-read placeholder."""
    batch, n_head, _, head_dim = q.shape
    n_kv_head, length = k.shape[1], k.shape[2]
    check_attention_shapes(q, k, query_offset)
    assert k.shape == v.shape == (batch, n_kv_head, length, head_dim), "k, v: (B, n_kv, S, D)"
    assert q.dtype == k.dtype == v.dtype, "q, k and v must share a dtype"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported {q.dtype}"
    assert q.device == k.device == v.device, "q, k and v must be on one device"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head_dim must be contiguous"
    assert query_offset >= 0, "query_offset must not be negative"
    if alibi_slopes is None:
        return q
    assert alibi_slopes.shape == (n_head,), "alibi_slopes: (n_head,)"
    return alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()


def _splits(
    target: Target, programs: int, length: int, block_n: int, num_splits: int | None
) -> tuple[int, int]:
    """(split_size, num_splits): ``length`` keys cut into at most ``num_splits`` (default: for
    the target) ranges of whole BLOCK_N tiles, none of them empty."""
    if num_splits is None:
        num_splits = default_splits(target, programs, length, block_n)
    assert 1 <= num_splits <= _MAX_SPLITS, f"num_splits must be in [1, {_MAX_SPLITS}]"
    split_size = triton.cdiv(triton.cdiv(length, num_splits), block_n) * block_n
    return split_size, triton.cdiv(length, split_size)


def _partials(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, ...]:
    """The softmax partials of each split of each query row of ``out`` (..., head_dim): the
    accumulators, maxima and sums, contiguous.  For a single split (the decode kernel then
    writes ``out`` itself) a float32 placeholder, never read or written, thrice: the kernel's
    argument types are the same either way, so one compiled kernel serves both."""
    if num_splits == 1:
        placeholder = _placeholder(out.device)
        return placeholder, placeholder, placeholder
    head_dim = out.shape[-1]
    count = math.prod(out.shape[:-1]) * num_splits
    # One allocation, cut into the three contiguous arrays the kernels index, each starting 16
    # bytes after the last (4 float32 entries): the kernels are compiled for aligned pointers.
    padded = -(-count // 4) * 4
    partials = torch.empty(padded * (head_dim + 2), dtype=torch.float32, device=out.device)
    return (
        partials[: count * head_dim],
        partials[padded * head_dim : padded * head_dim + count],
        partials[padded * (head_dim + 1) : padded * (head_dim + 1) + count],
    )


@functools.cache
def _placeholder(device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):
        return torch.empty(1, dtype=torch.float32, device=device)


def _plan_combine(partials: tuple[torch.Tensor, ...], out: torch.Tensor, num_splits: int) -> Launch:
    """Merge the splits' partials (accumulators, maxima, sums) into ``out`` (B, n_head, T,
    head_dim)."""
    batch, n_head, new_tokens, head_dim = out.shape
    args = (
        *partials, out,
        n_head, new_tokens, head_dim, num_splits,
        *out.stride()[:3],
    )  # fmt: skip
    return Launch(
        kernel=_combine_kernel,
        grid=(batch * n_head * new_tokens,),
        args=args,
        constexprs={"BLOCK_SPLITS": _COMBINE_SPLITS, "BLOCK_D": _block_d(head_dim)},
        num_warps=4,
    )


def _qk_scale(scale: float | None, head_dim: int) -> float:
    return (1.0 / math.sqrt(head_dim) if scale is None else scale) * _LOG2E


def _block_r(rows: int) -> int:
    """Query rows a decode program holds: a power of two from 16 (tl.dot's least) to 128.  A
    larger tile than needed costs registers: at head_dim 128 with 8 warps, ptxas spills 0, 80,
    248 and 792 bytes a thread at 16, 32, 64 and 128 rows."""
    return max(16, triton.next_power_of_2(rows))


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 on every side


def _decode_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int]:
    """(BLOCK_N, num_stages): the pipelined K and V tiles stay under ~100 KB of shared memory,
    which every CUDA card since sm_80 has."""
    row_bytes = dtype.itemsize * _block_d(head_dim)
    if row_bytes <= 256:  # 16-bit, head_dim <= 128
        return 64, 3
    return (32, 2) if row_bytes <= 512 else (16, 2)


def _prefill_tiles(dtype: torch.dtype, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), within the same shared-memory budget."""
    row_bytes = dtype.itemsize * _block_d(head_dim)
    if row_bytes <= 256:
        return 128, 64, 8, 3
    return (64, 32, 4, 2) if row_bytes <= 512 else (32, 16, 4, 2)


def _dot_config(dtype: torch.dtype, target: Target) -> tuple[tl.dtype, str]:
    """The dtype the dots take their operands in, and the precision of fp32 dots."""
    if dtype == torch.float32 or not target.cuda:
        return tl.float32, "ieee"
    return (tl.float16 if dtype == torch.float16 else tl.bfloat16), "tf32"


def default_splits(target: Target, programs: int, length: int, block_n: int) -> int:
    """Enough key splits for about two programs per SM, each split at least four tiles long."""
    wanted = triton.cdiv(2 * target.multiprocessors, programs)
    return max(1, min(wanted, triton.cdiv(length, 4 * block_n), _MAX_SPLITS))
