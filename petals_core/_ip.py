"""IP addresses as rules compare and classify them: an IPv4 peer seen through a dual-stack
socket (``::ffff:a.b.c.d``) is the IPv4 host it is."""

from __future__ import annotations

import ipaddress

__all__ = ["SITE_PREFIX", "host_of", "ip_of", "network_of", "places_of"]

#: The IPv6 prefix of a site (a home, a campus, a hosting customer: 65,536 /64s).
SITE_PREFIX = 48


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an IP address, an IPv4-mapped IPv6 one as its IPv4 address; ``ValueError``
    if it is not an IP address."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def network_of(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, ipv6_prefix: int) -> str:
    """The host ``ip`` stands for in per-host bounds: an IPv4 address itself, an IPv6 one its
    network of ``ipv6_prefix`` bits (a machine, or a line, picks its addresses in it)."""
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/{ipv6_prefix}", strict=False))
    return str(ip)


def host_of(host: str, ipv6_prefix: int = 64) -> str:
    """:func:`network_of` a socket's peer address (a zone index left out); anything that is
    not an IP address as it is."""
    try:
        ip = ip_of(host.split("%", 1)[0])
    except ValueError:
        return host
    return network_of(ip, ipv6_prefix)


def places_of(host: str) -> tuple[str, ...]:
    """What a socket's peer address counts towards in per-host bounds: its host
    (:func:`host_of`), and for an IPv6 address its site too (its /48, many /64s)."""
    place, site = host_of(host), host_of(host, SITE_PREFIX)
    return (place,) if site == place else (place, site)
