"""The encoder: a message written as CBOR in one pass, the bytes cbor2 would write, under the
limits a peer will apply."""

from __future__ import annotations

import ctypes
import math
import struct
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from petals_core._errors import CodecError

from ._codec_format import (
    ARRAY,
    BYTES,
    ITEM_BYTES,
    MAP,
    NEGINT,
    PREFIX_BYTES,
    TENSOR_FIELDS,
    TENSOR_TAG,
    TEXT,
    UINT,
    CodecLimits,
    Scheme,
    check_container,
    check_tensor_limits,
)
from ._codec_tensors import Compressed, RawTensor, raw_from_torch, wire_names

if TYPE_CHECKING:
    import torch

_DOUBLE: Final = struct.Struct(">d")

#: The head of each major type with an argument below 24: one byte.
_SHORT_HEADS: Final = tuple(
    tuple(bytes((major << 5 | n,)) for n in range(24)) for major in range(8)
)
_FALSE, _TRUE, _NULL = b"\xf4", b"\xf5", b"\xf6"
# Floats as cbor2 writes them: double precision, except the non-finite ones in half precision.
_HALF_FLOATS: Final = {math.inf: b"\xf9\x7c\x00", -math.inf: b"\xf9\xfc\x00"}
_HALF_NAN: Final = b"\xf9\x7e\x00"
_TENSOR_HEAD: Final = b"\xd9" + TENSOR_TAG.to_bytes(2, "big")

#: Texts of up to this many UTF-8 bytes are kept encoded (with their head) once written, up to
#: ``_MAX_SHORT_TEXTS`` of them per process: message keys, dtype names, method names.
_SHORT_TEXT_BYTES: Final = 32
_MAX_SHORT_TEXTS: Final = 512
_SHORT_TEXTS: dict[str, tuple[bytes, int]] = {}


def encode_parts(msg: Mapping[str, Any], limits: CodecLimits, *, prefix: bool) -> list[bytes]:
    """The payload of ``msg`` in parts, behind its 4-byte length when ``prefix``."""
    if type(msg) is not dict and not isinstance(msg, Mapping):
        raise CodecError(f"a message must be a mapping, not {type(msg).__name__}")
    writer = _Writer(limits)
    if prefix:
        writer.parts.append(b"")  # the length, once known
    writer.write(msg, depth=1)
    size = sum(map(len, writer.parts))
    if size > limits.max_frame_bytes:
        raise CodecError(f"message of {size} bytes exceeds {limits.max_frame_bytes}")
    if prefix:
        writer.parts[0] = size.to_bytes(PREFIX_BYTES, "big")
    return writer.parts


def _item_head(major: int, argument: int) -> bytes:
    if argument < 24:
        return _SHORT_HEADS[major][argument]
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if argument < 1 << (8 * width):
            return bytes((major << 5 | info,)) + argument.to_bytes(width, "big")
    raise CodecError(f"integer {argument} does not fit in 64 bits")


