"""One connection as the endpoint keeps it, the application codes its closes carry, and the
error its end becomes."""

from __future__ import annotations

import attrs
from aioquic.quic import events as qe
from aioquic.quic.packet import QuicErrorCode

from .._errors import (
    ConnectionClosed,
    ConnectTimeout,
    IdentityMismatch,
    RemoteProtocolError,
    TransportError,
)
from .._ip import ip_of
from ._config import ALPN
from ._endpoint_events import Address
from ._identity import PeerID
from ._quic import PeerQuicConnection
from ._repair import RepairDecoder, RepairEncoder

__all__ = [
    "APP_CANCELLED",
    "APP_CLOSED",
    "APP_IDENTITY",
    "APP_PROTOCOL",
    "APP_REFUSED",
    "Conn",
    "format_address",
    "is_loopback",
    "locally_initiated",
    "no_data_pending",
    "refresh_timer",
    "termination_error",
]

# Application error codes on the wire (QUIC leaves their meaning to us), kept clear of the
# transport's own codes (0x0-0x10, 0x100-0x1ff) so that a misfiled close cannot be misread.
APP_CLOSED = 0x0
APP_IDENTITY = 0x1001
APP_CANCELLED = 0x1010
APP_REFUSED = 0x1011
APP_PROTOCOL = 0x1012
# TLS alert "no_application_protocol" arrives as a CRYPTO_ERROR of 0x100 + 120.
_NO_ALPN = 0x100 + 120


def is_loopback(host: str) -> bool:
    try:
        return ip_of(host).is_loopback
    except ValueError:
        return False


@attrs.define(eq=False)
class Conn:
    handle: int
    quic: PeerQuicConnection
    address: Address
    is_client: bool
    expected_peer_id: PeerID | None
    connect_deadline: float | None
    peer_id: PeerID | None = None
    ready: bool = False
    lost: bool = False
    last_activity: float = 0.0
    keepalive_at: float | None = None
    #: When the last datagram from the peer arrived.
    last_received: float = 0.0
    #: While calls are open and the peer is silent: when probing began, and the next probe.
    probing_since: float | None = None
    probe_at: float | None = None
    # The soonest of aioquic's timer, the keep-alive and the connect deadline, as of the last
    # time this connection's output was collected (aioquic's get_timer is not cheap).
    timer_at: float | None = None
    # Streams the application holds: stream_id -> bytes delivered but not consumed yet.
    open_streams: dict[int, int] = attrs.Factory(dict)
    # Peer-opened streams the application let go of while aioquic still tracks them.
    released: set[int] = attrs.Factory(set)
    # Repairs (see ``_repair``): made while the path loses datagrams; taken while the peer
    # sends them.
    repair_out: RepairEncoder | None = None
    repair_in: RepairDecoder | None = None
    #: The host (and, for IPv6, the site) a connection we accepted came from, while it counts
    #: towards their shares.
    accepted_from: tuple[str, ...] = ()
    #: Whether it goes through a relay (it never moves into or out of one).
    relayed: bool = False
    #: A handshake we accepted from an address not proven yet (see
    #: ``TransportConfig.max_unproven_handshakes``), while it counts as one.
    unproven: bool = False


def no_data_pending(conn: Conn) -> bool:
    return not conn.quic.data_pending


def refresh_timer(conn: Conn) -> float | None:
    best = conn.quic.get_timer()
    for at in (conn.keepalive_at, conn.connect_deadline, conn.probe_at):
        if at is not None and (best is None or at < best):
            best = at
    conn.timer_at = best
    return best


def locally_initiated(conn: Conn, stream_id: int) -> bool:
    return (stream_id & 1 == 0) == conn.is_client


def format_address(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def termination_error(conn: Conn, event: qe.ConnectionTerminated) -> TransportError:
    code = event.error_code
    reason = event.reason_phrase or ""
    where = format_address(conn.address)
    detail = f": {reason}" if reason else ""
    if event.frame_type is None:
        # An application close (CONNECTION_CLOSE 0x1d): the codes are ours.
        if code == APP_IDENTITY:
            return IdentityMismatch(f"{where} refused our identity{detail}")
        return ConnectionClosed(f"{where} closed the connection{detail}", error_code=code)
    if code == QuicErrorCode.INTERNAL_ERROR and reason == "Idle timeout":
        # aioquic's own idle timer; before the handshake it means nobody answered.
        if not conn.ready:
            return ConnectTimeout(f"no handshake with {where}")
        return ConnectionClosed(f"connection to {where} timed out while idle", error_code=code)
    if code == _NO_ALPN:
        return RemoteProtocolError(
            f"{where} does not speak {ALPN} (another protocol or major version)"
        )
    return ConnectionClosed(
        f"connection to {where} closed (code {code:#x}){detail}", error_code=code
    )
