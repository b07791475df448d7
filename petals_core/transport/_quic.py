"""The one place that reaches into aioquic's internals.

aioquic's ``QuicConnection`` is a complete sans-IO QUIC stack, but several things we need are not
in its public API, so this subclass adds them (aioquic is pinned in pyproject; the tests in
``tests/transport`` hold this contract):

* **Mutual authentication.** A server asks the client for its certificate (aioquic supports it but
  exposes it only as a private flag), and either side can read the certificate its peer proved.
* **Receive credit driven by the application.** aioquic raises flow-control limits as data
  *arrives*, so a peer could make us buffer without bound.  Here limits move only as the
  application *consumes* data: at most ``stream_window_bytes`` unread per stream and
  ``connection_window_bytes`` per connection.
* **ACKs ride along with data.**  aioquic sends an ACK only when its delayed-ACK timer fires, even
  when a data packet leaves first; here a pending ACK goes out in the next data packet.  And the
  timer waits longer for a lone packet: aioquic acknowledges every ack-eliciting packet within
  1 ms, so a request whose answer takes longer to compute costs an ACK-only packet each way
  (sent, received, decrypted, processed: a wake-up of both event loops).  Here a single pending
  packet waits up to ``LONE_ACK_DELAY_S`` (below the 25 ms ``max_ack_delay`` we advertise, which
  the peer's loss timers allow for), so the answer carries the ACK; from the second pending packet
  on, aioquic's 1 ms applies, counted from the second packet: bulk transfers are acknowledged as
  before, and a trickle of requests that are never answered on this connection (a pipeline's
  next hop) is acknowledged a moment after the next one arrives, not at once — not in the
  critical moment when that request starts its work.  When data is about to leave, connections
  carrying data go before those with only ACKs (see :meth:`PeerQuicConnection.data_pending`).
* **Send-buffer accounting and coarse pacing.** ``send_stream_data`` buffers without limit; we
  expose how many bytes sit unacknowledged so the caller can wait.  aioquic's pacer releases at
  most 16 datagrams per burst and asks for sub-millisecond timers that the event loop rounds up to
  about a millisecond, which caps throughput at a few tens of MB/s; the pacer here allows a burst
  that covers the driver's timer granularity, and paces at the rate ``_quic_path`` gives.
* **What the connection learns of its path** (see ``_quic_path``): congestion controllers that
  keep their window across idle gaps, and the datagram size found by probing, sent here as padded
  PING packets of their own.
"""

from __future__ import annotations

from collections.abc import KeysView
from typing import Any

from aioquic import tls
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import (
    NetworkAddress,
    QuicConnection,
    QuicConnectionState,
    QuicReceiveContext,
)
from aioquic.quic.packet import QuicFrameType, QuicPacketType
from aioquic.quic.packet_builder import QuicDeliveryState, QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketPacer
from aioquic.quic.stream import QuicStream
from cryptography import x509

from ._quic_path import (
    BASE_DATAGRAM_BYTES,
    BLACK_HOLE_TIMEOUTS,
    MtuSearch,
    PathCongestionControl,
    PathInfo,
    congestion_control,
)

__all__ = ["PeerQuicConnection"]


class _CoarsePacer(QuicPacketPacer):
    """aioquic's token-bucket pacer with a bucket deep enough for a timer tick of ``burst_s``."""

    def __init__(
        self, *, max_datagram_size: int, burst_s: float, controller: PathCongestionControl
    ) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._burst_s = burst_s
        self._controller = controller

    def set_datagram_size(self, size: int) -> None:
        self._max_datagram_size = size

    def update_rate(self, congestion_window: int, smoothed_rtt: float) -> None:
        gain = self._controller.pacing_gain()
        super().update_rate(int(congestion_window * gain), smoothed_rtt)
        if self.packet_time is not None:
            self.bucket_max = max(self.bucket_max, 2 * self._burst_s)
            self.bucket_time = min(self.bucket_time, self.bucket_max)