class _Writer:
    """Writes a message as CBOR in one pass (what cbor2 would write, byte for byte), applying
    the limits a peer will apply; ``parts`` joined are the payload.

    The common items (short texts, small integers, a dense CPU tensor) are written with few
    Python calls: a step's message is encoded while the caches are cold.
    """

    def __init__(self, limits: CodecLimits) -> None:
        self._limits = limits
        self._items = 0
        self.parts: list[bytes] = []
        self._put = self.parts.append

    def write(self, value: Any, depth: int) -> None:
        """``depth`` is the depth that ``value`` would have if it were a container."""
        kind = type(value)
        if kind is str:
            self._text(value)
        elif kind is int:
            if 0 <= value < 24:
                self._put(_SHORT_HEADS[UINT][value])
            else:
                self._int(value)
        elif kind is dict:
            self._map(value, depth)
        elif value is None:
            self._put(_NULL)
        elif kind is bool:
            self._put(_TRUE if value else _FALSE)
        elif kind is list or kind is tuple:
            self._array(value, depth)
        elif kind is float:
            self._float(value)
        else:
            self._other(value, depth)

    def _other(self, value: Any, depth: int) -> None:
        # Tensors (the common case, checked first: a tensor is none of the types below), then
        # subclasses of the plain types and buffers.
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(value, torch.Tensor):
            if not self._plain_tensor(value, depth):
                self._tensor(value.shape, depth, None, lambda: raw_from_torch(value, None))
        elif isinstance(value, bool):
            self._put(_TRUE if value else _FALSE)
        elif isinstance(value, float):
            self._float(float(value))
        elif isinstance(value, int):
            self._int(int(value))
        elif isinstance(value, str):
            self._text(str(value))
        elif isinstance(value, bytes | bytearray | memoryview):
            self._bytes(bytes(value))
        elif isinstance(value, Mapping):
            self._map(value, depth)
        elif isinstance(value, list | tuple):
            self._array(value, depth)
        elif isinstance(value, RawTensor):
            self._tensor(value.shape, depth, value.compression, lambda: value)
        elif isinstance(value, Compressed):
            tensor, scheme = value.tensor, value.scheme
            self._tensor(tensor.shape, depth, scheme, lambda: raw_from_torch(tensor, scheme))
        else:
            raise CodecError(f"cannot encode a value of type {type(value).__name__}")

    def _enter(self, depth: int, items: int) -> None:
        self._items += items
        if depth > self._limits.max_depth or self._items > self._limits.max_container_items:
            check_container(depth, self._items, self._limits)

    def _int(self, value: int) -> None:
        if not -(2**64) <= value < 2**64:
            raise CodecError(f"integer {value} does not fit in 64 bits")
        self._put(_item_head(UINT, value) if value >= 0 else _item_head(NEGINT, -1 - value))

    def _float(self, value: float) -> None:
        if value != value:
            self._put(_HALF_NAN)
        else:
            self._put(_HALF_FLOATS.get(value) or b"\xfb" + _DOUBLE.pack(value))

    def _text(self, text: str) -> None:
        known = _SHORT_TEXTS.get(text)
        if known is not None:
            encoded, size = known
            if size > self._limits.max_string_bytes:
                raise CodecError(f"text of {size} bytes exceeds {self._limits.max_string_bytes}")
            self._put(encoded)
            return
        try:
            data = text.encode()
        except UnicodeEncodeError as exc:
            raise CodecError(f"text is not valid UTF-8: {exc}") from exc
        if len(data) > self._limits.max_string_bytes:
            raise CodecError(f"text of {len(data)} bytes exceeds {self._limits.max_string_bytes}")
        head = _item_head(TEXT, len(data))
        if len(data) <= _SHORT_TEXT_BYTES and len(_SHORT_TEXTS) < _MAX_SHORT_TEXTS:
            # Keys and names recur in every message: keep them encoded.
            _SHORT_TEXTS[text] = (head + data, len(data))
        self._put(head)
        self._put(data)

    def _bytes(self, data: bytes) -> None:
        self._put(_item_head(BYTES, len(data)))
        self._put(data)

    def _map(self, value: Mapping[Any, Any], depth: int) -> None:
        self._enter(depth, len(value))
        size = len(value)
        self._put(_SHORT_HEADS[MAP][size] if size < 24 else _item_head(MAP, size))
        text, write = self._text, self.write
        for key, item in value.items():
            if not isinstance(key, str):
                raise CodecError(f"map keys must be str, not {type(key).__name__}")
            text(key)
            write(item, depth + 1)

    def _array(self, value: list[Any] | tuple[Any, ...], depth: int) -> None:
        self._enter(depth, len(value))
        self._put(
            _SHORT_HEADS[ARRAY][len(value)] if len(value) < 24 else _item_head(ARRAY, len(value))
        )
        for item in value:
            self.write(item, depth + 1)

    def _plain_tensor(self, tensor: torch.Tensor, depth: int) -> bool:
        """Write a dense, contiguous CPU tensor straight from its memory (the common case, kept
        short: a step's few small tensors are written while the caches are cold); False for
        any other tensor."""
        import torch

        name = wire_names().get(tensor.dtype)
        if name is None or tensor.layout is not torch.strided or not tensor.is_cpu:
            return False
        if not tensor.is_contiguous():
            return False
        shape = tuple(tensor.shape)
        self._enter(depth, 3)
        self._enter(depth + 1, len(shape))
        limits = self._limits
        if len(shape) > limits.max_tensor_dims or math.prod(shape) > limits.max_tensor_elements:
            check_tensor_limits(shape, limits)
        size = math.prod(shape) * ITEM_BYTES[name]
        self._tensor_fields(name, shape, ctypes.string_at(tensor.data_ptr(), size) if size else b"")
        return True

    def _tensor(
        self,
        shape: tuple[int, ...],
        depth: int,
        compression: Scheme | None,
        build: Callable[[], RawTensor],
    ) -> None:
        # Limits are checked on the shape before any bytes are copied or compressed.
        self._tensor_limits(shape, depth, compression)
        try:
            raw = build()
        except RuntimeError as exc:  # e.g. a meta tensor, or a device that failed
            raise CodecError(f"cannot encode tensor: {exc}") from exc
        self._tensor_fields(
            raw.dtype, raw.shape, bytes(raw.data), raw.compression, bytes(raw.scales)
        )

    def _tensor_limits(self, shape: tuple[int, ...], depth: int, compression: str | None) -> None:
        self._enter(depth, len(TENSOR_FIELDS) if compression else 3)
        self._enter(depth + 1, len(shape))
        check_tensor_limits(shape, self._limits)

    def _tensor_fields(
        self,
        dtype: str,
        shape: tuple[int, ...],
        data: bytes,
        compression: str | None = None,
        scales: bytes = b"",
    ) -> None:
        put = self._put
        put(_TENSOR_HEAD)
        put(_SHORT_HEADS[ARRAY][3 if compression is None else 5])
        self._text(dtype)
        put(_SHORT_HEADS[ARRAY][len(shape)] if len(shape) < 24 else _item_head(ARRAY, len(shape)))
        for size in shape:
            put(_SHORT_HEADS[UINT][size] if size < 24 else _item_head(UINT, size))
        self._bytes(data)
        if compression is not None:
            self._text(compression)
            self._bytes(scales)
