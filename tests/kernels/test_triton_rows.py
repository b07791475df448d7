"""The row-table decode kernels against their references, on CPU tensors through Triton's
interpreter (selected in tests/conftest.py before anything imports triton).

Every row has a cache of its own, of its own length (``max_length``), at its own position, so a
kernel that read a row's slab with another row's strides or position would show.  Unused cache
positions hold NaN: reading past a row's position would show too.
"""

from __future__ import annotations

import os

import pytest
import torch

from petals_core.kernels import _rows, _triton_rows as rows_kernels
from petals_core.kernels._reference import (
    alibi_slopes,
    rows_append_reference,
    rows_attention_reference,
)

from ._parity import assert_parity

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py selects the interpreter"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_DIM = 32
# (batch, max_length, position) of each session: rows of one session share a position.
SESSIONS = [(1, 40, 0), (2, 96, 70), (1, 64, 33)]


def _caches(dtype: torch.dtype, n_kv_head: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Keys or values of every session: (B, n_kv_head, max_length, head_dim), filled with random
    values before each session's position and NaN from it on."""
    caches = []
    for batch, max_length, position in SESSIONS:
        cache = torch.full((batch, n_kv_head, max_length, HEAD_DIM), float("nan"), dtype=dtype)
        cache[:, :, :position] = torch.randn(
            batch, n_kv_head, position, HEAD_DIM, generator=generator
        ).to(dtype)
        caches.append(cache)
    return caches


def _slabs(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [cache[row] for cache in caches for row in range(cache.shape[0])]


def _tables(keys: list[torch.Tensor], values: list[torch.Tensor]) -> _rows.RowTables:
    positions = [position for batch, _, position in SESSIONS for _ in range(batch)]
    return _rows.RowTables(
        positions=torch.tensor(positions, dtype=torch.int64),
        head_strides=torch.tensor([slab.stride(0) for slab in _slabs(keys)], dtype=torch.int64),
        key_ptrs=torch.tensor([slab.data_ptr() for slab in _slabs(keys)], dtype=torch.int64),
        value_ptrs=torch.tensor([slab.data_ptr() for slab in _slabs(values)], dtype=torch.int64),
    )


def _positions() -> list[int]:
    return [position for batch, _, position in SESSIONS for _ in range(batch)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [False, True])
def test_rows_append(dtype: torch.dtype, rotary: bool) -> None:
    generator = torch.Generator().manual_seed(1)
    n_head, n_kv_head = 4, 2
    rows = sum(batch for batch, _, _ in SESSIONS)
    keys, values = _caches(dtype, n_kv_head, generator), _caches(dtype, n_kv_head, generator)
    expected_keys = [cache.clone() for cache in keys]
    expected_values = [cache.clone() for cache in values]
    # Projections as a block makes them: one (R, heads * head_dim) matrix viewed per head.
    q = torch.randn(rows, n_head * HEAD_DIM, generator=generator).to(dtype).view(rows, n_head, -1)
    kv = torch.randn(rows, 2, n_kv_head * HEAD_DIM, generator=generator).to(dtype)
    k, v = kv[:, 0].view(rows, n_kv_head, -1), kv[:, 1].view(rows, n_kv_head, -1)
    cos = sin = None
    if rotary:
        angles = torch.randn(100, HEAD_DIM, generator=generator)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    # The kernel rotates in fp32 and rounds once; so does the reference given fp32 inputs.
    expected_q = rows_append_reference(
        q.float(),
        k.float(),
        v,
        keys=_slabs(expected_keys),
        values=_slabs(expected_values),
        positions=_positions(),
        cos=None if cos is None else cos.float(),
        sin=None if sin is None else sin.float(),
    )
    actual_q = rows_kernels.rows_append(q, k, v, _tables(keys, values), cos=cos, sin=sin)
    if rotary:
        assert actual_q is not None and expected_q is not None
        assert_parity(actual_q, expected_q.to(dtype))
    else:
        assert actual_q is None
    for actual, expected in zip(keys + values, expected_keys + expected_values, strict=True):
        torch.testing.assert_close(
            actual.float(),
            expected.float(),
            rtol=0 if not rotary or dtype == torch.float32 else torch.finfo(dtype).eps,
            atol=1e-6,
            equal_nan=True,
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv_head", [1, 4])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_decode_attention(
    dtype: torch.dtype, n_kv_head: int, alibi: bool, num_splits: int
) -> None:
    generator = torch.Generator().manual_seed(2)
    n_head = 4
    rows = sum(batch for batch, _, _ in SESSIONS)
    keys, values = _caches(dtype, n_kv_head, generator), _caches(dtype, n_kv_head, generator)
    # Each row's own key and value at its position, as the append kernel leaves them.
    for cache in keys + values:
        position = next(p for b, m, p in SESSIONS if m == cache.shape[2])
        cache[:, :, position] = torch.randn(
            cache.shape[0], n_kv_head, HEAD_DIM, generator=generator
        ).to(dtype)
    q = torch.randn(rows, n_head, HEAD_DIM, generator=generator).to(dtype)
    slopes = alibi_slopes(n_head) if alibi else None
    expected = rows_attention_reference(
        q,
        keys=_slabs(keys),
        values=_slabs(values),
        positions=_positions(),
        scale=0.2,
        alibi_slopes=slopes,
    )
    # A bucket of 64 positions in splits of 16-key tiles: the row at 70 is longer than the
    # bucket (its last split runs to its end), the row at 0 sees only its first split's key.
    actual = rows_kernels.rows_decode_attention(
        q,
        n_kv_head,
        _tables(keys, values),
        max_length=64,
        scale=0.2,
        alibi_slopes=slopes,
        block_n=16,
        num_splits=num_splits,
    )
    assert_parity(actual, expected)


def test_row_tables_are_checked() -> None:
    good = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="key_ptrs must be a contiguous"):
        _rows.RowTables(positions=good, head_strides=good, key_ptrs=good[:2], value_ptrs=good)
    with pytest.raises(ValueError, match="positions must be a contiguous"):
        _rows.RowTables(positions=good.int(), head_strides=good, key_ptrs=good, value_ptrs=good)
