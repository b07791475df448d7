"""Row tables: decode kernels for many sessions whose caches are separate tensors.

A row is one row of one session's cache (a session of batch B contributes B rows).  The tables are
int64 device tensors with one entry per row:

- ``positions[r]``: where row r's new token goes (its cache length before the step);
- ``head_strides[r]``: elements between two kv heads of row r's cache (``max_length * head_dim``
  for a contiguous ``(batch, kv_heads, max_length, head_dim)`` cache);
- ``key_ptrs[r]``, ``value_ptrs[r]``: the addresses of row r's ``(kv_heads, max_length,
  head_dim)`` slabs of keys and values, in the activations' dtype.

Every slab address must be a multiple of 16 bytes, and so must ``head_dim`` times the element
size (so every head's row is): the kernels load and store in 16-byte vectors.  Tensors from
torch's allocators are aligned far beyond that, and so are their rows.

Because the tables are data, not launch arguments, a CUDA graph captured once for a number of rows
and a length bucket replays for any sessions at any positions: only the tables change.

The kernels read raw addresses, which only Triton can: they run on CUDA, or on CPU tensors under
Triton's interpreter (the parity tests); there is no torch path.  Triton is imported on first use.
"""

from __future__ import annotations

import torch

from ._dispatch import _on

__all__ = ["RowTables", "rows_append", "rows_decode_attention"]


class RowTables:
    """The four per-row tables of one block, device int64 tensors of equal length (see the
    module's docstring).  Views into a larger buffer are fine: each must be contiguous."""

    __slots__ = ("head_strides", "key_ptrs", "positions", "value_ptrs")

    def __init__(
        self,
        *,
        positions: torch.Tensor,
        head_strides: torch.Tensor,
        key_ptrs: torch.Tensor,
        value_ptrs: torch.Tensor,
    ) -> None:
        rows = positions.shape[0]
        for name, table in (
            ("positions", positions),
            ("head_strides", head_strides),
            ("key_ptrs", key_ptrs),
            ("value_ptrs", value_ptrs),
        ):
            if table.shape != (rows,) or table.dtype != torch.int64 or not table.is_contiguous():
                raise ValueError(f"{name} must be a contiguous ({rows},) int64 tensor")
        self.positions = positions
        self.head_strides = head_strides
        self.key_ptrs = key_ptrs
        self.value_ptrs = value_ptrs

    @property
    def rows(self) -> int:
        return self.positions.shape[0]


def rows_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: RowTables,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """See :func:`petals_core.kernels._triton_rows.rows_append`."""
    from . import _triton_rows

    with _on(k.device):
        return _triton_rows.rows_append(q, k, v, tables, cos=cos, sin=sin)


def rows_decode_attention(
    q: torch.Tensor,
    n_kv_head: int,
    tables: RowTables,
    *,
    max_length: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`petals_core.kernels._triton_rows.rows_decode_attention`."""
    from . import _triton_rows

    with _on(q.device):
        return _triton_rows.rows_decode_attention(
            q, n_kv_head, tables, max_length=max_length, scale=scale, alibi_slopes=alibi_slopes
        )
