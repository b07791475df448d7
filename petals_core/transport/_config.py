"""Transport settings: one frozen object, changed with ``attrs.evolve``."""

from __future__ import annotations

import attrs
from attrs import validators as v

from .._validators import (
    at_least,
    in_range,
    non_negative_or_none,
    one_of,
    positive,
    positive_or_none,
)
from ._codec_format import CodecLimits
from ._repair import MAX_GROUP

__all__ = ["ALPN", "TransportConfig"]

#: ALPN token: names the protocol and its major version.  A peer of another major version fails the
#: handshake with a clear error instead of misreading our frames.
ALPN = "petals-core/1"

_DEFAULT_KEEPALIVE_S: float | None = 15.0
# A long prefill's hidden states fit (e.g. 4096 tokens x 8192 x 2 bytes = 64 MiB).
_DEFAULT_CODEC_LIMITS = CodecLimits(max_frame_bytes=128 << 20)


@attrs.frozen(kw_only=True)
class TransportConfig:
    """How a node's QUIC endpoint behaves.  Sizes in bytes, times in seconds."""

    #: Largest UDP payload towards peers on other hosts (1500-byte MTU minus IPv6 and UDP headers).
    #: With ``path_mtu_discovery`` a connection starts at 1200 bytes and probes up to this.
    max_datagram_bytes: int = attrs.field(default=1452, validator=in_range(1200, 65527))
    #: Largest UDP payload towards loopback peers: larger datagrams mean far fewer packets to
    #: encrypt and acknowledge.  Above 16 KiB aioquic's connections break.
    loopback_datagram_bytes: int = attrs.field(default=16384, validator=in_range(1200, 16384))
    #: Probe each path for the largest datagram it carries, up to the two sizes above (RFC 8899);
    #: False: send datagrams of those sizes from the start.
    path_mtu_discovery: bool = attrs.field(default=True, validator=v.instance_of(bool))
    #: A connection with no traffic for this long is closed (both sides apply their own value).
    idle_timeout_s: float = attrs.field(default=60.0, validator=positive)
    #: Send a PING after this much quiet so NAT bindings and idle timers stay fresh; None: never.
    keepalive_interval_s: float | None = attrs.field(
        default=_DEFAULT_KEEPALIVE_S, validator=positive_or_none
    )
    #: While calls are open on a connection, a peer that sends nothing for this long is probed
    #: with PINGs, and one that answers none of them within about as long again (at least four
    #: of its probe timeouts) is given up on: a killed process or a vanished machine is noticed
    #: in about twice this, not after the idle timeout.  None: wait for the idle timeout.
    peer_silence_s: float | None = attrs.field(default=0.5, validator=positive_or_none)
    #: How long ``connect`` waits for the handshake.
    connect_timeout_s: float = attrs.field(default=10.0, validator=positive)
    #: How long a served call may take to send its header (and a unary call its request): a
    #: peer opening streams and sending nothing holds no handler task for longer.
    request_header_timeout_s: float = attrs.field(default=30.0, validator=positive)
    #: Unread bytes a peer may have in flight towards us on one stream / one connection.
    stream_window_bytes: int = attrs.field(default=4 << 20, validator=at_least(64 << 10))
    connection_window_bytes: int = attrs.field(default=16 << 20, validator=at_least(64 << 10))
    #: Unacknowledged bytes we queue on one connection before senders wait.
    send_buffer_bytes: int = attrs.field(default=8 << 20, validator=at_least(64 << 10))
    #: Connections this endpoint holds at once; new handshakes beyond it are ignored.
    max_connections: int = attrs.field(default=1024, validator=positive)
    #: Connections it accepts from one host at once (an IPv4 address or an IPv6 /64; loopback
    #: and connections through a relay, which the relay bounds, are not counted): one host
    #: cannot take every slot, handshakes left unfinished included.  New handshakes from a host
    #: beyond it are ignored.
    max_connections_per_host: int = attrs.field(default=128, validator=positive)
    #: The same, from one IPv6 /48 (a site: a home or a campus given a /48 picks its /64s in
    #: it), so that one site's many /64s cannot take every slot either.
    max_connections_per_site: int = attrs.field(default=256, validator=positive)
    #: Handshakes from addresses not proven yet (unfinished; loopback and relayed ones aside)
    #: the endpoint holds at once before it asks each new one to prove its address first (a
    #: QUIC Retry: that handshake takes one more round trip).  Handshakes from forged source
    #: addresses then hold at most this many connection slots, whatever the hosts they name,
    #: and get no more than a short Retry sent to those addresses.  0: always ask; None: never.
    max_unproven_handshakes: int | None = attrs.field(default=32, validator=non_negative_or_none)
    #: Calls a peer may have open towards us at once on one connection (the QUIC stream limit we
    #: advertise: the peer's further calls wait for one of these to finish).
    max_incoming_streams: int = attrs.field(default=100, validator=in_range(1, 1024))
    #: How finely the event loop can sleep (trio rounds shorter sleeps up to about 1 ms): the
    #: pacer lets a burst cover this much time so pacing never waits on sub-tick timers.
    timer_granularity_s: float = attrs.field(default=0.001, validator=positive)
    #: Requested kernel socket buffer (the kernel may cap it); big bursts of datagrams on loopback
    #: otherwise overflow the default buffer and look like loss.
    socket_buffer_bytes: int = attrs.field(default=8 << 20, validator=at_least(0))
    #: Send and receive runs of datagrams in one system call where the kernel offers it (UDP
    #: segmentation and receive offload on Linux); without it, or False, one datagram per call.
    udp_offload: bool = attrs.field(default=True, validator=v.instance_of(bool))
    #: Limits for decoding messages from peers.
    codec_limits: CodecLimits = _DEFAULT_CODEC_LIMITS
    #: Frames larger than this are assembled one at a time per connection, so what a peer can
    #: make us buffer is bounded by about ``max_incoming_streams * large_frame_bytes +
    #: codec_limits.max_frame_bytes`` plus the receive windows.
    large_frame_bytes: int = attrs.field(default=1 << 20, validator=at_least(64 << 10))
    #: ``Node.connect_any`` starts dialling a peer's next address when the one before has not
    #: connected within this long.
    dial_stagger_s: float = attrs.field(default=0.25, validator=positive)
    #: How long ``Node.connect_any`` tries to punch a hole to a peer it reached through a relay
    #: before it settles for the relay; None: it never tries.
    hole_punch_timeout_s: float | None = attrs.field(default=2.0, validator=positive_or_none)
    #: On a path that lost datagrams lately, each run of up to this many datagrams is followed by
    #: a repair from which the receiver rebuilds any one of them that is lost, without waiting a
    #: round trip for QUIC to send it again (see ``_repair``); 0: never.
    repair_group: int = attrs.field(default=16, validator=in_range(0, MAX_GROUP))
    #: "reno" or "cubic".
    congestion_control: str = attrs.field(default="cubic", validator=one_of(("reno", "cubic")))
