"""Peer addresses as multiaddrs: ``/ip4|ip6/<address>/udp/<port>/quic-v1[/p2p/<PeerID>]``.

Only this one shape is accepted, strictly: the transport speaks QUIC v1 over UDP to literal IP
addresses, so TCP, DNS names, other QUIC versions and anything after the PeerID are refused with an
error that quotes the input and names the expected form, rather than half-understood.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Final

import attrs

from .._errors import ConfigError, InvalidMultiaddr
from ._identity import PeerID

__all__ = ["Multiaddr", "as_multiaddr", "dialable_multiaddrs"]

_EXPECTED_FORM: Final = (
    "/ip4/<IPv4 address>/udp/<port>/quic-v1[/p2p/<PeerID>] "
    "or /ip6/<IPv6 address>/udp/<port>/quic-v1[/p2p/<PeerID>]"
)
_DNS_PROTOCOLS: Final = frozenset({"dns", "dns4", "dns6", "dnsaddr"})
# Decimal without sign or leading zeros, so that every port has exactly one spelling.
_PORT_PATTERN: Final = re.compile(r"0|[1-9][0-9]{0,4}", re.ASCII)
_MAX_PORT: Final = 65535


def _normalise_host(host: str) -> str:
    """The canonical text of an IP address literal (e.g. ``::0001`` becomes ``::1``)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str, got {type(host).__name__}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise InvalidMultiaddr(
            f"invalid host {host!r}: expected an IPv4 or IPv6 address literal "
            f"(DNS names are not supported)"
        ) from None
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise InvalidMultiaddr(f"invalid host {host!r}: IPv6 zone indices are not supported")
    return str(address)


def _check_port(instance: Multiaddr, attribute: attrs.Attribute[int], port: int) -> None:
    if not isinstance(port, int) or isinstance(port, bool):
        raise TypeError(f"port must be an int, got {type(port).__name__}")
    if not 0 <= port <= _MAX_PORT:
        raise InvalidMultiaddr(f"invalid port {port}: expected 0..{_MAX_PORT}")


@attrs.frozen
class Multiaddr:
    """Where to reach a peer over QUIC: an IP address, a UDP port and optionally its PeerID."""

    host: str = attrs.field(converter=_normalise_host)
    port: int = attrs.field(validator=_check_port)
    peer_id: PeerID | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(PeerID))
    )

    @classmethod
    def parse(cls, text: str) -> Multiaddr:
        """Parse the text form; raises InvalidMultiaddr quoting ``text`` and the expected form."""
        if not isinstance(text, str):
            raise TypeError(f"expected a multiaddr str, got {type(text).__name__}")
        if not text.startswith("/"):
            raise _invalid(text, "a multiaddr starts with '/'")
        parts = text[1:].split("/")
        if "" in parts:
            raise _invalid(text, "empty component (doubled or trailing '/')")

        protocol = parts[0]
        if protocol in _DNS_PROTOCOLS:
            raise _invalid(text, f"/{protocol}: DNS names are not supported, give an IP address")
        if protocol not in ("ip4", "ip6"):
            raise _invalid(text, f"unknown protocol /{protocol} where /ip4 or /ip6 belongs")
        host = _parse_host_untrusted(text, protocol, _component(text, parts, 1, f"/{protocol}"))

        transport = _component(text, parts, 2, f"/{protocol}/{parts[1]}")
        if transport == "tcp":
            raise _invalid(text, "petals_core speaks QUIC over UDP; use /udp/PORT/quic-v1")
        if transport != "udp":
            raise _invalid(text, f"unknown protocol /{transport} where /udp belongs")
        port = _parse_port_untrusted(text, _component(text, parts, 3, "/udp"))

        quic = _component(text, parts, 4, f"/udp/{parts[3]}")
        if quic == "quic":
            raise _invalid(text, "/quic (draft-29) is not supported, use /quic-v1")
        if quic != "quic-v1":
            raise _invalid(text, f"unknown protocol /{quic} where /quic-v1 belongs")

        if len(parts) == 5:
            return cls(host, port)
        if parts[5] != "p2p":
            raise _invalid(
                text, f"unexpected /{parts[5]} after /quic-v1, only /p2p/<PeerID> may follow"
            )
        peer_text = _component(text, parts, 6, "/p2p")
        try:
            peer_id = PeerID.from_string(peer_text)
        except ConfigError as exc:
            raise _invalid(text, f"bad PeerID after /p2p ({exc})") from exc
        if len(parts) > 7:
            raise _invalid(text, f"unexpected trailing /{'/'.join(parts[7:])} after the PeerID")
        return cls(host, port, peer_id)

    @classmethod
    def from_socket_address(cls, host: str, port: int, peer_id: PeerID | None = None) -> Multiaddr:
        return cls(host, port, peer_id)

    @property
    def family(self) -> int:
        """4 or 6."""
        # The host is normalised, and only IPv6 text contains ':'.
        return 6 if ":" in self.host else 4

    @property
    def is_loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    @property
    def socket_address(self) -> tuple[str, int]:
        return (self.host, self.port)

    def with_peer_id(self, peer_id: PeerID | None) -> Multiaddr:
        return attrs.evolve(self, peer_id=peer_id)

    def __str__(self) -> str:
        text = f"/ip{self.family}/{self.host}/udp/{self.port}/quic-v1"
        if self.peer_id is not None:
            text += f"/p2p/{self.peer_id}"
        return text


