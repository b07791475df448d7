"""How the block RPCs' messages are read from the wire, and the checks they make of their fields.

Messages are built checked: a field of the wrong type or shape raises
:class:`LocalProtocolError` when the message is constructed, so nothing malformed is sent.  A
peer's message is read by ``from_wire_untrusted`` (:class:`WireMessage`, or
:class:`WireTransfer` for one sent as a transfer in parts), which builds it through
:func:`untrusted` and so raises :class:`CodecError` and nothing else.  On the wire a field goes
by its name; an absent one takes its default (a null is a value, refused where the field takes
none); a transfer carries its tensor fields apart from the rest (:func:`transfer_fields`).

The checks are about the message alone; what depends on the receiver's state (the blocks it
holds, its limits, a session's position) is the receiver's to check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, Self, TypeVar

import attrs
import torch

from .._errors import CodecError, LocalProtocolError

__all__ = [
    "MAX_ID_CHARS",
    "TENSOR_DTYPES",
    "TENSOR_EQ",
    "WireMessage",
    "WireTransfer",
    "as_tuple",
    "check_adapter",
    "check_blocks",
    "check_hidden",
    "check_integer",
    "check_number",
    "check_optional_integer",
    "check_prompts",
    "check_text",
    "is_integer",
    "no_empty_adapter",
    "present",
    "prompts_fit",
    "same_tensor",
    "to_float",
    "transfer_fields",
    "untrusted",
    "wire_fields",
]

#: The floating-point dtypes activations and their gradients travel in.
TENSOR_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)
#: The longest session id or peer id a message may name.
MAX_ID_CHARS: Final = 128

_Message = TypeVar("_Message")


class WireMessage:
    """A message that travels as one map, each field under its name (see the module's
    docstring)."""

    #: What the message is called in errors.
    what: ClassVar[str]

    @classmethod
    def from_wire_untrusted(cls, message: Mapping[str, Any]) -> Self:
        """The message a peer sent; raises :class:`CodecError` only.  Fields it does not know
        are ignored."""
        return untrusted(cls.what, lambda: cls(**wire_fields(cls, message)), message)


class WireTransfer:
    """A message that travels as a transfer in parts: its tensors apart from its other fields,
    the meta map."""

    #: What the message is called in errors.
    what: ClassVar[str]

    @classmethod
    def from_wire_untrusted(cls, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> Self:
        """The message a peer sent; raises :class:`CodecError` only.  Fields and tensors it does
        not know are ignored."""
        return untrusted(
            cls.what, lambda: cls(**transfer_fields(cls, meta, tensors)), meta, tensors
        )


def untrusted(what: str, build: Callable[[], _Message], *parts: object) -> _Message:
    """``build()``, the message a peer sent as ``parts`` (maps): anything malformed raises
    :class:`CodecError`, and nothing else does."""
    for part in parts:
        if not isinstance(part, Mapping):
            raise CodecError(f"a {what} is made of maps, not {type(part).__name__}")
    try:
        return build()
    except LocalProtocolError as exc:
        raise CodecError(str(exc)) from None


def present(**fields: Any) -> dict[str, Any]:
    """The ``fields`` that are not None: optional fields are left out of the wire when unset."""
    return {name: value for name, value in fields.items() if value is not None}


def wire_fields(cls: type, message: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of the attrs class ``cls`` as ``message`` holds them: an absent one takes its
    default (None where it has none, for the checks to refuse)."""
    return {field.name: message.get(field.name, _default(field)) for field in attrs.fields(cls)}


def transfer_fields(
    cls: type, meta: Mapping[str, Any], tensors: Mapping[str, Any]
) -> dict[str, Any]:
    """:func:`wire_fields` of a transfer: its tensor fields from ``tensors``, the rest from
    ``meta``."""
    return {
        field.name: (tensors if field.eq_key is TENSOR_EQ else meta).get(
            field.name, _default(field)
        )
        for field in attrs.fields(cls)
    }


def _default(field: attrs.Attribute[Any]) -> Any:
    return None if field.default is attrs.NOTHING else field.default


