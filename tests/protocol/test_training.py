"""The messages of forward and backward passes: their wire form (a meta map and tensors), round
trips through a real transfer in parts, and parsers that refuse anything malformed with
:class:`CodecError` alone."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import trio
from hypothesis import given, settings, strategies as st

from petals_core import CodecError, LocalProtocolError
from petals_core.protocol import (
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    receive_tensors,
    send_tensors,
)

from ._strategies import activations, hostile, ids, junk, parse_or_refuse, prompts, sizes

Message = ForwardRequest | ForwardReply | BackwardRequest | BackwardReply


@st.composite
def forward_requests(draw: st.DrawFn) -> ForwardRequest:
    start, blocks, batch, tokens = draw(st.integers(0, 9)), draw(sizes), draw(sizes), draw(sizes)
    return ForwardRequest(
        blocks=(start, start + blocks),
        hidden_states=draw(activations(batch, tokens)),
        prompts=draw(st.one_of(st.none(), prompts(blocks, batch))),
        active_adapter=draw(st.one_of(st.none(), ids)),
        points=draw(st.floats(allow_nan=False, allow_infinity=False)),
        keep_for_backward=draw(st.booleans()),
    )


@st.composite
def backward_requests(draw: st.DrawFn) -> BackwardRequest:
    forward = draw(forward_requests())
    batch, tokens, _ = forward.hidden_states.shape
    return BackwardRequest(
        blocks=forward.blocks,
        hidden_states=forward.hidden_states,
        prompts=forward.prompts,
        active_adapter=forward.active_adapter,
        points=forward.points,
        grad_outputs=draw(activations(batch, tokens)),
        kept=draw(st.one_of(st.none(), ids)),
    )


@st.composite
def backward_replies(draw: st.DrawFn) -> BackwardReply:
    batch, tokens = draw(sizes), draw(sizes)
    return BackwardReply(
        grad_inputs=draw(activations(batch, tokens)),
        grad_prompts=draw(st.one_of(st.none(), prompts(draw(sizes), batch))),
    )


messages: st.SearchStrategy[Message] = st.one_of(
    forward_requests(),
    st.builds(
        ForwardReply,
        hidden_states=st.tuples(sizes, sizes).flatmap(lambda bt: activations(*bt)),
        kept=st.one_of(st.none(), ids),
    ),
    backward_requests(),
    backward_replies(),
)


async def _in_parts(message: Message, chunk_bytes: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``message`` sent and received as a transfer in parts."""
    sender, receiver = trio.open_memory_channel[Any](1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: send_tensors(sender.send, *message.to_wire(), chunk_bytes=chunk_bytes)
        )
        return await receive_tensors(receiver.receive, max_elements=1 << 20)


@settings(max_examples=100, deadline=None)
@given(message=messages, chunk_bytes=st.sampled_from([7, 64, 1 << 20]))
def test_every_message_round_trips_through_a_transfer(message: Message, chunk_bytes: int) -> None:
    meta, tensors = trio.run(_in_parts, message, chunk_bytes)
    assert type(message).from_wire_untrusted(meta, tensors) == message


@settings(max_examples=300, deadline=None)
@given(data=st.data(), message=messages)
def test_hostile_variants_are_parsed_or_refused_with_codec_error_only(
    data: st.DataObject, message: Message
) -> None:
    meta, tensors = message.to_wire()
    meta = data.draw(hostile(meta))
    tensors = data.draw(hostile({k: v for k, v in tensors.items() if v is not None}))
    parsed = parse_or_refuse(type(message).from_wire_untrusted, meta, tensors)
    if parsed is not None:
        assert type(parsed).from_wire_untrusted(*parsed.to_wire()) == parsed


@settings(max_examples=200, deadline=None)
@given(
    parse=st.sampled_from(
        [
            cls.from_wire_untrusted
            for cls in (ForwardRequest, ForwardReply, BackwardRequest, BackwardReply)
        ]
    ),
    meta=junk,
    tensors=junk,
)
def test_junk_is_refused_with_codec_error_only(parse: Any, meta: Any, tensors: Any) -> None:
    parse_or_refuse(parse, meta, tensors)