def as_multiaddr(value: Multiaddr | str) -> Multiaddr:
    """Pass a Multiaddr through; parse a str."""
    if isinstance(value, Multiaddr):
        return value
    return Multiaddr.parse(value)


def _invalid(text: str, problem: str) -> InvalidMultiaddr:
    return InvalidMultiaddr(f"invalid multiaddr {text!r}: {problem}; expected {_EXPECTED_FORM}")


def _component(text: str, parts: list[str], index: int, after: str) -> str:
    if index >= len(parts):
        raise _invalid(text, f"it ends after {after}")
    return parts[index]


def _parse_host_untrusted(text: str, protocol: str, value: str) -> str:
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise _invalid(
            text,
            f"/{protocol} needs an IP address literal, got {value!r} (DNS names are not supported)",
        ) from None
    if protocol == "ip4" and address.version != 4:
        raise _invalid(text, f"/ip4 given the IPv6 address {value!r}, use /ip6")
    if protocol == "ip6" and address.version != 6:
        raise _invalid(text, f"/ip6 given the IPv4 address {value!r}, use /ip4")
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise _invalid(text, f"IPv6 zone indices are not supported ({value!r})")
    return str(address)


def _parse_port_untrusted(text: str, value: str) -> int:
    if _PORT_PATTERN.fullmatch(value) is None or int(value) > _MAX_PORT:
        raise _invalid(
            text,
            f"port {value!r} is not a decimal number 0..{_MAX_PORT} (no sign, no leading zeros)",
        )
    return int(value)


def dialable_multiaddrs(listen: Multiaddr, *, announce_host: str | None = None) -> list[Multiaddr]:
    """Addresses others can dial to reach a node listening on ``listen``.

    ``announce_host`` (a public address, e.g. behind port forwarding) wins.  A node on a
    wildcard host (``0.0.0.0`` / ``::``) listens on every interface of its family: its loopback
    address first, then the addresses this machine's name resolves to.  Otherwise ``listen``.
    """
    if announce_host is not None:
        return [attrs.evolve(listen, host=announce_host)]
    if not ipaddress.ip_address(listen.host).is_unspecified:
        return [listen]
    family = socket.AF_INET if listen.family == 4 else socket.AF_INET6
    hosts = ["127.0.0.1" if listen.family == 4 else "::1"]
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_DGRAM)
    except OSError:
        infos = []
    for info in infos:
        host = str(info[4][0]).split("%", 1)[0]
        if host not in hosts and not ipaddress.ip_address(host).is_unspecified:
            hosts.append(host)
    return [attrs.evolve(listen, host=host) for host in hosts]
