"""IP addresses as rules compare and classify them: an IPv4 peer seen through a dual-stack
socket (``::ffff:a.b.c.d``) is the IPv4 host it is."""

from __future__ import annotations

import ipaddress

__all__ = ["ip_of"]


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``host`` as an IP address, an IPv4-mapped IPv6 one as its IPv4 address; ``ValueError``
    if it is not an IP address."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