#: How long the ACK of a lone ack-eliciting 1-RTT packet may wait for data to ride along with.
LONE_ACK_DELAY_S = 0.015


class PeerQuicConnection(QuicConnection):
    """A ``QuicConnection`` with client certificates, bounded receive credit and send accounting."""

    def __init__(
        self,
        *,
        configuration: QuicConfiguration,
        stream_window_bytes: int,
        connection_window_bytes: int,
        max_incoming_streams: int,
        pacing_burst_s: float,
        datagram_ceiling: int | None = None,
        original_destination_connection_id: bytes | None = None,
        retry_source_connection_id: bytes | None = None,
    ) -> None:
        """``datagram_ceiling``: probe the path for datagrams up to this size, starting from the
        configuration's ``max_datagram_size``; None: keep to that size."""
        super().__init__(
            configuration=configuration,
            original_destination_connection_id=original_destination_connection_id,
            retry_source_connection_id=retry_source_connection_id,
        )
        # The peer may hold this many of its streams open at once (advertised in the handshake,
        # raised by one as each finishes); aioquic's fixed 128 is not configurable.
        limit = self._local_max_streams_bidi
        limit.value = limit.sent = max_incoming_streams
        self._local_max_streams_uni.value = self._local_max_streams_uni.sent = 0
        self._stream_window = stream_window_bytes
        self._connection_window = connection_window_bytes
        self._stream_consumed: dict[int, int] = {}
        self._held_back: dict[int, int] = {}
        self._connection_consumed = 0
        self._data_pending = False
        self._ping_received = False
        # Ack-eliciting 1-RTT packets received since our last ACK, and when the first arrived.
        self._unacked_eliciting = 0
        self._first_unacked_at = 0.0
        self._second_unacked_at = 0.0
        start = configuration.max_datagram_size
        self._loss._cc = self._cc = congestion_control(
            configuration.congestion_control_algorithm,
            max_datagram_size=datagram_ceiling or start,
            initial_datagram_size=start,
        )
        self._loss._pacer = self._pacer = _CoarsePacer(
            max_datagram_size=start, burst_s=pacing_burst_s, controller=self._cc
        )
        self._mtu = (
            MtuSearch(ceiling=datagram_ceiling, floor=start)
            if datagram_ceiling is not None and datagram_ceiling > start
            else None
        )

    # -- authentication ---------------------------------------------------------------------------

    def _initialize(self, peer_cid: bytes) -> None:
        super()._initialize(peer_cid)
        if not self._is_client:
            self.tls._request_client_certificate = True

    def saw_client_hello(self) -> bool:
        """Whether a server connection has processed a whole ClientHello (its first datagram
        was a real handshake, not junk shaped like an Initial)."""
        tls_context = getattr(self, "tls", None)
        return tls_context is not None and tls_context.state != tls.State.SERVER_EXPECT_CLIENT_HELLO

    def peer_certificate(self) -> x509.Certificate | None:
        """The certificate whose key the peer proved in the handshake, if any."""
        tls = getattr(self, "tls", None)
        return None if tls is None else tls._peer_certificate

    # -- receive credit ----------------------------------------------------------------------------

    def consume(self, stream_id: int, nbytes: int) -> bool:
        """Record that the application took ``nbytes`` off ``stream_id``.

        Returns whether the peer's credit should now grow (a window update is due).
        """
        consumed = self._stream_consumed.get(stream_id, 0) + nbytes
        self._stream_consumed[stream_id] = consumed
        held_back = self._held_back.get(stream_id, 0)
        if held_back:
            # Part of this was already released from the connection window (see hold_back).
            taken = min(held_back, nbytes)
            self._held_back[stream_id] = held_back - taken
            nbytes -= taken
        self._connection_consumed += nbytes
        stream = self._streams.get(stream_id)
        stream_due = stream is not None and (
            consumed + self._stream_window - stream.max_stream_data_local
            >= self._stream_window // 4
        )
        return stream_due or self._connection_update_due()

    def hold_back(self, stream_id: int, nbytes: int) -> None:
        """``nbytes`` of ``stream_id`` stay unread for a while (the stream waits its turn): free
        them from the connection window so other streams can go on; the stream's own window
        still bounds them."""
        self._held_back[stream_id] = self._held_back.get(stream_id, 0) + nbytes
        self._connection_consumed += nbytes

    def forget_stream(self, stream_id: int, unread_bytes: int) -> bool:
        """The application is done with ``stream_id``; the ``unread_bytes`` it dropped are freed.

        Returns whether the peer's connection credit should now grow.
        """
        self._stream_consumed.pop(stream_id, None)
        held_back = self._held_back.pop(stream_id, 0)
        self._connection_consumed += max(0, unread_bytes - held_back)
        return self._connection_update_due()

    def _connection_update_due(self) -> bool:
        return (
            self._connection_consumed + self._connection_window - self._local_max_data.value
            >= self._connection_window // 4
        )

    def can_open_stream(self) -> bool:
        """Whether a new stream fits in the peer's MAX_STREAMS now.

        aioquic would create a stream beyond it as "blocked" and later still send frames on it
        (a reset or STOP_SENDING when the call is cancelled), which the peer rightly treats as a
        fatal STREAM_LIMIT_ERROR; so streams are only opened within the limit.
        """
        return self.get_next_available_stream_id() // 4 < self._remote_max_streams_bidi

    def stream(self, stream_id: int) -> QuicStream | None:
        """aioquic's state of ``stream_id``; None for a stream it never had or already forgot
        (finished both ways)."""
        return self._streams.get(stream_id)

    def stream_ids(self) -> KeysView[int]:
        """The streams aioquic still tracks."""
        return self._streams.keys()

    def close_event(self) -> qe.ConnectionTerminated | None:
        """How the connection ended, as soon as it did (aioquic's own event comes only after the
        drain period); None while it is open."""
        return self._close_event

    def credit_undelivered(self, stream_id: int) -> None:
        """The peer reset ``stream_id``: bytes counted against the connection that will never be
        delivered (lost in flight, or held behind a gap) no longer take up its window."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            receiver = stream.receiver
            self._connection_consumed += receiver.highest_offset - receiver.starting_offset()

    def _write_connection_limits(self, builder: Any, space: Any) -> None:
        limit = self._local_max_data
        wanted = self._connection_consumed + self._connection_window
        if wanted - limit.value >= self._connection_window // 4:
            limit.value = wanted
        # Hide the received byte count so aioquic's own "double when half used" rule stays idle.
        used = limit.used
        limit.used = 0
        try:
            super()._write_connection_limits(builder=builder, space=space)
        finally:
            limit.used = used

    def _write_stream_limits(self, builder: Any, space: Any, stream: Any) -> None:
        if stream.max_stream_data_local:
            wanted = self._stream_consumed.get(stream.stream_id, 0) + self._stream_window
            if wanted - stream.max_stream_data_local >= self._stream_window // 4:
                stream.max_stream_data_local = wanted
        receiver = stream.receiver
        highest = receiver.highest_offset
        receiver.highest_offset = 0
        try:
            super()._write_stream_limits(builder=builder, space=space, stream=stream)
        finally:
            receiver.highest_offset = highest

    # -- acknowledgements ------------------------------------------------------------------------

    def send_stream_data(self, stream_id: int, data: bytes, end_stream: bool = False) -> None:
        super().send_stream_data(stream_id, data, end_stream)
        self._data_pending = True

    def _handle_ping_frame(self, context: QuicReceiveContext, frame_type: int, buf: Any) -> None:
        super()._handle_ping_frame(context, frame_type, buf)
        self._ping_received = True

    def receive_datagram(self, data: bytes, addr: NetworkAddress, now: float) -> None:
        self._ping_received = False
        super().receive_datagram(data, addr, now)
        space = self._spaces.get(tls.Epoch.ONE_RTT)
        if space is None or space.ack_at is None or not self._unacked_eliciting:
            return
        if self._ping_received:
            # A PING asks for an ACK (a path MTU probe, a loss probe, a keepalive) and no
            # answer will carry it: acknowledge at once.
            space.ack_at = now
        elif self._unacked_eliciting == 1:
            space.ack_at = max(space.ack_at, self._first_unacked_at + LONE_ACK_DELAY_S)
        else:
            space.ack_at = min(space.ack_at, max(now, self._second_unacked_at + self._ack_delay))

    def _payload_received(
        self, context: QuicReceiveContext, plain: bytes, crypto_frame_required: bool = False
    ) -> tuple[bool, bool]:
        is_ack_eliciting, is_probing = super()._payload_received(
            context, plain, crypto_frame_required
        )
        if is_ack_eliciting and context.epoch == tls.Epoch.ONE_RTT:
            if not self._unacked_eliciting:
                self._first_unacked_at = context.time
            elif self._unacked_eliciting == 1:
                self._second_unacked_at = context.time
            self._unacked_eliciting += 1
        return is_ack_eliciting, is_probing

    def _write_ack_frame(self, builder: Any, space: Any, now: float) -> None:
        super()._write_ack_frame(builder=builder, space=space, now=now)
        if space is self._spaces.get(tls.Epoch.ONE_RTT):
            self._unacked_eliciting = 0

    def probe_timeout(self) -> float:
        """RFC 9002's probe timeout towards the peer: smoothed RTT, four RTT variances and the
        peer's maximum ACK delay (twice the initial RTT before the first sample)."""
        return float(self._loss.get_probe_timeout())

    @property
    def data_pending(self) -> bool:
        """Whether stream data was queued since the last :meth:`datagrams_to_send`."""
        return self._data_pending

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Any]]:
        # aioquic writes an ACK only once its delayed-ACK timer is due, so a request/response
        # exchange pays for extra ACK-only packets on both sides.  When data is about to go out,
        # carry the pending ACK in it instead.
        if self._data_pending:
            self._data_pending = False
            space = self._spaces.get(tls.Epoch.ONE_RTT)
            if space is not None and space.ack_at is not None and space.ack_at > now:
                space.ack_at = now
        datagrams = super().datagrams_to_send(now)
        if self._mtu is not None:
            datagrams += self._probe_path(now)
        return datagrams

    def validated_peer_address(self) -> NetworkAddress | None:
        """The peer's address on the most recent path it proved it receives on (RFC 9000 8.2):
        until then QUIC sends on a new path at most three times what came from there, and
        whatever else forwards to the peer must not send more."""
        return next((path.addr for path in self._network_paths if path.is_validated), None)

    # -- path MTU --------------------------------------------------------------------------------

    def path_info(self) -> PathInfo:
        return PathInfo(
            datagram_bytes=self._max_datagram_size,
            datagram_search_done=self._mtu is None or self._mtu.done,
            rtt_s=float(self._loss._rtt_smoothed),
            congestion_window_bytes=self._cc.congestion_window,
            losing=self._cc.losing,
        )

    @property
    def losing(self) -> bool:
        """Whether the path lost packets lately (see ``PathCongestionControl.losing``)."""
        return self._cc.losing

    @property
    def datagram_bytes(self) -> int:
        """The largest datagram this connection sends now (path MTU probes aside)."""
        return self._max_datagram_size

    def _probe_path(self, now: float) -> list[tuple[bytes, Any]]:
        """A padded PING of the next size to try, when one is due and the window has room."""
        search = self._mtu
        assert search is not None
        if (
            self._loss._pto_count >= BLACK_HOLE_TIMEOUTS
            and self._max_datagram_size > BASE_DATAGRAM_BYTES
        ):
            # Nothing sent for several probe timeouts was acknowledged: the path may have
            # stopped carrying the size in use (a route change).  Back to the size every path
            # carries (what is still unacknowledged is sent again in it), and search again.
            search.restart()
            self._set_datagram_size(BASE_DATAGRAM_BYTES)
        size = search.next_size()
        if (
            size is None
            or not self._handshake_confirmed
            or self._state != QuicConnectionState.CONNECTED
            or self._close_pending
        ):
            return []
        # One probe at a time may exceed the congestion window (as loss probes may): waiting
        # for room would keep a connection that sends little at 1,200 bytes, and a probe
        # taking up the room would hold back the data behind it.
        path = self._network_paths[0]
        assert self._version is not None  # set once the handshake began
        builder = QuicPacketBuilder(
            host_cid=self.host_cid,
            is_client=self._is_client,
            max_datagram_size=size,
            packet_number=self._packet_number,
            peer_cid=self._peer_cid.cid,
            peer_token=self._peer_token,
            quic_logger=self._quic_logger,
            spin_bit=self._spin_bit,
            version=self._version,
        )
        builder.start_packet(QuicPacketType.ONE_RTT, self._cryptos[tls.Epoch.ONE_RTT])
        builder.start_frame(
            QuicFrameType.PING, handler=self._on_probe_delivery, handler_args=(size,)
        )
        padding = builder.remaining_flight_space
        if padding > 0:
            # PADDING frames are zero bytes; the first one's type byte is written here.
            builder.start_frame(QuicFrameType.PADDING, capacity=padding).push_bytes(
                bytes(padding - 1)
            )
        self._cc.probe_packets.add(self._packet_number)
        search.sent(size)
        return self._flush_builder(
            builder=builder, network_path=path, peer_cid=self._peer_cid.cid, now=now
        )

    def _on_probe_delivery(self, delivery: QuicDeliveryState, size: int) -> None:
        search = self._mtu
        assert search is not None
        if delivery == QuicDeliveryState.ACKED:
            search.acknowledged(size)
            if size > self._max_datagram_size:
                self._set_datagram_size(size)
        else:
            search.lost(size)

    def _set_datagram_size(self, size: int) -> None:
        self._max_datagram_size = size
        self._pacer.set_datagram_size(size)
        self._cc.set_datagram_size(size)

    # -- send accounting ---------------------------------------------------------------------------

    def stream_send_room(self, stream_id: int, slack: int) -> int:
        """Bytes we may still queue on ``stream_id``: what the peer's window for it allows, plus
        ``slack``.  A stream whose reader stalls then holds at most ``slack`` unsendable bytes,
        instead of filling the connection's send budget that other streams need."""
        stream = self._streams.get(stream_id)
        if stream is None:
            return slack
        return int(stream.max_stream_data_remote + slack - stream.sender._buffer_stop)

    def sending(self) -> bool:
        """Whether stream data (new, or lost and to be sent again) waits to leave and may: the
        datagrams just collected are not the last for now.  Data that the peer's flow control
        holds back does not count: it may wait for as long as the peer does not read."""
        connection_room = self._remote_max_data - self._remote_max_data_used
        for stream in self._streams.values():
            sender = stream.sender
            if sender._reset_error_code is not None:
                continue
            if sender._pending_eof:
                return True
            if not len(sender._pending):
                continue
            # As aioquic's own limit for the next frame: resends are never held back.
            start = sender._pending[0].start
            limit = min(sender.highest_offset + connection_room, stream.max_stream_data_remote)
            if start < sender.highest_offset or start < limit:
                return True
        return False

    def send_buffered(self) -> int:
        """Bytes queued on this connection's streams that the peer has not acknowledged yet.

        Streams the application already let go of count until the peer acknowledged them; reset
        streams do not (aioquic will never send their bytes).
        """
        total = 0
        for stream in self._streams.values():
            sender = stream.sender
            if sender._reset_error_code is None:
                total += sender._buffer_stop - sender._buffer_start
        return int(total)
