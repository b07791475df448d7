from __future__ import annotations

import contextlib
import ipaddress

import pytest
from hypothesis import given, strategies as st

from petals_core._errors import ConfigError, InvalidMultiaddr
from petals_core.transport._identity import Identity, PeerID
from petals_core.transport._multiaddr import Multiaddr, as_multiaddr, dialable_multiaddrs

PEER_ID = Identity.from_private_bytes(bytes(32)).peer_id
OTHER_PEER_ID = Identity.from_private_bytes(bytes(31) + b"\x01").peer_id

ports = st.integers(min_value=0, max_value=65535)
peer_ids = st.none() | st.binary(min_size=32, max_size=32).map(
    lambda seed: Identity.from_private_bytes(seed).peer_id
)
ip_addresses = st.ip_addresses(v=4) | st.ip_addresses(v=6)


def _text(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, peer: object) -> str:
    text = f"/ip{address.version}/{address}/udp/{port}/quic-v1"
    return text if peer is None else f"{text}/p2p/{peer}"


@given(ip_addresses, ports, peer_ids)
def test_round_trip(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, peer_id: PeerID | None
) -> None:
    text = _text(address, port, peer_id)
    parsed = Multiaddr.parse(text)
    assert str(parsed) == text
    assert parsed == Multiaddr(str(address), port, peer_id)
    assert Multiaddr.parse(str(parsed)) == parsed
    assert hash(Multiaddr.parse(text)) == hash(parsed)
    assert parsed.family == address.version
    assert parsed.port == port
    assert parsed.peer_id == peer_id
    assert parsed.is_loopback == address.is_loopback
    assert parsed.socket_address == (str(address), port)


@given(st.ip_addresses(v=6), ports)
def test_ipv6_hosts_are_normalised(address: ipaddress.IPv6Address, port: int) -> None:
    exploded = f"/ip6/{address.exploded.upper()}/udp/{port}/quic-v1"
    assert str(Multiaddr.parse(exploded)) == f"/ip6/{address.compressed}/udp/{port}/quic-v1"


def test_examples() -> None:
    v4 = Multiaddr.parse(f"/ip4/1.2.3.4/udp/31337/quic-v1/p2p/{PEER_ID}")
    assert (v4.host, v4.port, v4.peer_id, v4.family) == ("1.2.3.4", 31337, PEER_ID, 4)
    assert not v4.is_loopback
    v6 = Multiaddr.parse("/ip6/0:0:0:0:0:0:0:1/udp/31337/quic-v1")
    assert (v6.host, v6.port, v6.peer_id, v6.family) == ("::1", 31337, None, 6)
    assert v6.is_loopback
    assert str(v6) == "/ip6/::1/udp/31337/quic-v1"
    assert Multiaddr.parse("/ip4/127.0.0.1/udp/0/quic-v1").is_loopback


def test_with_peer_id() -> None:
    bare = Multiaddr.parse("/ip4/10.0.0.1/udp/4000/quic-v1")
    named = bare.with_peer_id(PEER_ID)
    assert named.peer_id == PEER_ID
    assert bare.peer_id is None  # frozen: a new value, not a mutation
    assert named.with_peer_id(OTHER_PEER_ID).peer_id == OTHER_PEER_ID
    assert named.with_peer_id(None) == bare
    assert str(named) == f"/ip4/10.0.0.1/udp/4000/quic-v1/p2p/{PEER_ID}"


def test_from_socket_address() -> None:
    addr = Multiaddr.from_socket_address("::ffff:0:1", 5, PEER_ID)
    assert addr == Multiaddr("::ffff:0.0.0.1", 5, PEER_ID)
    assert addr.socket_address == ("::ffff:0:1", 5)
    assert Multiaddr.from_socket_address("192.168.0.1", 443).peer_id is None


def test_as_multiaddr() -> None:
    addr = Multiaddr("1.2.3.4", 1)
    assert as_multiaddr(addr) is addr
    assert as_multiaddr("/ip4/1.2.3.4/udp/1/quic-v1") == addr
    with pytest.raises(InvalidMultiaddr):
        as_multiaddr("/ip4/1.2.3.4/udp/1")


