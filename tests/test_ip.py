"""IP addresses as the rules compare them."""

from __future__ import annotations

import ipaddress

import pytest

from petals_core._ip import ip_of


def test_an_ipv4_mapped_address_is_its_ipv4_host() -> None:
    assert ip_of("::ffff:198.51.100.7") == ipaddress.IPv4Address("198.51.100.7")
    assert ip_of("::ffff:127.0.0.1").is_loopback
    assert ip_of("198.51.100.7") == ipaddress.IPv4Address("198.51.100.7")
    assert ip_of("2001:db8::1") == ipaddress.IPv6Address("2001:db8::1")
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        ip_of("peer.example")
