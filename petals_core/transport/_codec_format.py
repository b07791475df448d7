"""The wire format's vocabulary: CBOR major types, the tensor tag and its fields, the dtypes and
compression schemes a tensor may have, and :class:`CodecLimits`, which both directions apply.

The format itself is described in :mod:`petals_core.transport._codec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import attrs
from attrs import validators as v

from petals_core._errors import CodecError

from .._validators import in_range

__all__ = ["DEFAULT_LIMITS", "DTYPES", "CodecLimits"]

Scheme = Literal["float16", "blockwise8"]

#: Bytes per element of each dtype a tensor may have on the wire.
ITEM_BYTES: Final[Mapping[str, int]] = dict(
    float32=4, float16=2, bfloat16=2, int64=8, int32=4, int8=1, uint8=1, bool=1
)
DTYPES: Final = frozenset(ITEM_BYTES)
FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})
SCHEMES: Final = ("float16", "blockwise8")

TENSOR_TAG: Final = 42_000
BLOCK_ELEMENTS: Final = 256
PREFIX_BYTES: Final = 4

# CBOR major types.
UINT, NEGINT, BYTES, TEXT, ARRAY, MAP, TAG, SIMPLE = range(8)
# The layout of a tensor's array: dtype, shape, data, then scheme and scales when compressed.
TENSOR_FIELDS: Final = (TEXT, ARRAY, BYTES, TEXT, BYTES)


def _count(minimum: int, maximum: int) -> Callable[[Any, Any, Any], Any]:
    return v.and_(v.instance_of(int), in_range(minimum, maximum))


@attrs.frozen(kw_only=True)
class CodecLimits:
    """What one message may hold; a peer's message beyond any limit is refused."""

    #: Largest payload of one frame (the 4-byte length prefix caps it below 4 GiB).
    max_frame_bytes: int = attrs.field(default=512 << 20, validator=_count(1, 2**32 - 1))
    #: Deepest nesting of arrays and maps (capped far below Python's recursion limit).
    max_depth: int = attrs.field(default=32, validator=_count(1, 256))
    #: Array elements plus map entries, summed over the whole message.
    max_container_items: int = attrs.field(default=100_000, validator=_count(1, 2**63))
    max_tensor_elements: int = attrs.field(default=2**31, validator=_count(1, 2**63))
    max_tensor_dims: int = attrs.field(default=8, validator=_count(0, 64))
    #: Largest text string (UTF-8); byte strings are bounded by the frame alone.
    max_string_bytes: int = attrs.field(default=1 << 20, validator=_count(0, 2**32 - 1))

    def without_tensors(self) -> CodecLimits:
        """These limits for messages that hold no tensor (but a 0-dim one)."""
        return attrs.evolve(self, max_tensor_elements=1, max_tensor_dims=0)


DEFAULT_LIMITS: Final = CodecLimits()


def check_container(depth: int, items: int, limits: CodecLimits) -> None:
    if depth > limits.max_depth:
        raise CodecError(f"nesting deeper than {limits.max_depth}")
    if items > limits.max_container_items:
        raise CodecError(f"more than {limits.max_container_items} container items")


def check_tensor_limits(shape: Any, limits: CodecLimits) -> None:
    if len(shape) > limits.max_tensor_dims:
        raise CodecError(f"tensor of {len(shape)} dims exceeds {limits.max_tensor_dims}")
    if math.prod(shape) > limits.max_tensor_elements:
        raise CodecError(f"tensor exceeds {limits.max_tensor_elements} elements")


def payload_bytes(dtype: str, numel: int, compression: str | None) -> tuple[int, int]:
    """Sizes of ``data`` and ``scales`` for a tensor of ``numel`` elements."""
    if compression is None:
        return numel * ITEM_BYTES[dtype], 0
    if compression not in SCHEMES:
        raise CodecError(f"unknown compression scheme {compression!r}")
    if dtype not in FLOAT_DTYPES:
        raise CodecError(f"a {dtype} tensor cannot be compressed")
    if compression == "float16":
        return 2 * numel, 0
    return numel, 4 * -(-numel // BLOCK_ELEMENTS)


def size_error(
    dtype: str, shape: tuple[int, ...], compression: str | None, data: int, scales: int
) -> CodecError:
    return CodecError(
        f"{dtype} tensor of shape {shape} ({compression or 'plain'}) "
        f"needs {data} data and {scales} scale bytes"
    )
