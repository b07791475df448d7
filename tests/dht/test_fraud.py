"""The DHT layout of fraud reports: what a reporter's list may hold."""

from __future__ import annotations

import pytest

from petals_core import ReportRefused
from petals_core.dht import MAX_LISTED, Listing, index_key
from petals_core.dht._fraud import chunk_key, parse_listings
from petals_core.transport import encode_message

LISTING = Listing(reporter="r", accused="a", digest=b"\x07" * 32, size=5, issued=7)


def _listed(*entries: object) -> bytes:
    return encode_message({"reports": list(entries)})


def test_a_list_round_trips_and_keys_are_under_the_models_prefix() -> None:
    assert parse_listings("r", _listed(LISTING.to_wire())) == [LISTING]
    assert index_key("llama") == "llama.fraud"
    assert chunk_key("llama", b"\x07" * 32, 3) == "llama.fraud." + "07" * 32 + ".3"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"\xff", "list of reports is malformed"),
        (encode_message({"reports": 1}), "not a list of 64 at most"),
        (_listed(*[LISTING.to_wire()] * (MAX_LISTED + 1)), "not a list of 64 at most"),
        (_listed(1), "not a map"),
        (_listed({**LISTING.to_wire(), "digest": b"x"}), "malformed report"),
        (_listed({**LISTING.to_wire(), "size": 0}), "malformed report"),
        (_listed({**LISTING.to_wire(), "size": True}), "malformed report"),
        (_listed({**LISTING.to_wire(), "issued": -1}), "malformed report"),
        (_listed({**LISTING.to_wire(), "accused": 3}), "malformed report"),
    ],
)
def test_malformed_lists_are_refused_with_their_reason(value: bytes, reason: str) -> None:
    with pytest.raises(ReportRefused, match=reason):
        parse_listings("r", value)
