"""The field checks the messages share, how messages compare tensors, and how a peer's
message is read."""

from __future__ import annotations

import math

import pytest
import torch

from petals_core import CodecError, LocalProtocolError
from petals_core.protocol import ForwardRequest, OpenSession
from petals_core.protocol._wire import (
    check_blocks,
    check_hidden,
    check_integer,
    check_number,
    same_tensor,
    to_float,
    transfer_fields,
    untrusted,
    wire_fields,
)


def test_tensors_are_the_same_when_their_bits_are() -> None:
    nan = torch.tensor([math.nan, 1.0])
    assert same_tensor(nan, nan.clone())  # NaN != NaN as numbers, but the bits match
    assert not same_tensor(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_tensor(torch.zeros(2), torch.zeros(2, dtype=torch.float16))
    assert not same_tensor(torch.zeros(2), torch.zeros(1, 2))
    assert same_tensor(torch.arange(6.0).view(2, 3).t(), torch.arange(6.0).view(2, 3).t().clone())
    assert same_tensor(torch.tensor([True]), torch.tensor([True]))
    assert same_tensor(None, None) and not same_tensor(None, torch.zeros(1))


@pytest.mark.parametrize("value", [True, 1.5, "1", None, -1, 1001, 2**70])
def test_an_integer_field_takes_integers_in_its_bounds_only(value: object) -> None:
    with pytest.raises(LocalProtocolError, match=r"n must be an integer in \[0, 1000\]"):
        check_integer("n", value, 0, 1000)
    check_integer("n", 1000, 0, 1000)


def test_numbers_are_finite_floats_and_integers_become_floats() -> None:
    assert to_float(3) == 3.0 and isinstance(to_float(3), float)
    assert to_float(True) is True  # a bool is no number: left for the check to refuse
    assert to_float(2**2000) == 2**2000  # too large for a float: refused below
    for value in (True, 2**2000, math.nan, -math.inf, "1", None):
        with pytest.raises(LocalProtocolError, match="x must be a finite number"):
            check_number("x", to_float(value))
    with pytest.raises(LocalProtocolError, match="x must be >= 0"):
        check_number("x", -0.5, low=0)
    check_number("x", to_float(-(2**63)))


def test_blocks_and_activations_are_checked_for_their_form_only() -> None:
    check_blocks((5, 2))  # whether a server holds them (and in order) is the server's check
    with pytest.raises(LocalProtocolError, match=r"blocks must be \[start, end\]"):
        check_blocks((0, 1, 2))
    check_hidden("h", torch.zeros(1, 0, 3))  # a step may carry no new positions
    with pytest.raises(LocalProtocolError, match="h must be one of"):
        check_hidden("h", torch.zeros(1, 1, 3, dtype=torch.float64))


def test_a_parser_raises_codec_error_and_nothing_else() -> None:
    def build() -> None:
        raise LocalProtocolError("n must be an integer")

    with pytest.raises(CodecError, match="n must be an integer") as refused:
        untrusted("thing", build, {})
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    with pytest.raises(CodecError, match="a thing is made of maps, not bytes"):
        untrusted("thing", build, {}, b"x")


def test_a_field_goes_by_its_name_and_an_absent_one_takes_its_default() -> None:
    fields = wire_fields(OpenSession, {"session_id": "s", "points": None, "unknown": 1})
    assert fields["points"] is None  # a null is a value: the check refuses it
    assert fields["alloc_timeout"] == 0.0 and fields["blocks"] is None
    assert "unknown" not in fields
    hidden = torch.zeros(1, 1, 8)
    fields = transfer_fields(
        ForwardRequest,
        {"blocks": [0, 1], "hidden_states": "in the meta"},
        {"hidden_states": hidden, "blocks": "in the tensors"},
    )
    assert fields["blocks"] == [0, 1] and fields["hidden_states"] is hidden
