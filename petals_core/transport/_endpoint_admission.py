"""Who may open a connection to an endpoint: sans-IO, as the endpoint is.

A handshake we did not start counts towards its host's share (an IPv4 address, or an IPv6 /64)
and, for IPv6, its site's (a /48): beyond ``max_connections_per_host`` or
``max_connections_per_site`` new ones are ignored.  Loopback handshakes count towards nothing,
nor do those through a relay (each is a circuit, which the relay bounds per host).

Counted handshakes that have not finished come from addresses not proven yet: anyone can
write any source address on an Initial.  Beyond ``max_unproven_handshakes`` of them at once,
a new one is answered with a QUIC Retry (RFC 9000, 8.1.2) instead: its token, bound to the
client's address and sealed with a key of this run, must come back on the client's next
Initial, which only a client receiving at that address can send.  A forged address thus holds
no slot beyond those, and is sent nothing larger than a Retry.  A token that does not validate
(too old, from another address, or sealed before this node restarted) is answered with a
connection close (INVALID_TOKEN, RFC 9000, 8.1.3): a client would not take a second Retry, and
would otherwise wait out its connect timeout.  Such closes cost some work each (the Initial keys,
a sealed packet), so at most :data:`_MAX_TOKEN_REFUSALS` are sent a second; beyond, the Initial
is ignored, as it was before such closes.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Final

import attrs
from aioquic.quic.crypto import CryptoPair
from aioquic.quic.packet import (
    QuicErrorCode,
    QuicFrameType,
    QuicHeader,
    QuicPacketType,
    encode_quic_retry,
)
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.retry import QuicRetryTokenHandler

from .._ip import places_of
from ._config import TransportConfig
from ._endpoint_conn import Conn, is_loopback
from ._relay_wire import Address, is_virtual

__all__ = ["Admission", "Admitted"]

#: The reason an Initial whose token does not validate is refused with.
_INVALID_TOKEN_REASON: Final = b"address token not valid here"
#: Closes for tokens that do not validate sent in one second at most.
_MAX_TOKEN_REFUSALS: Final = 64


@attrs.frozen
class Admitted:
    """A handshake to accept: the connection IDs its QUIC connection starts from (the client's
    first choice, and the one our Retry gave it, if any) and the shares it counts towards."""

    original_dcid: bytes
    retry_scid: bytes | None
    counted: tuple[str, ...]


class Admission:
    """The shares of one endpoint's accepted connections, and its Retry tokens."""

    def __init__(self, config: TransportConfig, cid_bytes: int) -> None:
        self.config = config
        self._cid_bytes = cid_bytes
        self._accepted_from: Counter[str] = Counter()
        self._unproven = 0
        self._tokens = QuicRetryTokenHandler()
        #: Retries sent (handshakes asked to prove their address first).
        self.retries_sent = 0
        #: The second the token refusals sent are counted in, and how many.
        self._refusals_at = -1
        self._refusals = 0

    def admit(self, header: QuicHeader, address: Address, now: float) -> Admitted | bytes | None:
        """Whether the Initial ``header`` from ``address`` may open a connection: how
        (:class:`Admitted`), a Retry to send back instead, or None to ignore it."""
        counted = _counted_as(address)
        bounds = (self.config.max_connections_per_host, self.config.max_connections_per_site)
        # (An IPv4 host is its own site: it counts once, against the host's bound.)
        if any(
            self._accepted_from[key] >= bound for key, bound in zip(counted, bounds, strict=False)
        ):
            return None
        if not counted:
            return Admitted(header.destination_cid, None, counted)
        if header.token:
            try:
                original_dcid = self._tokens.validate_token(
                    address=address,
                    destination_cid=header.destination_cid,
                    token=header.token,
                    now=now,
                )
            except ValueError:  # not ours, for another address, or too old
                return self._refuse_token(header, now)
            return Admitted(original_dcid, header.destination_cid, counted)
        ceiling = self.config.max_unproven_handshakes
        if ceiling is not None and self._unproven >= ceiling:
            return self._retry(header, address, now)
        return Admitted(header.destination_cid, None, counted)

    def took(self, conn: Conn, admitted: Admitted) -> None:
        """``conn`` was opened as ``admitted``: it holds its shares from now on."""
        conn.accepted_from = admitted.counted
        self._accepted_from.update(admitted.counted)
        if admitted.counted and admitted.retry_scid is None:
            conn.unproven = True
            self._unproven += 1

    def proven(self, conn: Conn) -> None:
        """``conn``'s handshake finished (the peer answered what we sent to its address): it
        no longer counts as an unproven one."""
        if conn.unproven:
            conn.unproven = False
            self._unproven -= 1

    def release(self, conn: Conn) -> None:
        """``conn`` is gone: its shares are free."""
        self.proven(conn)
        for key in conn.accepted_from:
            self._accepted_from[key] -= 1
            if not self._accepted_from[key]:
                del self._accepted_from[key]
        conn.accepted_from = ()

    def _refuse_token(self, header: QuicHeader, now: float) -> bytes | None:
        second = int(now)
        if second != self._refusals_at:
            self._refusals_at, self._refusals = second, 0
        if self._refusals >= _MAX_TOKEN_REFUSALS:
            return None
        self._refusals += 1
        return _invalid_token(header)

    def _retry(self, header: QuicHeader, address: Address, now: float) -> bytes:
        source_cid = os.urandom(self._cid_bytes)
        token = self._tokens.create_token(
            address=address,
            original_destination_connection_id=header.destination_cid,
            retry_source_connection_id=source_cid,
            now=now,
        )
        self.retries_sent += 1
        return encode_quic_retry(
            version=header.version,  # type: ignore[arg-type]
            source_cid=source_cid,
            destination_cid=header.source_cid,
            original_destination_cid=header.destination_cid,
            retry_token=token,
        )


def _invalid_token(header: QuicHeader) -> bytes:
    """A server Initial closing the connection the Initial ``header`` opens, with INVALID_TOKEN:
    a single packet far smaller than that Initial, protected with the Initial keys its
    destination connection ID gives."""
    version = header.version
    assert version is not None  # an Initial's long header has one
    crypto = CryptoPair()
    crypto.setup_initial(cid=header.destination_cid, is_client=False, version=version)
    builder = QuicPacketBuilder(
        host_cid=header.destination_cid,
        peer_cid=header.source_cid,
        version=version,
        is_client=False,
        max_datagram_size=1200,
    )
    builder.start_packet(QuicPacketType.INITIAL, crypto)
    reason = _INVALID_TOKEN_REASON
    frame = builder.start_frame(QuicFrameType.TRANSPORT_CLOSE, capacity=16 + len(reason))
    frame.push_uint_var(QuicErrorCode.INVALID_TOKEN)
    frame.push_uint_var(QuicFrameType.PADDING)  # no frame of the peer's caused it
    frame.push_uint_var(len(reason))
    frame.push_bytes(reason)
    (datagram,), _ = builder.flush()
    return datagram


def _counted_as(address: Address) -> tuple[str, ...]:
    """The host, and an IPv6 host's site, whose shares a connection accepted from ``address``
    counts towards (none for loopback and relayed addresses)."""
    if is_virtual(address) or is_loopback(address[0]):
        return ()
    return places_of(address[0])