def test_the_wire_form_is_the_documented_one() -> None:
    hidden = torch.zeros(1, 2, 8)
    forward = ForwardRequest(blocks=(1, 3), hidden_states=hidden, keep_for_backward=True)
    assert forward.to_wire() == (
        {"blocks": [1, 3], "active_adapter": None, "points": 0.0, "keep_for_backward": True},
        {"hidden_states": hidden, "prompts": None},
    )
    assert ForwardRequest(blocks=(1, 3), hidden_states=hidden).to_wire()[0] == {
        "blocks": [1, 3],
        "active_adapter": None,
        "points": 0.0,
    }
    backward = BackwardRequest(
        blocks=(1, 3), hidden_states=hidden, grad_outputs=hidden, active_adapter="a", kept="k"
    )
    meta, tensors = backward.to_wire()
    assert meta == {"blocks": [1, 3], "active_adapter": "a", "points": 0.0, "kept": "k"}
    assert tensors.keys() == {"hidden_states", "grad_outputs", "prompts"}
    assert ForwardReply(hidden_states=hidden).to_wire()[0] == {}
    assert ForwardReply(hidden_states=hidden, kept="k").to_wire()[0] == {"kept": "k"}
    assert BackwardReply(grad_inputs=hidden).to_wire() == (
        {},
        {"grad_inputs": hidden, "grad_prompts": None},
    )


_META: dict[str, Any] = {"blocks": [0, 2]}
_HIDDEN = torch.zeros(1, 3, 8)


@pytest.mark.parametrize(
    ("meta", "tensors", "says"),
    [
        ({}, {"hidden_states": _HIDDEN}, "blocks must be [start, end]"),
        ({"blocks": None}, {"hidden_states": _HIDDEN}, "blocks must be [start, end]"),
        ({**_META, "points": "1"}, {"hidden_states": _HIDDEN}, "points must be a finite"),
        ({**_META, "active_adapter": 5}, {"hidden_states": _HIDDEN}, "active_adapter must be"),
        (_META, {"prompts": torch.zeros(2, 1, 1, 8)}, "hidden_states must be a tensor"),
        (_META, {"hidden_states": torch.zeros(1, 0, 8)}, "at least one token"),
        (
            {**_META, "keep_for_backward": "yes"},
            {"hidden_states": _HIDDEN},
            "keep_for_backward must be true or false",
        ),
    ],
)
def test_malformed_forward_requests_are_refused_naming_the_field(
    meta: dict[str, Any], tensors: dict[str, Any], says: str
) -> None:
    with pytest.raises(CodecError) as refused:
        ForwardRequest.from_wire_untrusted(meta, tensors)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"grad_outputs": None}, "grad_outputs must have the shape of hidden_states, (1, 3, 8)"),
        ({"grad_outputs": torch.zeros(1, 2, 8)}, "grad_outputs must have the shape"),
        ({"grad_outputs": torch.zeros(1, 3, 8, dtype=torch.int32)}, "grad_outputs must be one"),
    ],
)
def test_malformed_backward_requests_are_refused_naming_the_field(
    change: dict[str, Any], says: str
) -> None:
    with pytest.raises(CodecError) as refused:
        BackwardRequest.from_wire_untrusted(_META, {"hidden_states": _HIDDEN, **change})
    assert says in str(refused.value)
    with pytest.raises(CodecError, match="kept must be a string token"):
        BackwardRequest.from_wire_untrusted(
            {**_META, "kept": 5}, {"hidden_states": _HIDDEN, "grad_outputs": _HIDDEN}
        )


def test_replies_are_checked_too() -> None:
    with pytest.raises(CodecError, match="hidden_states must be a tensor"):
        ForwardReply.from_wire_untrusted({"kept": "k"}, {})
    with pytest.raises(CodecError, match="kept must be a string token"):
        ForwardReply.from_wire_untrusted({"kept": b"k"}, {"hidden_states": _HIDDEN})
    with pytest.raises(CodecError, match="grad_prompts must be a floating-point tensor"):
        BackwardReply.from_wire_untrusted(
            {}, {"grad_inputs": _HIDDEN, "grad_prompts": torch.zeros(1, 1, 1, 8).long()}
        )
    with pytest.raises(CodecError, match="a backward reply is made of maps"):
        BackwardReply.from_wire_untrusted({}, None)  # type: ignore[arg-type]


def test_an_empty_adapter_means_none_and_a_mismatched_gradient_cannot_be_sent() -> None:
    request = ForwardRequest.from_wire_untrusted(
        {**_META, "active_adapter": ""}, {"hidden_states": _HIDDEN}
    )
    assert request.active_adapter is None
    with pytest.raises(LocalProtocolError, match="grad_outputs must have the shape"):
        BackwardRequest(blocks=(0, 2), hidden_states=_HIDDEN, grad_outputs=_HIDDEN[:, :1])
