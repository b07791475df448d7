"""What a decode graph's blocks attend through: each row's cache found by pointer in row tables.

A graph's step holds no session's cache: before each replay, the graph's device tables are
refilled with each row's position, head stride and the addresses of its keys and values per
block (:func:`row_tables` reads one block's view of them), and each block attends through a
:class:`RowCaches` over them.  Rotary angles come from :class:`RotaryTables`, shared by the
blocks of a span and grown with the longest session.  Graphs are kept per power-of-two
:func:`bucket` of rows and of lengths.
"""

from __future__ import annotations

import torch

from .. import kernels
from ._cache import PositionEncoding

__all__ = [
    "FIRST_POINTER",
    "HEAD_STRIDES",
    "POSITIONS",
    "RotaryTables",
    "RowCaches",
    "bucket",
    "row_tables",
]

#: Rows of the tables before the per-block pointers: positions, then head strides; then each
#: block's key pointers and value pointers.
POSITIONS, HEAD_STRIDES, FIRST_POINTER = 0, 1, 2


class RotaryTables:
    """cos and sin of every position a step may reach, ``(positions, head_dim)`` each in the
    blocks' dtype on their device; they grow with the longest session (None before)."""

    __slots__ = ("cos", "sin")

    def __init__(self) -> None:
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None


class RowCaches:
    """The :class:`~petals_core.models.AttentionCache` of one block in a decode graph's step: one
    new token per row, each row's cache found through the row tables (its position, its slabs
    of keys and values), rotary angles read by position from shared tables.  Attention splits
    each row's keys as for ``length_bucket`` positions."""

    static = True

    def __init__(self, tables: kernels.RowTables, length_bucket: int, angles: RotaryTables) -> None:
        self.tables = tables
        self.length_bucket = length_bucket
        self.angles = angles

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: PositionEncoding
    ) -> torch.Tensor:
        rows, new, heads, head_dim = q.shape  # (R, 1, n_head, head_dim)
        q, k, v = q[:, 0], k[:, 0], v[:, 0]  # (R, heads, head_dim)
        if positions.rotary is not None:
            cos, sin = self.angles.cos, self.angles.sin
            assert cos is not None and sin is not None
            rotated = kernels.rows_append(q, k, v, self.tables, cos=cos, sin=sin)
            assert rotated is not None
            q = rotated
        else:
            kernels.rows_append(q, k, v, self.tables)
        y = kernels.rows_decode_attention(
            q,
            k.shape[1],
            self.tables,
            max_length=self.length_bucket,
            alibi_slopes=positions.slopes_on(q.device),
        )
        return y.view(rows, new, heads * head_dim)


def row_tables(tables: torch.Tensor, block: int) -> kernels.RowTables:
    pointer = FIRST_POINTER + 2 * block
    return kernels.RowTables(
        positions=tables[POSITIONS],
        head_strides=tables[HEAD_STRIDES],
        key_ptrs=tables[pointer],
        value_ptrs=tables[pointer + 1],
    )


def bucket(value: int, minimum: int = 1) -> int:
    """The power of two at or above ``value`` (and ``minimum``)."""
    return max(minimum, 1 << (max(value, 1) - 1).bit_length())
