"""Hypothesis strategies shared by the protocol tests: tensors, junk, and hostile variants of
valid wire messages; and the property every ``*_untrusted`` parser must have."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from hypothesis import strategies as st

from petals_core import CodecError
from petals_core.transport import decode_message_untrusted, encode_message

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Every dtype a tensor may have on the wire.
WIRE_DTYPES = (*FLOAT_DTYPES, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)

_Message = TypeVar("_Message")


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 4
    if dtype == torch.bool:
        return values > 0
    if not dtype.is_floating_point:
        return values.clamp(0, 100).to(dtype)
    return values.to(dtype)


def tensors(
    shapes: st.SearchStrategy[tuple[int, ...]], dtypes: tuple[torch.dtype, ...] = WIRE_DTYPES
) -> st.SearchStrategy[torch.Tensor]:
    return st.builds(make_tensor, shapes, st.sampled_from(dtypes), st.integers(0, 3))


small_shapes = st.lists(st.integers(0, 4), max_size=5).map(tuple)
sizes = st.integers(1, 4)
ids = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)


def activations(batch: int, tokens: int, hidden: int = 8) -> st.SearchStrategy[torch.Tensor]:
    return tensors(st.just((batch, tokens, hidden)), FLOAT_DTYPES)


def prompts(blocks: int, batch: int, hidden: int = 8) -> st.SearchStrategy[torch.Tensor]:
    shapes = st.tuples(st.just(blocks), st.sampled_from([1, batch]), sizes, st.just(hidden))
    return tensors(shapes, FLOAT_DTYPES)


_text = st.text(st.characters(codec="utf-8"), max_size=6)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64 - 1),
    st.integers(),
    st.floats(),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 2**63, -1, 0, 1]),
    _text,
    st.binary(max_size=6),
    tensors(small_shapes),
)
#: Any value, none of them meaningful.
junk: st.SearchStrategy[Any] = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6,
)


@st.composite
def hostile(draw: st.DrawFn, valid: Mapping[str, Any]) -> dict[str, Any]:
    """``valid`` with up to three of its fields dropped or replaced by junk (or by a field of a
    list, its first entry replaced), and maybe fields it does not know."""
    message = dict(valid)
    for name in draw(st.lists(st.sampled_from(sorted(valid) or ["x"]), max_size=3)):
        action = draw(st.sampled_from(["drop", "junk", "null", "inner"]))
        if action == "drop":
            message.pop(name, None)
        elif action == "null":
            message[name] = None
        elif action == "inner" and isinstance(message.get(name), list) and message[name]:
            message[name] = [draw(junk), *message[name][1:]]
        else:
            message[name] = draw(junk)
    extra = draw(st.dictionaries(_text, junk, max_size=2))
    return {**extra, **message}


def through_codec(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` as a peer receives it: encoded and decoded by the wire codec."""
    return decode_message_untrusted(encode_message(message))


def parse_or_refuse(parse: Callable[..., _Message], *parts: Any) -> _Message | None:
    """What ``parse(*parts)`` returned, or None if it raised :class:`CodecError`; anything else
    it raises fails the test."""
    try:
        return parse(*parts)
    except CodecError:
        return None
