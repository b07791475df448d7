"""Wire codec: length-prefixed CBOR maps that may carry tensors.

Frames
    A frame is a 4-byte big-endian payload length followed by the payload.  A payload is one
    CBOR data item (RFC 8949): a map with text keys.  Values are null, booleans, integers in
    [-2**64, 2**64), floats, text, byte strings, arrays, maps (text keys everywhere) and tensors.
    Every length is definite, and nothing may follow the map.

Tensors
    A tensor is CBOR tag 42000 around an array, either ``[dtype, shape, data]`` or, compressed,
    ``[dtype, shape, data, scheme, scales]``.  ``dtype`` is one of :data:`DTYPES`, ``shape`` an
    array of non-negative integers and ``data`` the elements in C order, little-endian (bfloat16
    as its raw 16 bits, bool as one byte, 0 or 1, per element).  When compressed, ``dtype`` and
    ``shape`` still describe the original tensor, and ``scheme`` says what ``data`` holds:

    - ``"float16"``: the elements as IEEE half floats; ``scales`` is empty.
    - ``"blockwise8"``: the flattened elements cut into blocks of 256 (the last may be shorter);
      ``data`` holds one int8 code per element and ``scales`` one little-endian float32 per
      block.  An element decodes as ``code * scale`` with ``scale = absmax(block) / 127``, so it
      is off by at most ``absmax(block) / 254`` before rounding to the original dtype (blocks
      whose absmax is below 127 times the smallest normal float32, about 1.5e-36, have a scale
      that underflows and decode as zeros).

Nesting depth counts arrays and maps: the top-level map is at depth 1, and a tensor takes two
levels (its array and its shape).  Container items are array elements plus map entries, the
tensors' arrays included.  :func:`encode_message` applies the same limits as the decoder, so a
message that encodes is one that a peer with the same limits accepts.  It writes the CBOR itself,
in one pass (the bytes cbor2 would write), and takes a dense CPU tensor's elements straight from
its memory; the decoder likewise builds an uncompressed tensor without the :class:`RawTensor`
detour.  A decode step runs while the caches are cold (the process has just woken for it), when
every Python call and torch attribute costs several times its warm price.

:class:`CodecError` covers both directions: a value we cannot send, bytes we cannot accept.
:func:`decode_message_untrusted` walks the item heads before cbor2 builds anything, so lengths,
nesting and tags are checked against the limits and the frame's real size first, and no cbor2
extension (shared or string references, sets, regular expressions, bignums...) is reachable.

Only functions that build tensors import torch: a program without it still sends and receives
tensors as :class:`RawTensor`.  Like torch, the codec assumes a little-endian host.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, Literal, TypeGuard

import attrs
import cbor2
from attrs import validators as v

from petals_core._errors import CodecError
from petals_core._validators import in_range

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_LIMITS",
    "DTYPES",
    "CodecLimits",
    "Compressed",
    "FrameDecoder",
    "RawTensor",
    "compress",
    "decode_message_untrusted",
    "encode_frame",
    "encode_message",
]

Scheme = Literal["float16", "blockwise8"]

#: Bytes per element of each dtype a tensor may have on the wire.
_ITEM_BYTES: Final[Mapping[str, int]] = dict(
    float32=4, float16=2, bfloat16=2, int64=8, int32=4, int8=1, uint8=1, bool=1
)
DTYPES: Final = frozenset(_ITEM_BYTES)
_FLOAT_DTYPES: Final = frozenset({"float32", "float16", "bfloat16"})
_SCHEMES: Final = ("float16", "blockwise8")

_TENSOR_TAG: Final = 42_000
_BLOCK_ELEMENTS: Final = 256
_PREFIX_BYTES: Final = 4
_DOUBLE: Final = struct.Struct(">d")
# Smaller buffers are copied into a tensor rather than shared: CPython shares its one-byte bytes
# objects, and a tensor over one of those must never be written to.
_ZERO_COPY_MIN_BYTES: Final = 4096

# CBOR major types.
_UINT, _NEGINT, _BYTES, _TEXT, _ARRAY, _MAP, _TAG, _SIMPLE = range(8)
# false, true, null and half/single/double floats; the rest of major type 7 is refused.
_ALLOWED_SIMPLE: Final = frozenset({0xF4, 0xF5, 0xF6, 0xF9, 0xFA, 0xFB})
_MAX_NAME_BYTES: Final = 16  # room for the longest dtype or scheme name
# The layout of a tensor's array: dtype, shape, data, then scheme and scales when compressed.
_TENSOR_FIELDS: Final = (_TEXT, _ARRAY, _BYTES, _TEXT, _BYTES)


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


DEFAULT_LIMITS: Final = CodecLimits()


def _to_shape(sizes: Iterable[int]) -> tuple[int, ...]:
    return tuple(sizes)


@attrs.frozen(eq=True)
class RawTensor:
    """A tensor in its wire form, for programs that do not use torch.

    ``data`` holds the elements as described in the module docstring; when ``compression`` is
    set, it holds the compressed payload and ``scales`` the blockwise8 scales, while ``dtype``
    and ``shape`` describe the original tensor.  Invalid fields raise :class:`CodecError`.
    """

    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_to_shape)
    data: bytes | memoryview = attrs.field(repr=False)
    compression: Scheme | None = attrs.field(default=None, kw_only=True)
    scales: bytes | memoryview = attrs.field(default=b"", kw_only=True, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in _ITEM_BYTES:
            raise CodecError(f"unsupported tensor dtype {self.dtype!r}")
        if not all(type(size) is int and size >= 0 for size in self.shape):
            raise CodecError(f"tensor shape {self.shape!r} is not a tuple of non-negative ints")
        data_bytes, scales_bytes = _payload_bytes(self.dtype, self.numel, self.compression)
        if _buffer_bytes(self.data) != data_bytes or _buffer_bytes(self.scales) != scales_bytes:
            raise _size_error(self.dtype, self.shape, self.compression, data_bytes, scales_bytes)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_torch(self) -> torch.Tensor:
        """Build the torch tensor, decompressing if need be.

        An uncompressed tensor of 4 KiB or more shares memory with ``data`` rather than copying.
        """
        import torch

        dtype = getattr(torch, self.dtype)
        if self.compression is None:
            return _tensor_from_buffer(self.data, dtype, self.shape)
        if self.compression == "float16":
            return _tensor_from_buffer(self.data, torch.float16, self.shape).to(dtype)
        blocks = -(-self.numel // _BLOCK_ELEMENTS)
        scales = _tensor_from_buffer(self.scales, torch.float32, (blocks, 1))
        padded = torch.zeros(blocks * _BLOCK_ELEMENTS, dtype=torch.float32)
        padded[: self.numel] = _tensor_from_buffer(self.data, torch.int8, (self.numel,))
        values = padded.view(blocks, _BLOCK_ELEMENTS).mul_(scales).view(-1)
        return values[: self.numel].to(dtype).view(self.shape)


@attrs.frozen(eq=False)
class Compressed:
    """Marks a floating-point torch tensor to be sent compressed with ``scheme``.

    The receiver gets a tensor of the original dtype and shape back.  ``"float16"`` rounds to
    half precision (values beyond its range become infinite); ``"blockwise8"`` quantizes to
    8 bits per element plus one scale per 256 elements, and refuses non-finite values.
    """

    tensor: torch.Tensor
    scheme: Scheme

    def __attrs_post_init__(self) -> None:
        if self.scheme not in _SCHEMES:
            raise CodecError(f"unknown compression scheme {self.scheme!r}; use one of {_SCHEMES}")
        if _torch_dtype_name(self.tensor) not in _FLOAT_DTYPES:
            raise CodecError(f"only {sorted(_FLOAT_DTYPES)} torch tensors can be compressed")


def compress(tensor: torch.Tensor, scheme: Scheme) -> Compressed:
    """Mark ``tensor`` to be sent compressed; see :class:`Compressed`."""
    return Compressed(tensor, scheme)


def encode_message(msg: Mapping[str, Any], *, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``msg`` as one CBOR map; raises :class:`CodecError` for what a peer would refuse."""
    return b"".join(_encode_parts(msg, limits, prefix=False))


