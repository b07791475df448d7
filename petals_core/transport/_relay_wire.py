"""What travels beside QUIC on a node's UDP socket: relayed datagrams and hole-punching probes.

Every QUIC v1 packet has the "fixed bit" (0x40) of its first byte set (RFC 9000, 17.2 and 17.3),
so a datagram whose first byte is below 0x40 cannot be QUIC: those are ours.

- ``0x00`` + channel (4 bytes, big-endian) + a QUIC datagram: a datagram a relay forwards.  The
  relay reads only the header; the QUIC datagram inside stays encrypted end to end.
- ``0x01`` + anything: a hole-punching probe.  It exists to open the sender's NAT towards the
  receiver; the receiver drops it.
- ``0x02`` + a connection id + ...: a repair for a connection's datagrams (see ``_repair``),
  directly or inside a relayed datagram.

A connection through a relay has a *virtual address* in place of its peer's socket address: the
relay's address with the channel in the host, e.g. ``("relay-0000002a@198.51.100.7", 4001)``.
The node turns it into the relay's socket address and a header when it sends, and back when a
relayed datagram arrives.
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = [
    "PUNCH",
    "PUNCH_PROBE",
    "RELAYED",
    "RELAY_HEADER",
    "is_quic",
    "is_virtual",
    "split_virtual",
    "virtual_address",
]

Address = tuple[str, int]

#: First byte of a datagram that a relay forwards.
RELAYED: Final = 0x00
#: First byte of a hole-punching probe.
PUNCH: Final = 0x01
#: What a hole-punching probe carries.
PUNCH_PROBE: Final = bytes([PUNCH]) + b"punch"
#: Marker and channel in front of a relayed datagram.
RELAY_HEADER: Final = struct.Struct("!BI")
_PREFIX: Final = "relay-"


def is_quic(data: bytes) -> bool:
    """Whether ``data`` may be a QUIC packet (not one of ours)."""
    return bool(data) and bool(data[0] & 0x40)


def virtual_address(relay: Address, channel: int) -> Address:
    """The address a connection through ``relay`` on ``channel`` is known by."""
    return (f"{_PREFIX}{channel:08x}@{relay[0]}", relay[1])


def is_virtual(address: Address) -> bool:
    """Whether ``address`` is a virtual one (a connection through a relay)."""
    return address[0].startswith(_PREFIX)


def split_virtual(address: Address) -> tuple[Address, int] | None:
    """The relay's socket address and the channel of a virtual address; None for a real one."""
    host = address[0]
    if not host.startswith(_PREFIX):
        return None
    channel, _, relay_host = host[len(_PREFIX) :].partition("@")
    return (relay_host, address[1]), int(channel, 16)
