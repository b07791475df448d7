"""Tensors on the wire: :class:`RawTensor` (the wire form, for programs without torch),
:class:`Compressed`, and the conversions between torch tensors and their wire bytes.

Only functions that build tensors import torch; the rest consult an already imported torch.
"""

from __future__ import annotations

import ctypes
import functools
import math
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeGuard, cast

import attrs

from petals_core._errors import CodecError

from ._codec_format import (
    BLOCK_ELEMENTS,
    FLOAT_DTYPES,
    ITEM_BYTES,
    SCHEMES,
    CodecLimits,
    Scheme,
    check_tensor_limits,
    payload_bytes,
    size_error,
)

if TYPE_CHECKING:
    import torch

__all__ = ["Compressed", "RawTensor", "compress"]

# Smaller buffers are copied into a tensor rather than shared: CPython shares its one-byte bytes
# objects, and a tensor over one of those must never be written to.
_ZERO_COPY_MIN_BYTES: Final = 4096


def _to_shape(sizes: Iterable[int]) -> tuple[int, ...]:
    return tuple(sizes)


@attrs.frozen(eq=True)
class RawTensor:
    """A tensor in its wire form, for programs that do not use torch.

    ``data`` holds the elements as described in :mod:`petals_core.transport._codec`; when
    ``compression`` is set, it holds the compressed payload and ``scales`` the blockwise8
    scales, while ``dtype`` and ``shape`` describe the original tensor.  Invalid fields raise
    :class:`CodecError`.
    """

    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_to_shape)
    data: bytes | memoryview = attrs.field(repr=False)
    compression: Scheme | None = attrs.field(default=None, kw_only=True)
    scales: bytes | memoryview = attrs.field(default=b"", kw_only=True, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.dtype not in ITEM_BYTES:
            raise CodecError(f"unsupported tensor dtype {self.dtype!r}")
        if not all(type(size) is int and size >= 0 for size in self.shape):
            raise CodecError(f"tensor shape {self.shape!r} is not a tuple of non-negative ints")
        data_bytes, scales_bytes = payload_bytes(self.dtype, self.numel, self.compression)
        if _buffer_bytes(self.data) != data_bytes or _buffer_bytes(self.scales) != scales_bytes:
            raise size_error(self.dtype, self.shape, self.compression, data_bytes, scales_bytes)

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
        blocks = -(-self.numel // BLOCK_ELEMENTS)
        scales = _tensor_from_buffer(self.scales, torch.float32, (blocks, 1))
        padded = torch.zeros(blocks * BLOCK_ELEMENTS, dtype=torch.float32)
        padded[: self.numel] = _tensor_from_buffer(self.data, torch.int8, (self.numel,))
        values = padded.view(blocks, BLOCK_ELEMENTS).mul_(scales).view(-1)
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
        if self.scheme not in SCHEMES:
            raise CodecError(f"unknown compression scheme {self.scheme!r}; use one of {SCHEMES}")
        if _torch_dtype_name(self.tensor) not in FLOAT_DTYPES:
            raise CodecError(f"only {sorted(FLOAT_DTYPES)} torch tensors can be compressed")


def compress(tensor: torch.Tensor, scheme: Scheme) -> Compressed:
    """Mark ``tensor`` to be sent compressed; see :class:`Compressed`."""
    return Compressed(tensor, scheme)


def compress_floats(value: Any, scheme: str | None) -> Any:
    """``value`` with ``scheme`` applied to it if it is a floating-point torch tensor, or to
    each value of it if it is a map: what a message's sender marks to travel compressed (None:
    everything as it is).  Integer tensors, and everything else, travel as they are."""
    if scheme is None:
        return value
    if isinstance(value, Mapping):
        return {key: compress_floats(item, scheme) for key, item in value.items()}
    if _torch_dtype_name(value) in FLOAT_DTYPES:
        return Compressed(value, cast(Scheme, scheme))
    return value


def decode_plain_tensor(
    dtype: str, shape: list[int], data: bytes, limits: CodecLimits
) -> torch.Tensor:
    """An uncompressed tensor from a peer as a torch tensor: what ``RawTensor(...).to_torch()``
    gives, checked the same, in fewer steps (a step's tensors decode while the caches are cold)."""
    if dtype not in ITEM_BYTES:
        raise CodecError(f"unsupported tensor dtype {dtype!r}")
    check_tensor_limits(shape, limits)
    size = tuple(shape)
    data_bytes, _ = payload_bytes(dtype, math.prod(size), None)
    if len(data) != data_bytes:
        raise size_error(dtype, size, None, data_bytes, 0)
    if dtype == "bool":
        check_bool_bytes(data)
    return _tensor_from_buffer(data, _torch_dtypes()[dtype], size)


def check_bool_bytes(data: bytes) -> None:
    if data.translate(None, b"\x00\x01"):
        raise CodecError("bool tensor holds bytes other than 0 and 1")


def _buffer_bytes(buffer: bytes | memoryview) -> int:
    with memoryview(buffer) as view:
        if not view.c_contiguous:
            raise CodecError("tensor buffers must be contiguous")
        return view.nbytes


@functools.cache
def wire_names() -> dict[torch.dtype, str]:
    """Each torch dtype that has a wire name, with it (torch is imported by then)."""
    import torch

    return {getattr(torch, name): name for name in ITEM_BYTES}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    return {name: dtype for dtype, name in wire_names().items()}


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


def raw_from_torch(tensor: torch.Tensor, scheme: Scheme | None) -> RawTensor:
    import torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in ITEM_BYTES or tensor.layout != torch.strided:
        raise CodecError(f"cannot encode a {tensor.layout} tensor of {tensor.dtype}")
    tensor = tensor.detach()
    if scheme is None:
        return RawTensor(name, tensor.shape, _tensor_bytes(tensor))
    if scheme == "float16":
        data = _tensor_bytes(tensor.to(torch.float16))
        return RawTensor(name, tensor.shape, data, compression=scheme)
    # Quantize where the tensor lives, so that only codes and scales cross to the CPU.
    flat = tensor.reshape(-1).to(torch.float32)
    blocks = -(-flat.numel() // BLOCK_ELEMENTS)
    padded = torch.nn.functional.pad(flat, (0, blocks * BLOCK_ELEMENTS - flat.numel()))
    padded = padded.view(blocks, BLOCK_ELEMENTS)
    scales = padded.abs().amax(dim=1) / 127
    if not bool(torch.isfinite(scales).all()):
        raise CodecError("blockwise8 compression needs finite values")
    divisors = torch.where(scales > 0, scales, 1.0)  # an all-zero block has codes of 0
    codes = torch.round(padded / divisors[:, None]).clamp_(-127, 127).to(torch.int8)
    data = _tensor_bytes(codes.view(-1)[: flat.numel()])
    return RawTensor(name, tensor.shape, data, compression=scheme, scales=_tensor_bytes(scales))


def as_received(tensor: torch.Tensor, scheme: str | None) -> torch.Tensor:
    """``tensor`` as its receiver decodes it when it travels with compression ``scheme`` (the
    lossy schemes change its values; integer tensors travel as they are)."""
    if scheme is None or tensor.dtype.is_floating_point is False:
        return tensor
    return raw_from_torch(tensor, cast(Scheme, scheme)).to_torch()


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
