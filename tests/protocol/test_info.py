"""The messages of ``petals.info``: round trips, what newer and broken servers may send."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from petals_core import CodecError
from petals_core.protocol import InfoReply, InfoRequest

from ._strategies import hostile, ids, junk, parse_or_refuse, through_codec

counts = st.integers(0, 2**40)
names = st.lists(ids, max_size=3).map(tuple)
replies = st.builds(
    InfoReply,
    version=ids,
    start_block=counts,
    end_block=counts,
    hidden_size=counts,
    torch_dtype=ids,
    accepted_dtypes=names,
    adapters=names,
    cache_tokens_left=counts,
    inference_max_length=counts,
    max_batch_tokens=counts,
    open_sessions=counts,
    device=ids,
    device_memory_reserved_bytes=st.one_of(st.none(), counts),
    decode_graphs=st.one_of(
        st.none(), st.dictionaries(ids, st.one_of(st.none(), counts, ids), max_size=3)
    ),
)


@settings(max_examples=100, deadline=None)
@given(reply=replies)
def test_a_reply_round_trips_through_the_codec(reply: InfoReply) -> None:
    assert InfoReply.from_wire_untrusted(through_codec(reply.to_wire())) == reply


@settings(max_examples=200, deadline=None)
@given(data=st.data(), reply=replies)
def test_hostile_replies_are_parsed_or_refused_with_codec_error_only(
    data: st.DataObject, reply: InfoReply
) -> None:
    parsed = parse_or_refuse(InfoReply.from_wire_untrusted, data.draw(hostile(reply.to_wire())))
    if parsed is not None:
        assert InfoReply.from_wire_untrusted(parsed.to_wire()) == parsed


@settings(max_examples=100, deadline=None)
@given(value=junk)
def test_junk_is_refused_with_codec_error_only(value: Any) -> None:
    parse_or_refuse(InfoReply.from_wire_untrusted, value)
    parse_or_refuse(InfoRequest.from_wire_untrusted, value)


def test_a_request_has_no_fields() -> None:
    assert InfoRequest().to_wire() == {}
    assert InfoRequest.from_wire_untrusted({"anything": 1}) == InfoRequest()


def test_fields_a_reader_does_not_know_are_ignored_and_missing_ones_named() -> None:
    reply = InfoReply(
        version="1",
        start_block=0,
        end_block=2,
        hidden_size=8,
        torch_dtype="float32",
        accepted_dtypes=("float32",),
        adapters=(),
        cache_tokens_left=10,
        inference_max_length=16,
        max_batch_tokens=4,
        open_sessions=0,
        device="cpu",
    )
    wire = reply.to_wire()
    assert InfoReply.from_wire_untrusted({**wire, "from_the_future": [1]}) == reply
    del wire["device"], wire["version"]
    with pytest.raises(CodecError, match="server info lacks version, device"):
        InfoReply.from_wire_untrusted(wire)
