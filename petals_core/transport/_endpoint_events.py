"""What the sans-IO endpoint tells its driver: one frozen event per happening."""

from __future__ import annotations

import attrs

from .._errors import TransportError
from ._identity import PeerID

__all__ = [
    "Address",
    "ConnectionLost",
    "ConnectionReady",
    "EndpointEvent",
    "StopSending",
    "StreamData",
    "StreamReset",
]

Address = tuple[str, int]


@attrs.frozen
class ConnectionReady:
    """The handshake finished and the peer proved the key behind ``peer_id``."""

    handle: int
    peer_id: PeerID
    address: Address
    is_client: bool


@attrs.frozen
class ConnectionLost:
    """The connection is gone; ``error`` says why (a :class:`TransportError` subclass)."""

    handle: int
    error: TransportError


@attrs.frozen
class StreamData:
    handle: int
    stream_id: int
    data: bytes
    end_stream: bool


@attrs.frozen
class StreamReset:
    """The peer abandoned its sending side of the stream."""

    handle: int
    stream_id: int
    error_code: int


@attrs.frozen
class StopSending:
    """The peer will read no more from this stream."""

    handle: int
    stream_id: int
    error_code: int


EndpointEvent = ConnectionReady | ConnectionLost | StreamData | StreamReset | StopSending
