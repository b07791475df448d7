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

from collections.abc import Callable, Mapping
from typing import Any, Literal

import cbor2

from petals_core._errors import CodecError

from ._codec_checks import check_structure_untrusted
from ._codec_format import (
    DEFAULT_LIMITS,
    PREFIX_BYTES,
    TENSOR_TAG,
    CodecLimits,
    check_tensor_limits,
)
from ._codec_tensors import RawTensor, check_bool_bytes, decode_plain_tensor
from ._codec_writer import encode_parts

__all__ = ["FrameDecoder", "decode_message_untrusted", "encode_frame", "encode_message"]


def encode_message(msg: Mapping[str, Any], *, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``msg`` as one CBOR map; raises :class:`CodecError` for what a peer would refuse."""
    return b"".join(encode_parts(msg, limits, prefix=False))


def encode_frame(msg: Mapping[str, Any], *, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    """Encode ``msg`` behind its 4-byte big-endian length."""
    return b"".join(encode_parts(msg, limits, prefix=True))


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
        check_structure_untrusted(payload, limits)
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
        end = PREFIX_BYTES + int.from_bytes(self._buffer[:PREFIX_BYTES], "big")
        if len(self._buffer) < end:
            return None
        with memoryview(self._buffer) as view:
            # bytes, not bytearray: cbor2 would copy anything else once more.
            payload = bytes(view[PREFIX_BYTES:end])
        # Cheap however large the buffer: CPython's bytearray drops its head by moving a pointer.
        del self._buffer[:end]
        self._unchecked -= end
        return payload

    def _check_prefixes(self) -> None:
        # Each prefix is checked once, as soon as it is complete.
        while self._unchecked + PREFIX_BYTES <= len(self._buffer):
            prefix = self._buffer[self._unchecked : self._unchecked + PREFIX_BYTES]
            length = int.from_bytes(prefix, "big")
            if length > self._max_frame_bytes:
                raise CodecError(f"a {length}-byte frame exceeds {self._max_frame_bytes}")
            self._unchecked += PREFIX_BYTES + length


class _TagDecoders(dict[int, Callable[[Any, bool], Any]]):
    """cbor2's semantic decoders for every tag number: ours for tensors, a refusal for the rest.

    Covering every number keeps cbor2's own tag decoders (sets, references, regular
    expressions...) out of reach even if the structure walk missed a tag.
    """

    def __init__(self, limits: CodecLimits, tensors: Literal["torch", "raw"]) -> None:
        super().__init__({TENSOR_TAG: self._decode_tensor})
        self._limits = limits
        self._tensors = tensors

    def __missing__(self, tag: int) -> Callable[[Any, bool], Any]:
        # Raised at lookup, so cbor2 refuses the tag before decoding what it wraps.
        raise CodecError(f"unknown CBOR tag {tag}")

    def _decode_tensor(self, fields: Any, immutable: bool) -> Any:
        # The structure walk guaranteed the field types; what is left is their values.
        if len(fields) == 3 and self._tensors == "torch":
            dtype, shape, data = fields
            return decode_plain_tensor(dtype, shape, data, self._limits)
        dtype, shape, data = fields[:3]
        compression, scales = fields[3:] if len(fields) == 5 else (None, b"")
        check_tensor_limits(shape, self._limits)
        raw = RawTensor(dtype, shape, data, compression=compression, scales=scales)
        if dtype == "bool" and compression is None:
            check_bool_bytes(data)
        return raw.to_torch() if self._tensors == "torch" else raw
