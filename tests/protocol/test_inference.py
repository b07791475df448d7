"""The messages of inference sessions and pushes: their wire form, round trips through the
codec, the checks made when one is built, and parsers that refuse anything malformed with
:class:`CodecError` alone."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from petals_core import CodecError, LocalProtocolError
from petals_core.protocol import (
    MAX_PUSH_CHAIN,
    OpenPush,
    OpenSession,
    PushTarget,
    SessionReady,
    Step,
    StepResult,
)

from ._strategies import (
    FLOAT_DTYPES,
    activations,
    hostile,
    ids,
    junk,
    make_tensor,
    parse_or_refuse,
    prompts,
    sizes,
    tensors,
    through_codec,
)

Message = OpenSession | SessionReady | Step | StepResult | OpenPush


@st.composite
def openings(draw: st.DrawFn) -> OpenSession:
    start = draw(st.integers(0, 10))
    batch, max_length = draw(sizes), draw(st.integers(1, 64))
    padding = st.lists(st.integers(0, max_length), min_size=batch, max_size=batch).map(tuple)
    return OpenSession(
        session_id=draw(ids),
        blocks=(start, start + draw(sizes)),
        max_length=max_length,
        batch_size=batch,
        alloc_timeout=draw(st.floats(0, 1e6)),
        active_adapter=draw(st.one_of(st.none(), ids)),
        points=draw(st.floats(allow_nan=False, allow_infinity=False)),
        left_padding=draw(st.one_of(st.none(), padding)),
        push_key=draw(st.one_of(st.none(), st.binary(min_size=16, max_size=64))),
    )


grants = st.one_of(st.none(), st.binary(min_size=1, max_size=64))
push_targets = st.builds(PushTarget, peer=ids, session_id=ids, grant=grants)


@st.composite
def steps(draw: st.DrawFn) -> Step:
    batch, tokens = draw(sizes), draw(st.integers(0, 4))
    extras = draw(st.sampled_from(["none", "push", "hypo_ids", "prompts"]))
    hypo_ids = tensors(st.just((batch,)), (torch.int64, torch.int32, torch.uint8)).map(
        lambda ids: ids % batch
    )
    return Step(
        hidden_states=draw(activations(batch, tokens)),
        start_from_position=draw(st.one_of(st.none(), st.integers(0, 2**63))),
        step_id=draw(st.integers(0, 2**63)) if extras == "push" else draw(st.none()),
        hypo_ids=draw(hypo_ids) if extras == "hypo_ids" else None,
        prompts=draw(prompts(3, batch)) if extras == "prompts" else None,
        push=tuple(draw(st.lists(push_targets, min_size=1, max_size=4)))
        if extras == "push"
        else (),
        grant=draw(grants) if extras in ("none", "push") else None,
    )


step_results = st.builds(
    StepResult,
    hidden_states=st.builds(lambda b, t: make_tensor((b, t, 8), torch.float16), sizes, sizes),
    position=st.integers(0, 2**40),
    step_id=st.one_of(st.none(), st.integers(0, 2**63)),
    pushed=st.one_of(st.none(), st.booleans()),
)
messages: st.SearchStrategy[Message] = st.one_of(
    openings(),
    st.builds(SessionReady, position=st.integers(0, 100)),
    steps(),
    step_results,
    st.builds(OpenPush, session_id=ids),
)


@settings(max_examples=200, deadline=None)
@given(message=messages)
def test_every_message_round_trips_through_the_codec(message: Message) -> None:
    assert type(message).from_wire_untrusted(through_codec(message.to_wire())) == message


@settings(max_examples=300, deadline=None)
@given(data=st.data(), message=messages)
def test_hostile_variants_are_parsed_or_refused_with_codec_error_only(
    data: st.DataObject, message: Message
) -> None:
    wire = data.draw(hostile(message.to_wire()))
    parsed = parse_or_refuse(type(message).from_wire_untrusted, wire)
    if parsed is not None:  # what is accepted is a message like any other
        assert type(parsed).from_wire_untrusted(parsed.to_wire()) == parsed


@settings(max_examples=200, deadline=None)
@given(
    parse=st.sampled_from(
        [cls.from_wire_untrusted for cls in (OpenSession, SessionReady, Step, StepResult, OpenPush)]
    ),
    value=junk,
)
def test_junk_is_refused_with_codec_error_only(parse: Any, value: Any) -> None:
    parse_or_refuse(parse, value)


# -- the wire form ---------------------------------------------------------------------------------


def test_the_wire_form_is_the_documented_one() -> None:
    hidden = torch.zeros(1, 2, 8)
    opening = OpenSession(
        session_id="s",
        blocks=(2, 5),
        max_length=16,
        batch_size=1,
        alloc_timeout=30.0,
        active_adapter=None,
        left_padding=(1,),
    )
    assert opening.to_wire() == {
        "session_id": "s",
        "blocks": [2, 5],
        "max_length": 16,
        "batch_size": 1,
        "alloc_timeout": 30.0,
        "active_adapter": None,
        "points": 0.0,
        "left_padding": [1],
    }
    assert SessionReady().to_wire() == {"ready": True, "position": 0}
    push = (PushTarget(peer="p", session_id="t"),)
    step = Step(hidden_states=hidden, start_from_position=0, step_id=3, push=push).to_wire()
    assert step.keys() == {"hidden_states", "start_from_position", "step_id", "push"}
    assert step["push"] == [{"peer": "p", "session_id": "t"}]
    assert Step(hidden_states=hidden).to_wire().keys() == {"hidden_states"}
    result = StepResult(hidden_states=hidden, position=2, step_id=3, pushed=False).to_wire()
    assert result.keys() == {"hidden_states", "position", "step_id", "pushed"}
    assert StepResult(hidden_states=hidden, position=2).to_wire().keys() == {
        "hidden_states",
        "position",
    }
    assert OpenPush(session_id="t").to_wire() == {"session_id": "t"}


def test_an_opening_reads_what_older_clients_send() -> None:
    """Defaults for what is absent, an empty adapter for none, and fields it does not know
    ignored."""
    opening = OpenSession.from_wire_untrusted(
        {"session_id": "s", "blocks": [0, 2], "max_length": 8, "active_adapter": "", "new": 1}
    )
    assert opening == OpenSession(session_id="s", blocks=(0, 2), max_length=8)
    assert (opening.batch_size, opening.alloc_timeout, opening.points) == (1, 0.0, 0.0)
    assert opening.active_adapter is None


# -- what is refused -------------------------------------------------------------------------------

_OPENING: dict[str, Any] = {"session_id": "s", "blocks": [0, 2], "max_length": 8}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"session_id": ""}, "session_id must be a string of 1..128 chars"),
        ({"session_id": "x" * 129}, "session_id must be a string"),
        ({"blocks": [0, True]}, "blocks must be [start, end]"),
        ({"blocks": "0:2"}, "blocks must be [start, end]"),
        ({"max_length": 0}, "max_length must be an integer >= 1"),
        ({"max_length": 8.0}, "max_length must be an integer"),
        ({"batch_size": None}, "batch_size must be an integer"),
        ({"alloc_timeout": -1}, "alloc_timeout must be >= 0"),
        ({"alloc_timeout": math.inf}, "alloc_timeout must be a finite number"),
        ({"alloc_timeout": 2**2000}, "alloc_timeout must be a finite number"),
        ({"points": None}, "points must be a finite number"),
        ({"points": True}, "points must be a finite number"),
        ({"active_adapter": 3}, "active_adapter must be a string or null"),
        ({"left_padding": [1, 2]}, "left_padding must be 1 integers in [0, 8]"),
        ({"left_padding": [9]}, "left_padding must be 1 integers in [0, 8]"),
        ({"left_padding": 1}, "left_padding must be 1 integers"),
        ({"push_key": b"short"}, "push_key must be 16..64 bytes"),
        ({"push_key": "k" * 32}, "push_key must be 16..64 bytes"),
    ],
)
def test_malformed_openings_are_refused_naming_the_field(change: dict[str, Any], says: str) -> None:
    with pytest.raises(CodecError) as refused:
        OpenSession.from_wire_untrusted({**_OPENING, **change})
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"hidden_states": None}, "hidden_states must be a tensor, got NoneType"),
        ({"hidden_states": torch.ones(1, 1, 8, dtype=torch.int64)}, "must be floating point"),
        ({"hidden_states": torch.zeros(2, 8)}, "hidden_states must be (batch >= 1, tokens"),
        ({"hidden_states": torch.zeros(0, 1, 8)}, "hidden_states must be (batch >= 1, tokens"),
        ({"start_from_position": -1}, "start_from_position must be an integer >= 0"),
        ({"start_from_position": True}, "start_from_position must be an integer"),
        ({"step_id": 1.0}, "step_id must be an integer >= 0"),
        ({"hypo_ids": torch.tensor([0, 2])}, "hypo_ids must be (2,) integers in [0, batch)"),
        ({"hypo_ids": torch.tensor([0.0, 1.0])}, "hypo_ids must be (2,) integers"),
        ({"hypo_ids": torch.tensor([True, False])}, "hypo_ids must be (2,) integers"),
        ({"hypo_ids": torch.tensor([0])}, "hypo_ids must be (2,) integers"),
        ({"prompts": torch.zeros(1, 1, 8)}, "prompts must be (blocks, 1 or batch, prefix"),
        ({"prompts": torch.zeros(1, 1, 1, 8, dtype=torch.int8)}, "prompts must be a floating"),
        ({"push": []}, "push must be a list of 1..64"),
        ({"push": [{"peer": "p"}]}, "push must be a list"),
        ({"push": [{"peer": "p", "session_id": 5}]}, "push must be a list"),
        ({"push": [_target := {"peer": "p", "session_id": "s"}] * 65}, "push must be a list"),
        ({"push": [_target]}, "a step to push on needs a step_id"),
        ({"push": [{**_target, "grant": "g"}], "step_id": 1}, "push must be a list"),
        ({"push": [{**_target, "grant": b"g" * 65}], "step_id": 1}, "push must be a list"),
        ({"grant": b""}, "grant must be 1..64 bytes"),
        ({"grant": 5}, "grant must be 1..64 bytes"),
        (
            {"push": [_target], "step_id": 1, "hypo_ids": torch.tensor([0, 1])},
            "a step with prompts or hypo_ids cannot be pushed on",
        ),
    ],
)
def test_malformed_steps_are_refused_naming_the_field(change: dict[str, Any], says: str) -> None:
    with pytest.raises(CodecError) as refused:
        Step.from_wire_untrusted({"hidden_states": torch.zeros(2, 1, 8), **change})
    assert says in str(refused.value)


def test_nulls_of_optional_step_fields_mean_absent() -> None:
    hidden = torch.zeros(1, 1, 8)
    nulls = dict.fromkeys(["start_from_position", "step_id", "hypo_ids", "prompts", "push"])
    assert Step.from_wire_untrusted({"hidden_states": hidden, **nulls}) == Step(
        hidden_states=hidden
    )


def test_answers_are_checked_too() -> None:
    hidden = torch.zeros(1, 1, 8)
    with pytest.raises(CodecError, match="ready"):
        SessionReady.from_wire_untrusted({"position": 0})
    with pytest.raises(CodecError, match="position must be an integer >= 0"):
        StepResult.from_wire_untrusted({"hidden_states": hidden, "position": -1})
    with pytest.raises(CodecError, match="pushed must be true or false"):
        StepResult.from_wire_untrusted({"hidden_states": hidden, "position": 1, "pushed": 1})
    with pytest.raises(CodecError, match="session_id must be a string"):
        OpenPush.from_wire_untrusted({"session_id": 7})
    with pytest.raises(CodecError, match="a step is made of maps, not list"):
        Step.from_wire_untrusted([hidden])  # type: ignore[arg-type]


def test_a_malformed_message_cannot_be_built() -> None:
    """What is sent is checked as it is built: the sender's mistake, :class:`LocalProtocolError`,
    before anything goes out."""
    hidden = torch.zeros(1, 1, 8)
    with pytest.raises(LocalProtocolError, match="hidden_states must be one of"):
        Step(hidden_states=hidden.double())
    with pytest.raises(LocalProtocolError, match="push must be a list"):
        Step(hidden_states=hidden, step_id=0, push=(PushTarget(peer="p", session_id="s"),) * 65)
    assert MAX_PUSH_CHAIN == 64
    with pytest.raises(LocalProtocolError, match="max_length"):
        OpenSession(session_id="s", blocks=(0, 1), max_length=0)
    with pytest.raises(LocalProtocolError, match="peer must be a string"):
        PushTarget(peer="", session_id="s")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_messages_compare_their_tensors_by_value(dtype: torch.dtype) -> None:
    hidden = torch.tensor([[[math.nan, 1.0]]], dtype=dtype)
    assert Step(hidden_states=hidden) == Step(hidden_states=hidden.clone())
    assert Step(hidden_states=hidden) != Step(hidden_states=torch.zeros_like(hidden))
    other = torch.float32 if dtype != torch.float32 else torch.float16
    assert Step(hidden_states=hidden) != Step(hidden_states=hidden.to(other))
