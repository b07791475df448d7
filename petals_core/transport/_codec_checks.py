"""The structure walk of untrusted bytes: every item head checked against the format and the
limits before cbor2 builds anything."""

from __future__ import annotations

from typing import Final

from petals_core._errors import CodecError

from ._codec_format import (
    ARRAY,
    BYTES,
    MAP,
    SIMPLE,
    TAG,
    TENSOR_FIELDS,
    TENSOR_TAG,
    TEXT,
    UINT,
    CodecLimits,
    check_container,
)

# false, true, null and half/single/double floats; the rest of major type 7 is refused.
_ALLOWED_SIMPLE: Final = frozenset({0xF4, 0xF5, 0xF6, 0xF9, 0xFA, 0xFB})
_MAX_NAME_BYTES: Final = 16  # room for the longest dtype or scheme name


def check_structure_untrusted(data: bytes, limits: CodecLimits) -> None:
    """Walk the item heads of ``data``; refuse anything beyond ``limits`` or the format.

    Strings are skipped rather than read, so this costs time per item, not per byte.  Item
    heads are read in line (see :func:`_head` for the same reading as a function): a step's
    message is walked while the caches are cold, and each call would cost more than its work.
    """
    end = len(data)
    max_depth, max_items = limits.max_depth, limits.max_container_items
    max_text = limits.max_string_bytes
    initial, length, pos = _head(data, 0)
    if initial >> 5 != MAP:
        raise CodecError("a message must be a CBOR map")
    items = length
    check_container(1, items, limits)
    # Items still due in each open container (maps count keys and values), and which are maps.
    due = [2 * length]
    is_map = [True]
    while due:
        remaining = due[-1]
        if remaining == 0:
            due.pop()
            is_map.pop()
            continue
        is_key = is_map[-1] and remaining % 2 == 0
        due[-1] = remaining - 1
        if pos >= end:
            raise CodecError("message is truncated")
        initial = data[pos]
        info = initial & 0x1F
        pos += 1
        if info < 24:
            argument = info
        elif info < 28:
            stop = pos + (1 << (info - 24))
            if stop > end:
                raise CodecError("message is truncated")
            argument = int.from_bytes(data[pos:stop], "big")
            pos = stop
        else:
            raise CodecError("indefinite lengths and reserved item heads are not allowed")
        major = initial >> 5
        if is_key and major != TEXT:
            raise CodecError("map keys must be text strings")
        if major in (TEXT, BYTES):
            if major == TEXT and argument > max_text:
                raise CodecError(f"text of {argument} bytes exceeds {max_text}")
            if argument > end - pos:
                raise CodecError("message is truncated")
            pos += argument
        elif major in (ARRAY, MAP):
            items += argument
            if len(due) + 1 > max_depth or items > max_items:
                check_container(len(due) + 1, items, limits)
            count = 2 * argument if major == MAP else argument
            if count > end - pos:  # every item takes at least one byte
                raise CodecError("container declares more items than the frame holds")
            due.append(count)
            is_map.append(major == MAP)
        elif major == TAG:
            if argument != TENSOR_TAG:
                raise CodecError(f"unknown CBOR tag {argument}")
            pos, items = _check_tensor_untrusted(data, pos, len(due) + 1, items, limits)
        elif major == SIMPLE and initial not in _ALLOWED_SIMPLE:
            raise CodecError("simple values other than false, true, null and floats")
    if pos != end:
        raise CodecError(f"{end - pos} bytes follow the message")


def _check_tensor_untrusted(
    data: bytes, pos: int, depth: int, items: int, limits: CodecLimits
) -> tuple[int, int]:
    """Check the layout of a tensor's array at ``pos``; return the position after it and the
    updated item count.  The field values are checked when the tensor is built."""
    initial, count, pos = _head(data, pos)
    if initial >> 5 != ARRAY or count not in (3, len(TENSOR_FIELDS)):
        raise CodecError("a tensor must be an array of 3 or 5 items")
    items += count
    check_container(depth, items, limits)
    end = len(data)
    for expected in TENSOR_FIELDS[:count]:
        initial, argument, pos = _head(data, pos)
        if initial >> 5 != expected:
            raise CodecError("tensor fields have the wrong types")
        if expected == ARRAY:
            if argument > limits.max_tensor_dims:
                raise CodecError(f"tensor of {argument} dims exceeds {limits.max_tensor_dims}")
            items += argument
            check_container(depth + 1, items, limits)
            for _ in range(argument):
                # A shape entry: an unsigned integer head (read in line, as in the walk).
                if pos >= end:
                    raise CodecError("message is truncated")
                initial = data[pos]
                info = initial & 0x1F
                if initial >> 5 != UINT:
                    raise CodecError("tensor shape entries must be non-negative integers")
                if info < 24:
                    pos += 1
                elif info < 28:
                    pos += 1 + (1 << (info - 24))
                    if pos > end:
                        raise CodecError("message is truncated")
                else:
                    raise CodecError("indefinite lengths and reserved item heads are not allowed")
        elif expected == TEXT and argument > _MAX_NAME_BYTES:
            raise CodecError("unknown tensor dtype or compression scheme")
        else:
            if argument > end - pos:
                raise CodecError("message is truncated")
            pos += argument
    return pos, items


def _head(data: bytes, pos: int) -> tuple[int, int, int]:
    """Read the item head at ``pos``: its initial byte, its argument and the position after it."""
    if pos >= len(data):
        raise CodecError("message is truncated")
    initial = data[pos]
    info = initial & 0x1F
    if info < 24:
        return initial, info, pos + 1
    if info > 27:
        raise CodecError("indefinite lengths and reserved item heads are not allowed")
    stop = pos + 1 + (1 << (info - 24))
    if stop > len(data):
        raise CodecError("message is truncated")
    return initial, int.from_bytes(data[pos + 1 : stop], "big"), stop