def as_tuple(value: object) -> Any:
    """A list from the wire as a tuple (anything else as it is, for the checks to refuse)."""
    return tuple(value) if isinstance(value, list) else value


def to_float(value: object) -> object:
    """An integer as a float (anything else as it is, for the checks to refuse)."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def no_empty_adapter(value: object) -> object:
    """An empty adapter name means none."""
    return None if isinstance(value, str) and not value else value


def is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_integer(name: str, value: object, low: int, high: int | None = None) -> None:
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and low <= value
        and (high is None or value <= high)
    ):
        return
    bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
    raise LocalProtocolError(f"{name} must be an integer {bounds}, got {value!r}")


def check_optional_integer(name: str, value: object, low: int) -> None:
    if value is not None:
        check_integer(name, value, low)


def check_number(name: str, value: object, *, low: float | None = None) -> None:
    """A finite float (integers are converted by the fields' converter), at least ``low``."""
    if not isinstance(value, float) or not math.isfinite(value):
        raise LocalProtocolError(f"{name} must be a finite number, got {value!r}")
    if low is not None and value < low:
        raise LocalProtocolError(f"{name} must be >= {low}")


def check_text(name: str, value: object, *, max_chars: int = MAX_ID_CHARS) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise LocalProtocolError(f"{name} must be a string of 1..{max_chars} chars")


def check_optional_bytes(name: str, value: object, *, low: int, high: int) -> None:
    if value is not None and (not isinstance(value, bytes) or not low <= len(value) <= high):
        raise LocalProtocolError(f"{name} must be {low}..{high} bytes")


def check_blocks(value: object) -> None:
    """``(start, end)``: two integers (whether the receiver holds them is its own check)."""
    if not isinstance(value, tuple) or len(value) != 2 or not all(map(is_integer, value)):
        raise LocalProtocolError("blocks must be [start, end]")


def check_adapter(value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise LocalProtocolError("active_adapter must be a string or null")


def check_hidden(name: str, value: object) -> None:
    """Activations or their gradients: a ``(batch >= 1, tokens, hidden)`` tensor in one of
    :data:`TENSOR_DTYPES` (the hidden size is the receiver's check)."""
    if not isinstance(value, torch.Tensor):
        raise LocalProtocolError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise LocalProtocolError(f"{name} must be floating point, got {value.dtype}")
    if value.dtype not in TENSOR_DTYPES:
        raise LocalProtocolError(f"{name} must be one of {TENSOR_DTYPES}, not {value.dtype}")
    if value.dim() != 3 or value.shape[0] < 1:
        raise LocalProtocolError(
            f"{name} must be (batch >= 1, tokens, hidden), got {tuple(value.shape)}"
        )


def check_prompts(name: str, value: object) -> None:
    """Deep prompts or their gradients: None, or a ``(blocks, 1 or batch, prefix, hidden)``
    floating-point tensor (the sizes are the receiver's check)."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point:
        raise LocalProtocolError(f"{name} must be a floating-point tensor")
    if value.dim() != 4:
        raise LocalProtocolError(
            f"{name} must be (blocks, 1 or batch, prefix, hidden), got {tuple(value.shape)}"
        )


def prompts_fit(
    prompts: torch.Tensor, *, blocks: int, batch: int, tokens: int, hidden_size: int | None
) -> bool:
    """Whether deep prompts fit a session's first step: ``(blocks, 1 or batch, at most tokens,
    hidden_size)`` (the step's length bounds the prefix)."""
    return (
        prompts.dim() == 4
        and prompts.shape[0] == blocks
        and prompts.shape[1] in (1, batch)
        and prompts.shape[2] <= tokens
        and prompts.shape[3] == hidden_size
    )


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal dtype, shape and bits (NaNs included), or both None."""
    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bits(a), _bits(b))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


#: How a message compares its tensors (as ``attrs.field(eq=TENSOR_EQ, hash=False)``): by value.
TENSOR_EQ: Final = attrs.cmp_using(eq=same_tensor)
