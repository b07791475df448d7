"""Peer addresses as multiaddrs: ``/ip4|ip6|dns4|dns6|dns/<host>/udp/<port>/quic-v1[/p2p/<ID>]``.

A peer reached through a relay (it cannot be dialled directly, e.g. behind a NAT) has a
relayed address: the relay's, then ``/p2p-circuit/p2p/<the peer's ID>``.  Only these shapes are
accepted, strictly: the transport speaks QUIC v1 over UDP, so TCP, other
QUIC versions and anything after the PeerID are refused with an error that quotes the input and
names the expected form, rather than half-understood.  A DNS name (``/dns4`` for IPv4, ``/dns6``
for IPv6, ``/dns`` for either) stays a name here; the node resolves it when it dials.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Final

import attrs
import ifaddr

from .._errors import ConfigError, InvalidMultiaddr
from ._identity import PeerID

__all__ = [
    "Multiaddr",
    "as_multiaddr",
    "client_listen_host",
    "dialable_multiaddrs",
    "interface_hosts",
]

_EXPECTED_FORM: Final = (
    "/ip4/<IPv4 address>/udp/<port>/quic-v1[/p2p/<PeerID>] "
    "(or /ip6/<IPv6 address>, /dns4|dns6|dns/<DNS name> in place of /ip4/...; "
    "through a relay: the relay's address with its PeerID, then /p2p-circuit/p2p/<PeerID>)"
)
#: The DNS protocols and the address family each resolves to (None: either).
DNS_PROTOCOLS: Final[dict[str, int | None]] = {"dns": None, "dns4": 4, "dns6": 6}
# A DNS name: dot-separated labels of letters, digits and inner hyphens, 253 characters at most.
_DNS_LABEL: Final = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)", re.ASCII)
# Decimal without sign or leading zeros, so that every port has exactly one spelling.
_PORT_PATTERN: Final = re.compile(r"0|[1-9][0-9]{0,4}", re.ASCII)
_MAX_PORT: Final = 65535


def _normalise_host(host: str) -> str:
    """The canonical text of an IP address literal (e.g. ``::0001`` becomes ``::1``); anything
    else is left as it is (a DNS name, checked with the multiaddr's ``dns`` field)."""
    if not isinstance(host, str):
        raise TypeError(f"host must be a str, got {type(host).__name__}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        raise InvalidMultiaddr(f"invalid host {host!r}: IPv6 zone indices are not supported")
    return str(address)


def is_dns_name(name: str) -> bool:
    """Whether ``name`` is a syntactically valid DNS name (not an IP address literal)."""
    labels = name.removesuffix(".").split(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
        return False
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return not labels[-1].isdigit()
    return False


def _check_port(instance: Multiaddr, attribute: attrs.Attribute[int], port: int) -> None:
    if not isinstance(port, int) or isinstance(port, bool):
        raise TypeError(f"port must be an int, got {type(port).__name__}")
    if not 0 <= port <= _MAX_PORT:
        raise InvalidMultiaddr(f"invalid port {port}: expected 0..{_MAX_PORT}")


@attrs.frozen
class Multiaddr:
    """Where to reach a peer over QUIC: an IP address (or, with ``dns``, a DNS name resolved
    when dialled), a UDP port and optionally its PeerID.

    With ``relay`` (the relay's PeerID), ``host`` and ``port`` are the relay's, and ``peer_id``
    is the peer reached through it (required)."""

    host: str = attrs.field(converter=_normalise_host)
    port: int = attrs.field(validator=_check_port)
    peer_id: PeerID | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(PeerID))
    )
    #: ``"dns"``, ``"dns4"`` or ``"dns6"`` when ``host`` is a DNS name; None for an IP address.
    dns: str | None = attrs.field(default=None, kw_only=True)
    #: The PeerID of the relay at ``host``/``port`` that forwards to ``peer_id``; None: direct.
    relay: PeerID | None = attrs.field(
        default=None,
        kw_only=True,
        validator=attrs.validators.optional(attrs.validators.instance_of(PeerID)),
    )

    def __attrs_post_init__(self) -> None:
        if self.relay is not None and self.peer_id is None:
            raise InvalidMultiaddr("a relayed address names the peer behind the relay")
        if self.relay is not None and self.relay == self.peer_id:
            raise InvalidMultiaddr("a relayed address names a peer other than the relay")
        if self.dns is None:
            try:
                ipaddress.ip_address(self.host)
            except ValueError:
                raise InvalidMultiaddr(
                    f"invalid host {self.host!r}: an IP address literal, or a DNS name with "
                    "dns='dns4' (or 'dns6', 'dns')"
                ) from None
        elif self.dns not in DNS_PROTOCOLS:
            raise InvalidMultiaddr(f"dns is one of {', '.join(DNS_PROTOCOLS)}, not {self.dns!r}")
        elif not is_dns_name(self.host):
            raise InvalidMultiaddr(f"invalid DNS name {self.host!r}")

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
        dns = None
        if protocol == "dnsaddr":
            raise _invalid(text, "/dnsaddr (names found in DNS TXT records) is not supported")
        if protocol in DNS_PROTOCOLS:
            dns = protocol
            host = _component(text, parts, 1, f"/{protocol}")
            if not is_dns_name(host):
                raise _invalid(text, f"/{protocol} needs a DNS name, got {host!r}")
        elif protocol in ("ip4", "ip6"):
            host = _parse_host_untrusted(text, protocol, _component(text, parts, 1, f"/{protocol}"))
        else:
            raise _invalid(text, f"unknown protocol /{protocol} where /ip4 or /ip6 belongs")

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
            return cls(host, port, dns=dns)
        if parts[5] != "p2p":
            raise _invalid(
                text, f"unexpected /{parts[5]} after /quic-v1, only /p2p/<PeerID> may follow"
            )
        peer_text = _component(text, parts, 6, "/p2p")
        try:
            peer_id = PeerID.from_string(peer_text)
        except ConfigError as exc:
            raise _invalid(text, f"bad PeerID after /p2p ({exc})") from exc
        if len(parts) == 7:
            return cls(host, port, peer_id, dns=dns)
        if parts[7] != "p2p-circuit":
            raise _invalid(
                text,
                f"unexpected /{parts[7]} after the PeerID, "
                "only /p2p-circuit/p2p/<PeerID> may follow",
            )
        if _component(text, parts, 8, "/p2p-circuit") != "p2p":
            raise _invalid(text, f"unexpected /{parts[8]} after /p2p-circuit, expected /p2p")
        target_text = _component(text, parts, 9, "/p2p-circuit/p2p")
        try:
            target = PeerID.from_string(target_text)
        except ConfigError as exc:
            raise _invalid(text, f"bad PeerID after /p2p-circuit/p2p ({exc})") from exc
        if len(parts) > 10:
            raise _invalid(text, f"unexpected trailing /{'/'.join(parts[10:])} after the PeerID")
        if target == peer_id:
            raise _invalid(text, "a relayed address names a peer other than the relay")
        return cls(host, port, target, dns=dns, relay=peer_id)

    @classmethod
    def from_socket_address(cls, host: str, port: int, peer_id: PeerID | None = None) -> Multiaddr:
        return cls(host, port, peer_id)

    @property
    def family(self) -> int | None:
        """4 or 6 (None for ``/dns``, which resolves to either)."""
        if self.dns is not None:
            return DNS_PROTOCOLS[self.dns]
        # The host is normalised, and only IPv6 text contains ':'.
        return 6 if ":" in self.host else 4

    @property
    def is_loopback(self) -> bool:
        if self.dns is not None:
            return self.host.lower().removesuffix(".") == "localhost"
        return ipaddress.ip_address(self.host).is_loopback

    @property
    def is_relayed(self) -> bool:
        return self.relay is not None

    @property
    def relay_multiaddr(self) -> Multiaddr:
        """The relay's own address (with its PeerID); ``self`` for a direct address."""
        if self.relay is None:
            return self
        return attrs.evolve(self, peer_id=self.relay, relay=None)

    def relayed(self, peer_id: PeerID) -> Multiaddr:
        """``peer_id`` reached through this address's peer, a relay (whose PeerID it names)."""
        if self.peer_id is None or self.relay is not None:
            raise InvalidMultiaddr(f"{self} is not a relay's direct address with its PeerID")
        return attrs.evolve(self, peer_id=peer_id, relay=self.peer_id)

    @property
    def socket_address(self) -> tuple[str, int]:
        """The IP address and port to send to; a DNS name must be resolved first."""
        if self.dns is not None:
            raise InvalidMultiaddr(f"{self} names a DNS name: resolve it before dialling")
        return (self.host, self.port)

    def with_peer_id(self, peer_id: PeerID | None) -> Multiaddr:
        return attrs.evolve(self, peer_id=peer_id)

    def __str__(self) -> str:
        protocol = self.dns if self.dns is not None else f"ip{self.family}"
        text = f"/{protocol}/{self.host}/udp/{self.port}/quic-v1"
        if self.relay is not None:
            text += f"/p2p/{self.relay}/p2p-circuit"
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


def client_listen_host(peers: Iterable[Multiaddr | str]) -> str:
    """Where a node that dials ``peers`` (a client) listens: on loopback when every peer is there,
    else on every interface (``0.0.0.0``, or ``::`` when a peer is IPv6), since a socket bound to
    loopback cannot send anywhere else.  Raises :class:`InvalidMultiaddr` for a malformed peer."""
    addresses = [as_multiaddr(peer) for peer in peers]
    if addresses and all(address.is_loopback for address in addresses):
        return "::1" if all(address.family == 6 for address in addresses) else "127.0.0.1"
    return "::" if any(address.family == 6 for address in addresses) else "0.0.0.0"


def dialable_multiaddrs(
    listen: Multiaddr, *, announce_host: str | None = None, announce_port: int | None = None
) -> list[Multiaddr]:
    """Addresses others can dial to reach a node listening on ``listen``.

    ``announce_host`` (a public address, e.g. behind port forwarding) wins; ``announce_port``
    replaces the port (a router forwarding another port to this one).  A node on a
    wildcard host (``0.0.0.0`` / ``::``) listens on every interface of its family (``::`` takes
    IPv4 too): the loopback address first, then each interface's (:func:`interface_hosts`).
    Otherwise ``listen``.
    """
    if announce_port is not None:
        listen = attrs.evolve(listen, port=announce_port)
    if announce_host is not None:
        if is_dns_name(announce_host):
            dns = {4: "dns4", 6: "dns6"}.get(listen.family or 0, "dns")
            return [attrs.evolve(listen, host=announce_host, dns=dns)]
        return [attrs.evolve(listen, host=announce_host, dns=None)]
    if not ipaddress.ip_address(listen.host).is_unspecified:
        return [listen]
    families = (4,) if listen.family == 4 else (4, 6)
    hosts = ["127.0.0.1"] if listen.family == 4 else ["127.0.0.1", "::1"]
    hosts += [host for host in interface_hosts(families) if host not in hosts]
    return [attrs.evolve(listen, host=host) for host in hosts]


def interface_hosts(families: tuple[int, ...] = (4, 6)) -> list[str]:
    """This machine's interfaces' addresses of these IP versions, as the system lists them
    (``ifaddr``), IPv4 first: every address but loopback, unspecified and link-local ones
    (an IPv6 link-local address needs its interface named to be dialled)."""
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            # ifaddr gives IPv4 as a string, IPv6 as (address, flowinfo, scope_id).
            address = ipaddress.ip_address(ip.ip if isinstance(ip.ip, str) else ip.ip[0])
            if (
                address.version in families
                and not address.is_loopback
                and not address.is_unspecified
                and not address.is_link_local
                and address not in found
            ):
                found.append(address)
    return [str(address) for address in sorted(found, key=lambda a: a.version)]
