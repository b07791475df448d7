"""Triton decode kernels over row tables (see :mod:`petals_core.kernels._rows`): one new token
per row, each row's cache found through a pointer, so one launch serves many sessions whose
caches are separate tensors.  Same semantics as :func:`rows_append_reference` and
:func:`rows_attention_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import Launch, Target, launcher
from ._rows import RowTables
from ._triton_attention import (
    MAX_DECODE_ROWS,
    _decode_launches,
    _decode_split,
    _decode_tiles,
    _partials,
    _qk_scale,
    _splits,
)
from ._triton_rotary import _load_halves, _rotate, _rotated

__all__ = [
    "plan_rows_append",
    "plan_rows_decode_attention",
    "rows_append",
    "rows_decode_attention",
]


@triton.jit
def _append_kv_row(
    K,
    V,
    KeyPtrs,
    ValuePtrs,
    HeadStrides,
    row,
    kv_head,
    position,
    half,
    cols,
    mask,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    cos_lo,
    cos_hi,
    sin_lo,
    sin_hi,
    ROTARY: tl.constexpr,
):
    """Write one kv head of one row (its key rotated when ROTARY) into the row's cache at
    ``position``."""
    dtype = K.dtype.element_ty
    # The tables' contract (see RowTables): 16-byte aligned slabs and head rows, which lets the
    # stores below be vectorised.
    start = kv_head * tl.load(HeadStrides + row) + position * (2 * half)
    keys = tl.multiple_of(tl.load(KeyPtrs + row).to(tl.pointer_type(dtype)) + start, 16)
    values = tl.multiple_of(tl.load(ValuePtrs + row).to(tl.pointer_type(dtype)) + start, 16)
    keys += cols
    values += cols
    k = K + row * stride_kr + kv_head * stride_kh + cols
    k_lo = tl.load(k, mask=mask, other=0.0)
    k_hi = tl.load(k + half, mask=mask, other=0.0)
    if ROTARY:
        x_lo, x_hi = _rotated(
            k_lo.to(tl.float32), k_hi.to(tl.float32), cos_lo, cos_hi, sin_lo, sin_hi
        )
        k_lo = x_lo.to(dtype)
        k_hi = x_hi.to(dtype)
    tl.store(keys, k_lo, mask=mask)
    tl.store(keys + half, k_hi, mask=mask)
    v = V + row * stride_vr + kv_head * stride_vh + cols
    tl.store(values, tl.load(v, mask=mask, other=0.0), mask=mask)
    tl.store(values + half, tl.load(v + half, mask=mask, other=0.0), mask=mask)


@triton.jit(do_not_specialize=["n_head", "n_kv_head"])
def _rows_append_kernel(
    # pointers
    Q,
    QOut,
    K,
    V,
    KeyPtrs,
    ValuePtrs,
    HeadStrides,
    Positions,
    Cos,
    Sin,
    # sizes
    n_head,
    n_kv_head,
    half,
    # strides
    stride_qr,
    stride_qh,
    stride_qor,
    stride_qoh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_cos,
    stride_sin,
    # meta
    ROTARY: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program: one head of one row.  With ROTARY, query heads (rotated into QOut) come
    first, then the kv heads, whose rotated keys and values go into the row's cache at its
    position; without, the programs are the kv heads alone (``n_head`` is 0).

    Every name a branch uses is defined in that branch or above it: the compiler builds both
    sides of a branch decided at run time, where the interpreter runs only the one taken."""
    pid = tl.program_id(0)
    row = (pid // (n_head + n_kv_head)).to(tl.int64)
    head = pid % (n_head + n_kv_head)
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < half
    position = tl.load(Positions + row)

    if ROTARY:
        cos_lo, cos_hi = _load_halves(Cos + position * stride_cos + cols, half, mask)
        sin_lo, sin_hi = _load_halves(Sin + position * stride_sin + cols, half, mask)
        if head < n_head:
            q = Q + row * stride_qr + head * stride_qh + cols
            q_out = QOut + row * stride_qor + head * stride_qoh + cols
            _rotate(q, q_out, half, mask, cos_lo, cos_hi, sin_lo, sin_hi)
        else:
            _append_kv_row(
                K, V, KeyPtrs, ValuePtrs, HeadStrides, row, (head - n_head).to(tl.int64),
                position, half, cols, mask, stride_kr, stride_kh, stride_vr, stride_vh,
                cos_lo, cos_hi, sin_lo, sin_hi, True,
            )  # fmt: skip
    else:
        unused = tl.zeros([BLOCK_HALF], dtype=tl.float32)
        _append_kv_row(
            K, V, KeyPtrs, ValuePtrs, HeadStrides, row, head.to(tl.int64),
            position, half, cols, mask, stride_kr, stride_kh, stride_vr, stride_vh,
            unused, unused, unused, unused, False,
        )  # fmt: skip


@triton.jit(do_not_specialize=["n_head", "n_kv_head", "split_size", "num_splits"])
def _rows_decode_kernel(
    # pointers
    Q,
    Out,
    PartialAcc,
    PartialMax,
    PartialSum,
    Slopes,
    KeyPtrs,
    ValuePtrs,
    HeadStrides,
    Positions,
    # sizes
    n_head,
    n_kv_head,
    head_dim,
    split_size,
    num_splits,
    qk_scale,
    # strides
    stride_qr,
    stride_qh,
    stride_or,
    stride_oh,
    # meta
    HAS_ALIBI: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One program: the query heads of one kv head of one row, over one split of the row's keys
    (splits past the row's length attend to nothing; the last split runs to the row's end)."""
    pid_rkv = tl.program_id(0)
    split = tl.program_id(1)
    row = (pid_rkv // n_kv_head).to(tl.int64)
    kv_head = (pid_rkv % n_kv_head).to(tl.int64)
    group = n_head // n_kv_head

    heads = tl.arange(0, BLOCK_R)
    head_mask = heads < group
    head = kv_head * group + heads
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    tile_mask = head_mask[:, None] & dim_mask[None, :]

    q = tl.load(
        Q + row * stride_qr + head[:, None] * stride_qh + dims[None, :], mask=tile_mask, other=0.0
    )
    position = tl.load(Positions + row)
    length = position + 1
    dtype = Q.dtype.element_ty
    head_offset = kv_head * tl.load(HeadStrides + row)
    lo = split * split_size
    hi = tl.minimum(lo + split_size, length)
    if split == num_splits - 1:
        hi = length
    _decode_split(
        q,
        # 16-byte aligned (the tables' contract): the key and value tiles load in vectors.
        tl.multiple_of(tl.load(KeyPtrs + row).to(tl.pointer_type(dtype)) + head_offset, 16),
        tl.multiple_of(tl.load(ValuePtrs + row).to(tl.pointer_type(dtype)) + head_offset, 16),
        head_dim,
        head_dim,
        Slopes,
        head,
        head_mask,
        tl.zeros([BLOCK_R], dtype=tl.int64) + position,
        lo,
        hi,
        head_dim,
        qk_scale,
        Out + row * stride_or + head[:, None] * stride_oh + dims[None, :],
        # Partials are (rows, n_head, num_splits[, head_dim]), contiguous.
        (row * n_head + head) * num_splits + split,
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


def plan_rows_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: RowTables,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, list[Launch]]:
    """Write each row's new key and value into its cache at its position; with ``cos``/``sin``
    tables, rotate the keys first and return the rotated queries.

    q: (R, n_head, head_dim); k, v: (R, n_kv_head, head_dim); any strides with the last one 1.
    cos, sin: (positions, head_dim) in the activations' dtype: row r uses line ``positions[r]``
    (HF LLaMA's halves layout).  Without them, nothing is rotated and the queries returned are
    None (q is not read).  The caches must be in k's dtype, on k's device.  Returns the rotated
    queries (allocated, not yet written) and the launch that does it all (:func:`rows_append`
    runs it).
    """
    rows, n_kv_head, head_dim = k.shape
    assert v.shape == k.shape and v.dtype == k.dtype, "k, v: (R, n_kv_head, head_dim)"
    assert q.dim() == 3 and q.shape[0] == rows and q.shape[2] == head_dim
    assert rows == tables.rows, f"{rows} rows of keys for tables of {tables.rows} rows"
    assert head_dim % 2 == 0, "head_dim must be even"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head_dim must be contiguous"
    rotary = cos is not None
    if cos is not None:
        assert sin is not None and cos.shape == sin.shape and cos.shape[1] == head_dim
        assert cos.stride(-1) == sin.stride(-1) == 1, "cos, sin: (positions, head_dim)"
        n_head = q.shape[1]
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    else:
        n_head = 0  # the grid covers the kv heads only
        q_out = q  # never written
        cos = sin = k  # never read
    if rows == 0:
        return (q_out if rotary else None), []
    args = (
        q, q_out, k, v, tables.key_ptrs, tables.value_ptrs, tables.head_strides,
        tables.positions, cos, sin,
        n_head, n_kv_head, head_dim // 2,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
    )  # fmt: skip
    launch = Launch(
        kernel=_rows_append_kernel,
        grid=(rows * (n_head + n_kv_head),),
        args=args,
        constexprs={"ROTARY": rotary, "BLOCK_HALF": triton.next_power_of_2(head_dim // 2)},
        num_warps=1 if head_dim <= 128 else 2,
    )
    return (q_out if rotary else None), [launch]


def plan_rows_decode_attention(
    q: torch.Tensor,
    n_kv_head: int,
    tables: RowTables,
    *,
    max_length: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    target: Target | None = None,
) -> tuple[torch.Tensor, list[Launch]]:
    """Each row's query (its last position) over its cache's keys ``0 .. positions[r]``.

    q: (R, n_head, head_dim), the last stride 1.  ``max_length`` bounds the rows' lengths for
    the split of the key range into ``num_splits`` parallel parts (a row longer than that is
    still attended in full, by its last split), for ``target`` (by default q's device).
    alibi_slopes: (n_head,) float32 on q's device.  Returns the output, (R, n_head, head_dim) in
    q's dtype (allocated, not yet written), and the launches that write it
    (:func:`rows_decode_attention` runs them).
    """
    target = Target.of(q.device) if target is None else target
    rows, n_head, head_dim = q.shape
    assert rows == tables.rows, f"{rows} query rows for tables of {tables.rows} rows"
    assert n_head % n_kv_head == 0, f"{n_head} heads cannot share {n_kv_head} kv heads"
    group = n_head // n_kv_head
    assert group <= MAX_DECODE_ROWS, f"{group} query heads per kv head, at most {MAX_DECODE_ROWS}"
    assert q.stride(-1) == 1, "head_dim must be contiguous"
    assert q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"unsupported {q.dtype}"
    assert max_length >= 1
    if alibi_slopes is not None:
        assert alibi_slopes.shape == (n_head,) and alibi_slopes.dtype == torch.float32
        assert alibi_slopes.device == q.device and alibi_slopes.is_contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out, []
    block_n = block_n or _decode_tiles(q.dtype, head_dim)[0]
    split_size, num_splits = _splits(target, rows * n_kv_head, max_length, block_n, num_splits)
    partials = _partials(out, num_splits)
    args = (
        q, out, *partials,
        q if alibi_slopes is None else alibi_slopes,
        tables.key_ptrs, tables.value_ptrs, tables.head_strides, tables.positions,
        n_head, n_kv_head, head_dim, split_size, num_splits, _qk_scale(scale, head_dim),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    # The merge sees each row as a batch of one token.
    launches = _decode_launches(
        _rows_decode_kernel, (rows * n_kv_head, num_splits), args, partials,
        out.view(rows, n_head, 1, head_dim),
        alibi=alibi_slopes is not None, rows=group, block_n=block_n, target=target,
    )  # fmt: skip
    return out, launches


rows_append = launcher(plan_rows_append)
rows_decode_attention = launcher(plan_rows_decode_attention)