def encode_frame(msg: Mapping[str, Any], *, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``msg`` behind its 4-byte big-endian length."""
    return b"".join(_encode_parts(msg, limits, prefix=True))


def _encode_parts(msg: Mapping[str, Any], limits: CodecLimits, *, prefix: bool) -> list[bytes]:
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
        writer.parts[0] = size.to_bytes(_PREFIX_BYTES, "big")
    return writer.parts


def decode_message_untrusted(
    data: bytes | bytearray | memoryview,
    *,
    limits: CodecLimits = DEFAULT_LIMITS,
    tensors: Literal["torch", "raw"] = "torch",
) -> dict[str, Any]:
    """Decode one frame payload from a peer.

    Tensors come back as torch tensors, or as :class:`RawTensor` (still compressed, if they
    were) when ``tensors="raw"``.  Whatever the bytes, the only exception is
    :class:`CodecError`; an invalid ``tensors`` argument is a ``ValueError``.
    """
    if tensors not in ("torch", "raw"):
        raise ValueError(f"tensors must be 'torch' or 'raw', not {tensors!r}")
    try:
        # cbor2 copies any other buffer into bytes anyway.
        payload = data if isinstance(data, bytes) else bytes(data)
        if len(payload) > limits.max_frame_bytes:
            raise CodecError(f"message of {len(payload)} bytes exceeds {limits.max_frame_bytes}")
        _check_structure_untrusted(payload, limits)
        message: dict[str, Any] = cbor2.loads(
            payload,
            semantic_decoders=_TagDecoders(limits, tensors),
            allow_indefinite=False,
            allow_duplicate_keys=False,
            strict_hashable_types=True,
            # A backstop only: the walk above already enforced the depth, and cbor2 counts the
            # tensor tag as one more level.
            max_depth=limits.max_depth + 1,
        )
    except CodecError:
        raise
    except Exception as exc:
        # cbor2 wraps what our tag decoder raised; report our own message where there is one.
        detail = exc.__cause__ if isinstance(exc.__cause__, CodecError) else exc
        raise CodecError(f"malformed message: {detail}") from exc
    return message


class FrameDecoder:
    """Cuts a byte stream into frame payloads (sans-IO).

    ``feed`` bytes as they arrive, then call ``next_frame`` until it returns None.  A declared
    length above ``max_frame_bytes`` raises :class:`CodecError` from ``feed`` as soon as its
    4-byte prefix is in, before any of its payload is buffered; from then on ``feed`` raises
    again, and ``next_frame`` returns the frames before it, then raises too.
    """

    def __init__(self, limits: CodecLimits = DEFAULT_LIMITS) -> None:
        self._max_frame_bytes = limits.max_frame_bytes
        self._buffer = bytearray()
        self._unchecked = 0  # where in the buffer the first frame prefix not yet checked starts

    @property
    def buffered_bytes(self) -> int:
        """Bytes held for frames not yet returned."""
        return len(self._buffer)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._check_prefixes()
        self._buffer += data
        self._check_prefixes()

    def next_frame(self) -> bytes | None:
        """The next complete payload, or None until one is complete."""
        if self._unchecked == 0:  # no prefix, or a refused one
            self._check_prefixes()
            return None
        end = _PREFIX_BYTES + int.from_bytes(self._buffer[:_PREFIX_BYTES], "big")
        if len(self._buffer) < end:
            return None
        with memoryview(self._buffer) as view:
            # bytes, not bytearray: cbor2 would copy anything else once more.
            payload = bytes(view[_PREFIX_BYTES:end])
        # Cheap however large the buffer: CPython's bytearray drops its head by moving a pointer.
        del self._buffer[:end]
        self._unchecked -= end
        return payload

    def _check_prefixes(self) -> None:
        # Each prefix is checked once, as soon as it is complete.
        while self._unchecked + _PREFIX_BYTES <= len(self._buffer):
            prefix = self._buffer[self._unchecked : self._unchecked + _PREFIX_BYTES]
            length = int.from_bytes(prefix, "big")
            if length > self._max_frame_bytes:
                raise CodecError(f"a {length}-byte frame exceeds {self._max_frame_bytes}")
            self._unchecked += _PREFIX_BYTES + length


#: The head of each major type with an argument below 24: one byte.
_SHORT_HEADS: Final = tuple(
    tuple(bytes((major << 5 | n,)) for n in range(24)) for major in range(8)
)
_FALSE, _TRUE, _NULL = b"\xf4", b"\xf5", b"\xf6"
# Floats as cbor2 writes them: double precision, except the non-finite ones in half precision.
_HALF_FLOATS: Final = {math.inf: b"\xf9\x7c\x00", -math.inf: b"\xf9\xfc\x00"}
_HALF_NAN: Final = b"\xf9\x7e\x00"
_TENSOR_HEAD: Final = b"\xd9" + _TENSOR_TAG.to_bytes(2, "big")


#: Texts of up to this many UTF-8 bytes are kept encoded (with their head) once written, up to
#: ``_MAX_SHORT_TEXTS`` of them per process: message keys, dtype names, method names.
_SHORT_TEXT_BYTES: Final = 32
_MAX_SHORT_TEXTS: Final = 512
_SHORT_TEXTS: dict[str, tuple[bytes, int]] = {}


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
                self._put(_SHORT_HEADS[_UINT][value])
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
                self._tensor(value.shape, depth, None, lambda: _raw_from_torch(value, None))
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
            self._tensor(tensor.shape, depth, scheme, lambda: _raw_from_torch(tensor, scheme))
        else:
            raise CodecError(f"cannot encode a value of type {type(value).__name__}")

    def _enter(self, depth: int, items: int) -> None:
        self._items += items
        if depth > self._limits.max_depth or self._items > self._limits.max_container_items:
            _check_container(depth, self._items, self._limits)

    def _int(self, value: int) -> None:
        if not -(2**64) <= value < 2**64:
            raise CodecError(f"integer {value} does not fit in 64 bits")
        self._put(_item_head(_UINT, value) if value >= 0 else _item_head(_NEGINT, -1 - value))

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
        head = _item_head(_TEXT, len(data))
        if len(data) <= _SHORT_TEXT_BYTES and len(_SHORT_TEXTS) < _MAX_SHORT_TEXTS:
            # Keys and names recur in every message: keep them encoded.
            _SHORT_TEXTS[text] = (head + data, len(data))
        self._put(head)
        self._put(data)

    def _bytes(self, data: bytes) -> None:
        self._put(_item_head(_BYTES, len(data)))
        self._put(data)

    def _map(self, value: Mapping[Any, Any], depth: int) -> None:
        self._enter(depth, len(value))
        size = len(value)
        self._put(_SHORT_HEADS[_MAP][size] if size < 24 else _item_head(_MAP, size))
        text, write = self._text, self.write
        for key, item in value.items():
            if not isinstance(key, str):
                raise CodecError(f"map keys must be str, not {type(key).__name__}")
            text(key)
            write(item, depth + 1)

    def _array(self, value: list[Any] | tuple[Any, ...], depth: int) -> None:
        self._enter(depth, len(value))
        self._put(
            _SHORT_HEADS[_ARRAY][len(value)] if len(value) < 24 else _item_head(_ARRAY, len(value))
        )
        for item in value:
            self.write(item, depth + 1)

    def _plain_tensor(self, tensor: torch.Tensor, depth: int) -> bool:
        """Write a dense, contiguous CPU tensor straight from its memory (the common case, kept
        short: a step's few small tensors are written while the caches are cold); False for
        any other tensor."""
        import torch

        name = _wire_names().get(tensor.dtype)
        if name is None or tensor.layout is not torch.strided or not tensor.is_cpu:
            return False
        if not tensor.is_contiguous():
            return False
        shape = tuple(tensor.shape)
        self._enter(depth, 3)
        self._enter(depth + 1, len(shape))
        limits = self._limits
        if len(shape) > limits.max_tensor_dims or math.prod(shape) > limits.max_tensor_elements:
            _check_tensor_limits(shape, limits)
        size = math.prod(shape) * _ITEM_BYTES[name]
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
        self._enter(depth, len(_TENSOR_FIELDS) if compression else 3)
        self._enter(depth + 1, len(shape))
        _check_tensor_limits(shape, self._limits)

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
        put(_SHORT_HEADS[_ARRAY][3 if compression is None else 5])
        self._text(dtype)
        put(_SHORT_HEADS[_ARRAY][len(shape)] if len(shape) < 24 else _item_head(_ARRAY, len(shape)))
        for size in shape:
            put(_SHORT_HEADS[_UINT][size] if size < 24 else _item_head(_UINT, size))
        self._bytes(data)
        if compression is not None:
            self._text(compression)
            self._bytes(scales)


class _TagDecoders(dict[int, Callable[[Any, bool], Any]]):
    """cbor2's semantic decoders for every tag number: ours for tensors, a refusal for the rest.

    Covering every number keeps cbor2's own tag decoders (sets, references, regular
    expressions...) out of reach even if the structure walk missed a tag.
    """

    def __init__(self, limits: CodecLimits, tensors: Literal["torch", "raw"]) -> None:
        super().__init__({_TENSOR_TAG: self._decode_tensor})
        self._limits = limits
        self._tensors = tensors

    def __missing__(self, tag: int) -> Callable[[Any, bool], Any]:
        # Raised at lookup, so cbor2 refuses the tag before decoding what it wraps.
        raise CodecError(f"unknown CBOR tag {tag}")

    def _decode_tensor(self, fields: Any, immutable: bool) -> Any:
        # The structure walk guaranteed the field types; what is left is their values.
        if len(fields) == 3 and self._tensors == "torch":
            dtype, shape, data = fields
            return _decode_plain_tensor(dtype, shape, data, self._limits)
        dtype, shape, data = fields[:3]
        compression, scales = fields[3:] if len(fields) == 5 else (None, b"")
        _check_tensor_limits(shape, self._limits)
        raw = RawTensor(dtype, shape, data, compression=compression, scales=scales)
        if dtype == "bool" and compression is None:
            _check_bool_bytes(data)
        return raw.to_torch() if self._tensors == "torch" else raw


def _decode_plain_tensor(
    dtype: str, shape: list[int], data: bytes, limits: CodecLimits
) -> torch.Tensor:
    """An uncompressed tensor from a peer as a torch tensor: what ``RawTensor(...).to_torch()``
    gives, checked the same, in fewer steps (a step's tensors decode while the caches are cold)."""
    if dtype not in _ITEM_BYTES:
        raise CodecError(f"unsupported tensor dtype {dtype!r}")
    _check_tensor_limits(shape, limits)
    size = tuple(shape)
    data_bytes, _ = _payload_bytes(dtype, math.prod(size), None)
    if len(data) != data_bytes:
        raise _size_error(dtype, size, None, data_bytes, 0)
    if dtype == "bool":
        _check_bool_bytes(data)
    return _tensor_from_buffer(data, _torch_dtypes()[dtype], size)


def _size_error(
    dtype: str, shape: tuple[int, ...], compression: str | None, data: int, scales: int
) -> CodecError:
    return CodecError(
        f"{dtype} tensor of shape {shape} ({compression or 'plain'}) "
        f"needs {data} data and {scales} scale bytes"
    )


def _check_bool_bytes(data: bytes) -> None:
    if data.translate(None, b"\x00\x01"):
        raise CodecError("bool tensor holds bytes other than 0 and 1")


def _check_structure_untrusted(data: bytes, limits: CodecLimits) -> None:
    """Walk the item heads of ``data``; refuse anything beyond ``limits`` or the format.

    Strings are skipped rather than read, so this costs time per item, not per byte.  Item
    heads are read in line (see :func:`_head` for the same reading as a function): a step's
    message is walked while the caches are cold, and each call would cost more than its work.
    """
    end = len(data)
    max_depth, max_items = limits.max_depth, limits.max_container_items
    max_text = limits.max_string_bytes
    initial, length, pos = _head(data, 0)
    if initial >> 5 != _MAP:
        raise CodecError("a message must be a CBOR map")
    items = length
    _check_container(1, items, limits)
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
        if is_key and major != _TEXT:
            raise CodecError("map keys must be text strings")
        if major in (_TEXT, _BYTES):
            if major == _TEXT and argument > max_text:
                raise CodecError(f"text of {argument} bytes exceeds {max_text}")
            if argument > end - pos:
                raise CodecError("message is truncated")
            pos += argument
        elif major in (_ARRAY, _MAP):
            items += argument
            if len(due) + 1 > max_depth or items > max_items:
                _check_container(len(due) + 1, items, limits)
            count = 2 * argument if major == _MAP else argument
            if count > end - pos:  # every item takes at least one byte
                raise CodecError("container declares more items than the frame holds")
            due.append(count)
            is_map.append(major == _MAP)
        elif major == _TAG:
            if argument != _TENSOR_TAG:
                raise CodecError(f"unknown CBOR tag {argument}")
            pos, items = _check_tensor_untrusted(data, pos, len(due) + 1, items, limits)
        elif major == _SIMPLE and initial not in _ALLOWED_SIMPLE:
            raise CodecError("simple values other than false, true, null and floats")
    if pos != end:
        raise CodecError(f"{end - pos} bytes follow the message")


def _check_tensor_untrusted(
    data: bytes, pos: int, depth: int, items: int, limits: CodecLimits
) -> tuple[int, int]:
    """Check the layout of a tensor's array at ``pos``; return the position after it and the
    updated item count.  The field values are checked when the tensor is built."""
    initial, count, pos = _head(data, pos)
    if initial >> 5 != _ARRAY or count not in (3, len(_TENSOR_FIELDS)):
        raise CodecError("a tensor must be an array of 3 or 5 items")
    items += count
    _check_container(depth, items, limits)
    end = len(data)
    for expected in _TENSOR_FIELDS[:count]:
        initial, argument, pos = _head(data, pos)
        if initial >> 5 != expected:
            raise CodecError("tensor fields have the wrong types")
        if expected == _ARRAY:
            if argument > limits.max_tensor_dims:
                raise CodecError(f"tensor of {argument} dims exceeds {limits.max_tensor_dims}")
            items += argument
            _check_container(depth + 1, items, limits)
            for _ in range(argument):
                # A shape entry: an unsigned integer head (read in line, as in the walk).
                if pos >= end:
                    raise CodecError("message is truncated")
                initial = data[pos]
                info = initial & 0x1F
                if initial >> 5 != _UINT:
                    raise CodecError("tensor shape entries must be non-negative integers")
                if info < 24:
                    pos += 1
                elif info < 28:
                    pos += 1 + (1 << (info - 24))
                    if pos > end:
                        raise CodecError("message is truncated")
                else:
                    raise CodecError("indefinite lengths and reserved item heads are not allowed")
        elif expected == _TEXT and argument > _MAX_NAME_BYTES:
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


def _skip(data: bytes, pos: int, size: int) -> int:
    if size > len(data) - pos:
        raise CodecError("message is truncated")
    return pos + size


def _check_container(depth: int, items: int, limits: CodecLimits) -> None:
    if depth > limits.max_depth:
        raise CodecError(f"nesting deeper than {limits.max_depth}")
    if items > limits.max_container_items:
        raise CodecError(f"more than {limits.max_container_items} container items")


def _check_tensor_limits(shape: Any, limits: CodecLimits) -> None:
    if len(shape) > limits.max_tensor_dims:
        raise CodecError(f"tensor of {len(shape)} dims exceeds {limits.max_tensor_dims}")
    if math.prod(shape) > limits.max_tensor_elements:
        raise CodecError(f"tensor exceeds {limits.max_tensor_elements} elements")


def _payload_bytes(dtype: str, numel: int, compression: str | None) -> tuple[int, int]:
    """Sizes of ``data`` and ``scales`` for a tensor of ``numel`` elements."""
    if compression is None:
        return numel * _ITEM_BYTES[dtype], 0
    if compression not in _SCHEMES:
        raise CodecError(f"unknown compression scheme {compression!r}")
    if dtype not in _FLOAT_DTYPES:
        raise CodecError(f"a {dtype} tensor cannot be compressed")
    if compression == "float16":
        return 2 * numel, 0
    return numel, 4 * -(-numel // _BLOCK_ELEMENTS)


def _buffer_bytes(buffer: bytes | memoryview) -> int:
    with memoryview(buffer) as view:
        if not view.c_contiguous:
            raise CodecError("tensor buffers must be contiguous")
        return view.nbytes


@functools.cache
def _wire_names() -> dict[torch.dtype, str]:
    """Each torch dtype that has a wire name, with it (torch is imported by then)."""
    import torch

    return {getattr(torch, name): name for name in _ITEM_BYTES}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    return {name: dtype for dtype, name in _wire_names().items()}


def _is_torch_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a torch tensor (only an already imported torch is consulted)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_dtype_name(value: object) -> str | None:
    """The wire name of ``value``'s dtype if it is a torch tensor, else None.

    Only an already imported torch is consulted, so that the codec never imports it.
    """
    if not _is_torch_tensor(value):
        return None
    return str(value.dtype).removeprefix("torch.")


def _raw_from_torch(tensor: torch.Tensor, scheme: Scheme | None) -> RawTensor:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _ITEM_BYTES or tensor.layout != torch.strided:
        raise CodecError(f"cannot encode a {tensor.layout} tensor of {tensor.dtype}")
    tensor = tensor.detach()
    if scheme is None:
        return RawTensor(name, tensor.shape, _tensor_bytes(tensor))
    if scheme == "float16":
        data = _tensor_bytes(tensor.to(torch.float16))
        return RawTensor(name, tensor.shape, data, compression=scheme)
    # Quantize where the tensor lives, so that only codes and scales cross to the CPU.
    flat = tensor.reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // _BLOCK_ELEMENTS)
    padded = torch.nn.functional.pad(flat, (0, blocks * _BLOCK_ELEMENTS - flat.numel()))
    padded = padded.view(blocks, _BLOCK_ELEMENTS)
    scales = padded.abs().amax(dim=1) / 127
    if not bool(torch.isfinite(scales).all()):
        raise CodecError("blockwise8 compression needs finite values")
    divisors = torch.where(scales > 0, scales, 1.0)  # an all-zero block has codes of 0
    codes = torch.round(padded / divisors[:, None]).clamp_(-127, 127).to(torch.int8)
    data = _tensor_bytes(codes.view(-1)[: flat.numel()])
    return RawTensor(name, tensor.shape, data, compression=scheme, scales=_tensor_bytes(scales))


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The elements of ``tensor`` in C order, copied once to the CPU and without numpy."""
    cpu = tensor.to("cpu").contiguous()
    size = cpu.numel() * cpu.element_size()
    return ctypes.string_at(cpu.data_ptr(), size) if size else b""


def _tensor_from_buffer(
    buffer: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    import torch

    with memoryview(buffer) as view, view.cast("B") as octets:
        if octets.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if octets.nbytes < _ZERO_COPY_MIN_BYTES:
            return torch.frombuffer(bytearray(octets), dtype=dtype).view(shape)
    # torch warns about read-only buffers once per process; sharing one is the point here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        flat = torch.frombuffer(buffer, dtype=dtype)
    if flat.data_ptr() % flat.element_size():  # a misaligned slice of someone's buffer
        flat = flat.clone()
    return flat.view(shape)
