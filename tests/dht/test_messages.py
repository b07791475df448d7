"""What DHT requests and replies carry: contacts, records, keys, targets and the caller's address,
read back from a peer with CodecError as the only error."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from petals_core._errors import CodecError
from petals_core.dht import NodeID, Record, encode_record
from petals_core.dht._messages import (
    MAX_RECORDS_PER_REPLY,
    MAX_RECORDS_PER_REQUEST,
    caller_contact_untrusted,
    decode_contacts_untrusted,
    decode_records_untrusted,
    encode_contacts,
    key_untrusted,
    seen_from,
    target_untrusted,
)
from petals_core.dht._routing import Contact
from petals_core.transport import Identity, Multiaddr

PEER = Identity.generate().peer_id
OTHER = Identity.generate().peer_id


def test_contacts_round_trip() -> None:
    contact = Contact.from_peer_id(
        PEER, f"/ip4/10.0.0.2/udp/4001/quic-v1/p2p/{PEER}", last_seen=5.0
    )
    assert decode_contacts_untrusted(encode_contacts([contact]), 5.0) == [contact]


@pytest.mark.parametrize(
    "contacts",
    [
        "nope",
        [["only one"]],
        [[str(PEER), 7]],
        [["not a peer id", "/ip4/10.0.0.2/udp/4001/quic-v1"]],
        [[str(PEER), "/ip4/10.0.0.2/tcp/4001"]],
        [[str(PEER), "/ip4/10.0.0.2/udp/4001/quic-v1"]] * 65,
    ],
)
def test_bad_contacts_are_codec_errors(contacts: object) -> None:
    with pytest.raises(CodecError):
        decode_contacts_untrusted(contacts, 0.0)


def test_records_are_bounded_per_request() -> None:
    encoded = encode_record(Record("k", None, b"v", 100.0))
    assert decode_records_untrusted([encoded]) == [Record("k", None, b"v", 100.0)]
    with pytest.raises(CodecError, match="at most"):
        decode_records_untrusted([encoded] * (MAX_RECORDS_PER_REQUEST + 1))
    with pytest.raises(CodecError):
        decode_records_untrusted("nope")


@pytest.mark.parametrize("request_", [{}, {"key": ""}, {"key": 3}])
def test_a_key_is_a_non_empty_string(request_: dict[str, Any]) -> None:
    with pytest.raises(CodecError, match="'key'"):
        key_untrusted(request_)
    assert key_untrusted({"key": "model.0"}) == "model.0"


@pytest.mark.parametrize("target", [None, b"short", "a" * 20, bytes(21)])
def test_a_target_is_a_node_id(target: object) -> None:
    with pytest.raises(CodecError, match="'target'"):
        target_untrusted({"target": target})
    node_id = NodeID.from_key("model.0")
    assert target_untrusted({"target": node_id.to_bytes()}) == node_id


def test_the_caller_is_noted_where_it_listens() -> None:
    request = {"address": "/ip4/10.0.0.2/udp/4001/quic-v1"}
    contact = caller_contact_untrusted(request, PEER, "10.0.0.2", 3.0)
    assert contact == Contact.from_peer_id(
        PEER, f"/ip4/10.0.0.2/udp/4001/quic-v1/p2p/{PEER}", last_seen=3.0
    )
    # A node listening on every interface is reached at the address its request came from.
    wildcard = caller_contact_untrusted(
        {"address": "/ip4/0.0.0.0/udp/4001/quic-v1"}, PEER, "192.0.2.7", 3.0
    )
    assert wildcard is not None
    assert Multiaddr.parse(wildcard.address).host == "192.0.2.7"
    assert caller_contact_untrusted({"client": True}, PEER, "10.0.0.2", 3.0) is None


def test_a_caller_is_noted_only_at_the_host_its_request_came_from() -> None:
    """A caller naming another host than the one it calls from is served but not noted: else
    every node that learns of it would dial a host of its choice."""

    def noted(address: str, remote_host: str | None) -> str | None:
        contact = caller_contact_untrusted({"address": address}, PEER, remote_host, 0.0)
        return None if contact is None else contact.address.removesuffix(f"/p2p/{PEER}")

    assert noted("/ip4/192.0.2.9/udp/4001/quic-v1", "10.0.0.2") is None
    # Through a relay, where it calls from is unknown; a relayed address is not dialled by
    # others as a DHT contact either (nodes behind NATs are DHT clients).
    assert noted("/ip4/10.0.0.2/udp/4001/quic-v1", None) is None
    relayed = f"/ip4/10.0.0.2/udp/4001/quic-v1/p2p/{OTHER}/p2p-circuit/p2p/{PEER}"
    assert noted(relayed, "10.0.0.2") is None
    # A DNS name is noted at the host the request came from, with its port.
    assert noted("/dns4/peer.example/udp/4001/quic-v1", "192.0.2.7") == (
        "/ip4/192.0.2.7/udp/4001/quic-v1"
    )
    # A host sends from temporary addresses of its IPv6 /64: it is noted at the one it names.
    assert noted("/ip6/2001:db8:0:1::10/udp/4001/quic-v1", "2001:db8:0:1:8a3f::5") == (
        "/ip6/2001:db8:0:1::10/udp/4001/quic-v1"
    )
    assert noted("/ip6/2001:db8:0:2::10/udp/4001/quic-v1", "2001:db8:0:1:8a3f::5") is None
    # An IPv4 address and its IPv4-mapped IPv6 form are one host.
    assert noted("/ip4/192.0.2.7/udp/4001/quic-v1", "::ffff:192.0.2.7") == (
        "/ip4/192.0.2.7/udp/4001/quic-v1"
    )


def test_a_contact_a_third_party_names_is_kept_as_the_host_that_answered_reaches_it() -> None:
    at = Contact.from_peer_id(PEER, f"/ip4/192.0.2.9/udp/4001/quic-v1/p2p/{PEER}", last_seen=1.0)
    assert seen_from(at, "192.0.2.9") == at
    # A live connection to the peer answered, from another host than the one named.
    assert seen_from(at, "198.51.100.3") is None
    # A DNS name (which could name any host later) is kept as the host it reached.
    named = attrs.evolve(at, address=f"/dns4/peer.example/udp/4001/quic-v1/p2p/{PEER}")
    assert seen_from(named, "198.51.100.3") == attrs.evolve(
        at, address=f"/ip4/198.51.100.3/udp/4001/quic-v1/p2p/{PEER}"
    )


@pytest.mark.parametrize(
    "request_",
    [
        {},
        {"address": 7},
        {"address": "not a multiaddr"},
        {"address": f"/ip4/10.0.0.2/udp/4001/quic-v1/p2p/{OTHER}"},
    ],
)
def test_a_caller_without_a_valid_address_is_refused(request_: dict[str, Any]) -> None:
    with pytest.raises(CodecError):
        caller_contact_untrusted(request_, PEER, "10.0.0.2", 0.0)


def test_a_find_value_reply_carries_more_records_than_a_store_request() -> None:
    encoded = encode_record(Record("k", "s", b"v", 100.0))
    assert len(decode_records_untrusted([encoded] * 1024, limit=MAX_RECORDS_PER_REPLY)) == 1024
    with pytest.raises(CodecError):
        decode_records_untrusted(
            [encoded] * (MAX_RECORDS_PER_REPLY + 1), limit=MAX_RECORDS_PER_REPLY
        )