def test_is_frozen() -> None:
    addr = Multiaddr("1.2.3.4", 1)
    with pytest.raises(AttributeError):
        addr.port = 2  # type: ignore[misc]


def test_dns_names() -> None:
    for protocol, family in [("dns4", 4), ("dns6", 6), ("dns", None)]:
        text = f"/{protocol}/boot.Example.org/udp/31337/quic-v1/p2p/{PEER_ID}"
        parsed = Multiaddr.parse(text)
        assert (parsed.host, parsed.dns, parsed.family) == ("boot.Example.org", protocol, family)
        assert str(parsed) == text and Multiaddr.parse(str(parsed)) == parsed
        assert not parsed.is_loopback
        with pytest.raises(InvalidMultiaddr, match="resolve it before dialling"):
            _ = parsed.socket_address
    assert Multiaddr.parse("/dns/localhost/udp/1/quic-v1").is_loopback
    assert Multiaddr("example.com", 1, dns="dns4") == Multiaddr.parse(
        "/dns4/example.com/udp/1/quic-v1"
    )
    with pytest.raises(InvalidMultiaddr, match="dns is one of"):
        Multiaddr("example.com", 1, dns="dnsaddr")


@pytest.mark.parametrize(
    ("host", "port", "error"),
    [
        ("example.com", 1, InvalidMultiaddr),
        ("", 1, InvalidMultiaddr),
        ("1.2.3.4 ", 1, InvalidMultiaddr),
        ("fe80::1%eth0", 1, InvalidMultiaddr),
        ("1.2.3.4", -1, InvalidMultiaddr),
        ("1.2.3.4", 65536, InvalidMultiaddr),
        ("1.2.3.4", True, TypeError),
        ("1.2.3.4", "1", TypeError),
        (16909060, 1, TypeError),
    ],
)
def test_invalid_construction(host: object, port: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        Multiaddr(host, port)  # type: ignore[arg-type]


def test_peer_id_must_be_a_peer_id() -> None:
    with pytest.raises(TypeError):
        Multiaddr("1.2.3.4", 1, str(PEER_ID))  # type: ignore[arg-type]


V4 = "/ip4/1.2.3.4/udp/31337/quic-v1"

INVALID = [
    ("", "starts with '/'"),
    ("ip4/1.2.3.4/udp/1/quic-v1", "starts with '/'"),
    (" " + V4, "starts with '/'"),
    ("/", "empty component"),
    (V4 + "/", "empty component"),
    ("/ip4//udp/1/quic-v1", "empty component"),
    ("/ip4/1.2.3.4//udp/1/quic-v1", "empty component"),
    ("/ip4", "ends after /ip4"),
    ("/ip4/1.2.3.4", "ends after /ip4/1.2.3.4"),
    ("/ip4/1.2.3.4/udp", "ends after /udp"),
    ("/ip4/1.2.3.4/udp/1", "ends after /udp/1"),
    (V4 + "/p2p", "ends after /p2p"),
    ("/ip5/1.2.3.4/udp/1/quic-v1", "unknown protocol /ip5"),
    ("/IP4/1.2.3.4/udp/1/quic-v1", "unknown protocol /IP4"),
    ("/dns4/exa_mple.com/udp/1/quic-v1", "/dns4 needs a DNS name, got 'exa_mple.com'"),
    ("/dns/-bad.example/udp/1/quic-v1", "/dns needs a DNS name"),
    ("/dns6/1.2.3.4/udp/1/quic-v1", "/dns6 needs a DNS name, got '1.2.3.4'"),
    ("/dns4/example.com/tcp/31337", "petals_core speaks QUIC over UDP"),
    ("/dnsaddr/bootstrap.example.com", "/dnsaddr (names found in DNS TXT records)"),
    ("/ip4/example.com/udp/1/quic-v1", "DNS names are not supported"),
    ("/ip4/::1/udp/1/quic-v1", "/ip4 given the IPv6 address"),
    ("/ip6/127.0.0.1/udp/1/quic-v1", "/ip6 given the IPv4 address"),
    ("/ip4/1.2.3/udp/1/quic-v1", "IP address literal"),
    ("/ip4/1.2.3.256/udp/1/quic-v1", "IP address literal"),
    ("/ip4/01.2.3.4/udp/1/quic-v1", "IP address literal"),
    ("/ip6/[::1]/udp/1/quic-v1", "IP address literal"),
    ("/ip6/fe80::1%eth0/udp/1/quic-v1", "zone indices are not supported"),
    ("/ip4/1.2.3.4/tcp/31337", "petals_core speaks QUIC over UDP; use /udp/PORT/quic-v1"),
    ("/ip4/1.2.3.4/sctp/1/quic-v1", "unknown protocol /sctp where /udp belongs"),
    ("/ip4/1.2.3.4/udp/65536/quic-v1", "port '65536'"),
    ("/ip4/1.2.3.4/udp/99999999999999999999/quic-v1", "port"),
    ("/ip4/1.2.3.4/udp/-1/quic-v1", "port '-1'"),
    ("/ip4/1.2.3.4/udp/+1/quic-v1", "port '+1'"),
    ("/ip4/1.2.3.4/udp/0x10/quic-v1", "port '0x10'"),
    ("/ip4/1.2.3.4/udp/080/quic-v1", "leading zeros"),
    ("/ip4/1.2.3.4/udp/1 /quic-v1", "port '1 '"),
    ("/ip4/1.2.3.4/udp/\u0661/quic-v1", "port"),  # an Arabic-Indic digit one
    ("/ip4/1.2.3.4/udp/1/quic", "/quic (draft-29) is not supported"),
    ("/ip4/1.2.3.4/udp/1/quic-v2", "unknown protocol /quic-v2 where /quic-v1 belongs"),
    ("/ip4/1.2.3.4/udp/1/webtransport", "where /quic-v1 belongs"),
    ("/ip4/1.2.3.4/udp/1/quic-v1\n", "where /quic-v1 belongs"),
    (V4 + "/ipfs/" + str(PEER_ID), "only /p2p/<PeerID> may follow"),
    (V4 + "/webtransport", "only /p2p/<PeerID> may follow"),
    (V4 + "/p2p/QmNotAPeer", "bad PeerID"),
    (V4 + "/p2p/" + str(PEER_ID) + "x", "bad PeerID"),
    (V4 + "/p2p/" + str(PEER_ID) + "/p2p-circuit", "ends after /p2p-circuit"),
    (V4 + "/p2p-circuit/p2p/" + str(PEER_ID), "only /p2p/<PeerID> may follow"),
    (V4 + "/p2p/" + str(PEER_ID) + "/p2p/" + str(PEER_ID), "only /p2p-circuit/p2p/<PeerID>"),
    (V4 + "/p2p/" + str(PEER_ID) + "/p2p-circuit/ipfs/x", "after /p2p-circuit, expected /p2p"),
    (V4 + "/p2p/" + str(PEER_ID) + "/p2p-circuit/p2p", "ends after /p2p-circuit/p2p"),
    (V4 + "/p2p/" + str(PEER_ID) + "/p2p-circuit/p2p/Qm", "bad PeerID after /p2p-circuit"),
    (V4 + "/p2p/" + str(PEER_ID) + "/p2p-circuit/p2p/" + str(PEER_ID), "other than the relay"),
    (
        V4 + "/p2p/" + str(PEER_ID) + "/p2p-circuit/p2p/" + str(OTHER_PEER_ID) + "/x",
        "trailing /x",
    ),
]


def test_relayed_addresses() -> None:
    relay = Multiaddr.parse(f"{V4}/p2p/{PEER_ID}")
    relayed = relay.relayed(OTHER_PEER_ID)
    text = f"{V4}/p2p/{PEER_ID}/p2p-circuit/p2p/{OTHER_PEER_ID}"
    assert str(relayed) == text and Multiaddr.parse(text) == relayed
    assert relayed.is_relayed and not relay.is_relayed
    assert relayed.peer_id == OTHER_PEER_ID and relayed.relay == PEER_ID
    assert relayed.relay_multiaddr == relay and relay.relay_multiaddr == relay
    assert relayed.socket_address == relay.socket_address
    dns = Multiaddr.parse(f"/dns4/relay.example.com/udp/4001/quic-v1/p2p/{PEER_ID}")
    assert Multiaddr.parse(str(dns.relayed(OTHER_PEER_ID))).dns == "dns4"
    with pytest.raises(InvalidMultiaddr, match="not a relay's direct address"):
        relayed.relayed(PEER_ID)
    with pytest.raises(InvalidMultiaddr, match="not a relay's direct address"):
        Multiaddr.parse(V4).relayed(PEER_ID)
    with pytest.raises(InvalidMultiaddr, match="names the peer behind the relay"):
        relayed.with_peer_id(None)


@pytest.mark.parametrize(("text", "problem"), INVALID)
def test_invalid_inputs_are_rejected(text: str, problem: str) -> None:
    with pytest.raises(InvalidMultiaddr) as info:
        Multiaddr.parse(text)
    message = str(info.value)
    assert message.startswith(f"invalid multiaddr {text!r}: ")
    assert problem in message
    assert "expected /ip4/<IPv4 address>/udp/<port>/quic-v1[/p2p/<PeerID>]" in message
    assert isinstance(info.value, ConfigError)


def test_parse_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        Multiaddr.parse(b"/ip4/1.2.3.4/udp/1/quic-v1")  # type: ignore[arg-type]


_prefixes = st.sampled_from(["", "/", "/ip4/", "/ip6/", "/ip4/1.2.3.4/udp/", V4, V4 + "/p2p/"])


@given(_prefixes, st.text())
def test_parse_of_arbitrary_text_raises_only_invalid_multiaddr(prefix: str, tail: str) -> None:
    with contextlib.suppress(InvalidMultiaddr):
        Multiaddr.parse(prefix + tail)


_components = st.sampled_from(
    [
        "ip4",
        "ip6",
        "udp",
        "tcp",
        "quic-v1",
        "quic",
        "p2p",
        "1.2.3.4",
        "::1",
        "1",
        "65536",
        "",
        str(PEER_ID),
        "dns4",
        "x",
    ]
)


@given(st.lists(_components, max_size=9))
def test_parse_of_shuffled_components_is_strict(parts: list[str]) -> None:
    text = "/" + "/".join(parts)
    try:
        addr = Multiaddr.parse(text)
    except InvalidMultiaddr:
        return
    assert str(addr) == text


def test_announced_addresses_keep_ip_literals_and_dns_names() -> None:
    listen = Multiaddr.parse("/ip4/0.0.0.0/udp/31337/quic-v1")
    assert [str(m) for m in dialable_multiaddrs(listen, announce_host="203.0.113.7")] == [
        "/ip4/203.0.113.7/udp/31337/quic-v1"
    ]
    assert [str(m) for m in dialable_multiaddrs(listen, announce_host="boot.example.org")] == [
        "/dns4/boot.example.org/udp/31337/quic-v1"
    ]
    six = Multiaddr.parse("/ip6/::/udp/7/quic-v1")
    assert [str(m) for m in dialable_multiaddrs(six, announce_host="boot.example.org")] == [
        "/dns6/boot.example.org/udp/7/quic-v1"
    ]


def test_a_client_listens_where_it_can_reach_its_peers() -> None:
    from petals_core.transport import client_listen_host

    peer = "/udp/31337/quic-v1"
    assert client_listen_host([f"/ip4/127.0.0.1{peer}"]) == "127.0.0.1"
    assert client_listen_host([f"/ip6/::1{peer}"]) == "::1"
    assert client_listen_host([f"/dns4/localhost{peer}"]) == "127.0.0.1"
    # A socket bound to loopback cannot send to another machine: every interface then.
    assert client_listen_host([f"/ip4/10.0.0.1{peer}"]) == "0.0.0.0"
    assert client_listen_host([f"/ip4/127.0.0.1{peer}", f"/ip4/10.0.0.1{peer}"]) == "0.0.0.0"
    assert client_listen_host([f"/dns4/boot.example.org{peer}"]) == "0.0.0.0"
    assert client_listen_host([f"/ip4/10.0.0.1{peer}", f"/ip6/2001:db8::1{peer}"]) == "::"
    assert client_listen_host([]) == "0.0.0.0"
    with pytest.raises(InvalidMultiaddr):
        client_listen_host(["/ip4/10.0.0.1/tcp/31337"])
