"""Sans-IO QUIC endpoint: many connections behind one UDP socket, demultiplexed by connection ID.

No sockets, no clock, no tasks: datagrams and ``now`` go in, datagrams to send and events come out.
The trio driver (``_node.py``) owns the socket and the clock; tests ferry datagrams between two
endpoints by hand, dropping and reordering some.

Each connection is a :class:`~._quic.PeerQuicConnection`.  Both ends present a certificate carrying
their node key; a connection is announced (:class:`ConnectionReady`) only once the peer proved a
key, and, when the dialer named a PeerID, only if the key hashes to it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from aioquic.buffer import Buffer
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import (
    QuicHeader,
    QuicPacketType,
    encode_quic_version_negotiation,
    pull_quic_header,
)

from .._errors import (
    ConnectionClosed,
    ConnectTimeout,
    IdentityMismatch,
    StreamReset as StreamResetError,
    TransportError,
)
from ._config import ALPN, TransportConfig
from ._endpoint_admission import Admission, Admitted
from ._endpoint_conn import (
    APP_CANCELLED,
    APP_CLOSED,
    APP_IDENTITY,
    Conn,
    format_address,
    is_loopback,
    locally_initiated,
    no_data_pending,
    refresh_timer,
    termination_error,
)
from ._endpoint_events import (
    Address,
    ConnectionLost,
    ConnectionReady,
    EndpointEvent,
    StopSending,
    StreamData,
    StreamReset,
)
from ._identity import Identity, PeerID, check_certificate_identity
from ._quic import PeerQuicConnection
from ._quic_path import BASE_DATAGRAM_BYTES, PathInfo
from ._relay_wire import RELAY_HEADER, is_virtual, split_virtual
from ._repair import REPAIR, WINDOW_RUNS, RepairDecoder, RepairEncoder

__all__ = [
    "ConnectionLost",
    "ConnectionReady",
    "Endpoint",
    "EndpointEvent",
    "StopSending",
    "StreamData",
    "StreamReset",
]

_CID_BYTES = 8
# Unsendable bytes a stream may queue beyond the peer's window for it (see send_room).
_STREAM_SEND_SLACK = 32 << 10


class Endpoint:
    """The connections of one node.  All methods are synchronous and take ``now`` explicitly."""

    def __init__(self, identity: Identity, config: TransportConfig) -> None:
        self.identity = identity
        self.config = config
        self._by_cid: dict[bytes, Conn] = {}
        self._by_handle: dict[int, Conn] = {}
        self._next_handle = 1
        self._events: deque[EndpointEvent] = deque()
        self._dirty: set[Conn] = set()
        self._stray_datagrams: list[tuple[bytes, Address]] = []
        self._admission = Admission(config, _CID_BYTES)
        self._timer_hint: float | None = None
        #: Repair datagrams sent, and datagrams rebuilt from the peers' repairs.
        self.repairs_sent = 0
        self.datagrams_rebuilt = 0

    @property
    def retries_sent(self) -> int:
        """Handshakes asked to prove their address first (see ``_endpoint_admission``)."""
        return self._admission.retries_sent

    # -- configuration --------------------------------------------------------------------------

    def _datagram_ceiling(self, address: Address) -> int:
        """The largest datagram worth sending to ``address`` (see ``TransportConfig``)."""
        config = self.config
        relayed = split_virtual(address)
        host = address[0] if relayed is None else relayed[0][0]
        datagram = (
            config.loopback_datagram_bytes if is_loopback(host) else config.max_datagram_bytes
        )
        if relayed is not None:
            # The relay's header rides in the same UDP payload (QUIC needs 1200 bytes at least).
            datagram = max(BASE_DATAGRAM_BYTES, datagram - RELAY_HEADER.size)
        return datagram

    def _quic_configuration(self, *, is_client: bool, datagram: int) -> QuicConfiguration:
        config = self.config
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            certificate=self.identity.certificate,
            private_key=self.identity.private_key,
            # Certificates are self-signed: trust comes from the key matching the PeerID, checked
            # once the handshake proved possession of that key.
            verify_mode=0,
            idle_timeout=config.idle_timeout_s,
            max_datagram_size=datagram,
            max_data=config.connection_window_bytes,
            max_stream_data=config.stream_window_bytes,
            connection_id_length=_CID_BYTES,
            congestion_control_algorithm=config.congestion_control,
        )

    def _new_conn(
        self,
        quic: PeerQuicConnection,
        address: Address,
        *,
        is_client: bool,
        expected: PeerID | None,
        now: float,
    ) -> Conn:
        handle = self._next_handle
        self._next_handle += 1
        conn = Conn(
            handle=handle,
            quic=quic,
            address=address,
            is_client=is_client,
            expected_peer_id=expected,
            connect_deadline=now + self.config.connect_timeout_s,
            last_activity=now,
            last_received=now,
            relayed=is_virtual(address),
        )
        self._by_handle[handle] = conn
        self._by_cid[quic.host_cid] = conn
        return conn

    def _make_quic(
        self,
        *,
        is_client: bool,
        address: Address,
        original_dcid: bytes | None = None,
        retry_scid: bytes | None = None,
    ) -> PeerQuicConnection:
        ceiling = self._datagram_ceiling(address)
        discover = self.config.path_mtu_discovery
        return PeerQuicConnection(
            configuration=self._quic_configuration(
                is_client=is_client, datagram=BASE_DATAGRAM_BYTES if discover else ceiling
            ),
            stream_window_bytes=self.config.stream_window_bytes,
            connection_window_bytes=self.config.connection_window_bytes,
            max_incoming_streams=self.config.max_incoming_streams,
            pacing_burst_s=self.config.timer_granularity_s,
            datagram_ceiling=ceiling if discover else None,
            original_destination_connection_id=original_dcid,
            retry_source_connection_id=retry_scid,
        )

    # -- connections ----------------------------------------------------------------------------

    def connect(self, address: Address, expected_peer_id: PeerID | None, now: float) -> int:
        """Start a handshake with ``address``; returns the connection's handle."""
        quic = self._make_quic(is_client=True, address=address)
        conn = self._new_conn(quic, address, is_client=True, expected=expected_peer_id, now=now)
        quic.connect(address, now=now)
        self._after(conn, now)
        return conn.handle

    def peer_address(self, handle: int, *, validated: bool = False) -> Address | None:
        """Where the connection ``handle`` sends to now (its peer may have moved since the
        handshake: a NAT's new mapping), or (``validated``) where the peer last proved it
        receives, for sending more than QUIC would to an unproven address; None for a
        connection that is gone."""
        conn = self._by_handle.get(handle)
        if conn is None or conn.lost:
            return None
        if validated:
            address = conn.quic.validated_peer_address()
            return None if address is None else (str(address[0]), int(address[1]))
        address = conn.quic.get_peer_address()
        return conn.address if address is None else (str(address[0]), int(address[1]))

    def path_info(self, handle: int) -> PathInfo | None:
        """What connection ``handle`` learned of its path; None for a connection that is gone."""
        conn = self._by_handle.get(handle)
        return None if conn is None or conn.lost else conn.quic.path_info()

    def close(
        self, handle: int, now: float, *, error_code: int = APP_CLOSED, reason: str = ""
    ) -> None:
        """Close a connection politely; a :class:`ConnectionLost` follows once it drained."""
        conn = self._by_handle.get(handle)
        if conn is None or conn.lost:
            return
        conn.quic.close(error_code=error_code, reason_phrase=reason)
        conn.lost = True
        conn.keepalive_at = conn.connect_deadline = None
        detail = f": {reason}" if reason else ""
        self._events.append(
            ConnectionLost(
                handle,
                ConnectionClosed(
                    f"we closed the connection to {format_address(conn.address)}{detail}",
                    error_code=error_code,
                ),
            )
        )
        self._after(conn, now)

    def fail(self, handle: int, error: TransportError, now: float) -> None:
        """End a connection because of ``error`` (found outside the endpoint, e.g. by the socket);
        a :class:`ConnectionLost` carrying it follows."""
        conn = self._by_handle.get(handle)
        if conn is not None:
            self._fail(conn, error, now)

    def peer_id(self, handle: int) -> PeerID | None:
        conn = self._by_handle.get(handle)
        return None if conn is None else conn.peer_id

    def connection_count(self) -> int:
        return len(self._by_handle)

    # -- input ----------------------------------------------------------------------------------

    def receive_datagram(self, data: bytes, address: Address, now: float) -> None:
        """Feed one UDP payload that arrived from ``address``: a QUIC datagram, or a repair."""
        if data and not data[0] & 0x80:
            # Short header (or a repair): the destination connection ID follows the first byte.
            conn = self._by_cid.get(data[1 : 1 + _CID_BYTES])
            if conn is None or _moved_across_relay(conn, address):
                return
            if data[0] == REPAIR:
                self._receive_repair(conn, data, address, now)
                return
            if conn.repair_in is not None:
                conn.repair_in.record(data)
                if conn.repair_in.idle:
                    conn.repair_in = None
        else:
            try:
                header = pull_quic_header(Buffer(data=data), host_cid_length=_CID_BYTES)
            except ValueError:
                return
            conn = self._by_cid.get(header.destination_cid)
        if conn is None:
            conn = self._accept(data, header, address, now)
            if conn is None:
                return
            conn.quic.receive_datagram(data, address, now=now)
            if not conn.quic.saw_client_hello():
                # Junk shaped like an Initial must not hold a connection slot for the whole
                # handshake timeout.  (Our ClientHello fits one datagram.)
                self._forget(conn)
                return
        elif _moved_across_relay(conn, address):
            return
        else:
            conn.quic.receive_datagram(data, address, now=now)
        conn.last_activity = conn.last_received = now
        conn.probing_since = None
        self._after(conn, now)

    def _receive_repair(self, conn: Conn, data: bytes, address: Address, now: float) -> None:
        decoder = conn.repair_in
        if decoder is None:
            # From now on the datagrams that arrive are kept for the repairs that follow them
            # (this one's came before: it can rebuild nothing).
            conn.repair_in = RepairDecoder(
                window=WINDOW_RUNS * max(self.config.repair_group, 1),
                cid_bytes=_CID_BYTES,
                max_bytes=self._datagram_ceiling(conn.address),
            )
            return
        rebuilt = decoder.receive(data)
        if rebuilt is not None:
            self.datagrams_rebuilt += 1
            self.receive_datagram(rebuilt, address, now)

    def _accept(self, data: bytes, header: QuicHeader, address: Address, now: float) -> Conn | None:
        packet_type, version = header.packet_type, header.version
        supported = QuicConfiguration().supported_versions
        if (
            packet_type != QuicPacketType.VERSION_NEGOTIATION
            and version is not None
            and version not in supported
        ):
            # Never answer a version negotiation with another one (reflection loops).
            self._stray_datagrams.append(
                (
                    encode_quic_version_negotiation(
                        source_cid=header.destination_cid,
                        destination_cid=header.source_cid,
                        supported_versions=supported,
                    ),
                    address,
                )
            )
            return None
        if packet_type != QuicPacketType.INITIAL or len(data) < 1200:
            return None
        if len(self._by_handle) >= self.config.max_connections:
            return None
        admitted = self._admission.admit(header, address, now)
        if isinstance(admitted, bytes):
            self._stray_datagrams.append((admitted, address))
        if not isinstance(admitted, Admitted):
            return None
        quic = self._make_quic(
            is_client=False,
            address=address,
            original_dcid=admitted.original_dcid,
            retry_scid=admitted.retry_scid,
        )
        conn = self._new_conn(quic, address, is_client=False, expected=None, now=now)
        self._by_cid[header.destination_cid] = conn
        self._admission.took(conn, admitted)
        return conn

    # -- timers ---------------------------------------------------------------------------------

    def next_timer(self) -> float | None:
        """When :meth:`handle_timers` must run next (None: no timer pending)."""
        for conn in self._dirty:
            refresh_timer(conn)
        best: float | None = None
        for conn in self._by_handle.values():
            at = conn.timer_at
            if at is not None and (best is None or at < best):
                best = at
        return best

    def handle_timers(self, now: float) -> None:
        """Run every timer due by ``now``."""
        due = [
            conn
            for conn in self._by_handle.values()
            if conn in self._dirty or (conn.timer_at is not None and conn.timer_at <= now)
        ]
        for conn in due:
            touched = False
            timer = conn.quic.get_timer()
            if timer is not None and timer <= now:
                conn.quic.handle_timer(now=now)
                touched = True
            if conn.connect_deadline is not None and conn.connect_deadline <= now:
                self._fail(
                    conn,
                    ConnectTimeout(
                        f"no handshake with {format_address(conn.address)} within "
                        f"{self.config.connect_timeout_s:g} s"
                    ),
                    now,
                )
                touched = True
            if conn.keepalive_at is not None and conn.keepalive_at <= now and not conn.lost:
                conn.quic.send_ping(0)
                conn.last_activity = now
                touched = True
            if conn.probe_at is not None and conn.probe_at <= now and not conn.lost:
                self._probe(conn, now)
                touched = True
            if touched:
                self._after(conn, now)

    # -- output ---------------------------------------------------------------------------------

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        """Everything ready to go out now, from every connection with something to say."""
        out = self._stray_datagrams
        self._stray_datagrams = []
        dirty, self._dirty = self._dirty, set()
        # Data first: a step's packet should not wait behind another peer's lone ACK.
        ordered = sorted(dirty, key=no_data_pending) if len(dirty) > 1 else dirty
        for conn in ordered:
            sent = conn.quic.datagrams_to_send(now=now)
            if sent:
                if self.config.repair_group:
                    sent = self._with_repairs(conn, sent)
                out.extend(sent)
            self._drain_quic_events(conn, now)
            at = refresh_timer(conn)
            if at is not None and (self._timer_hint is None or at < self._timer_hint):
                self._timer_hint = at
        return out

    def _with_repairs(
        self, conn: Conn, sent: list[tuple[bytes, Address]]
    ) -> list[tuple[bytes, Address]]:
        if not conn.quic.losing:
            conn.repair_out = None  # and its run so far, if the path just stopped losing
            return sent
        encoder = conn.repair_out
        if encoder is None:
            encoder = conn.repair_out = RepairEncoder(
                group=self.config.repair_group, cid_bytes=_CID_BYTES
            )
        before = encoder.sent
        sent = encoder.interleave(
            sent, limit=conn.quic.datagram_bytes, last=not conn.quic.sending()
        )
        self.repairs_sent += encoder.sent - before
        return sent

    def take_timer_hint(self) -> float | None:
        """The soonest timer among connections touched since the last call (for a driver that
        sleeps until :meth:`next_timer` and must wake earlier when an operation armed one)."""
        hint, self._timer_hint = self._timer_hint, None
        return hint

    def next_event(self) -> EndpointEvent | None:
        return self._events.popleft() if self._events else None

    def events(self) -> Iterator[EndpointEvent]:
        while self._events:
            yield self._events.popleft()

    # -- streams --------------------------------------------------------------------------------

    def can_open_stream(self, handle: int) -> bool:
        """Whether :meth:`open_stream` may be called now (the peer allows another stream)."""
        return self._live(handle).quic.can_open_stream()

    def open_stream(self, handle: int) -> int:
        """Open a stream; only when :meth:`can_open_stream` says so."""
        conn = self._live(handle)
        if not conn.quic.can_open_stream():
            raise RuntimeError("the peer allows no more streams now: wait for can_open_stream")
        stream_id = conn.quic.get_next_available_stream_id()
        # aioquic creates a stream on its first write; create it now so the next caller gets
        # another ID even before anything is sent.
        conn.quic.send_stream_data(stream_id, b"")
        conn.open_streams[stream_id] = 0
        return stream_id

    def send_stream_data(
        self, handle: int, stream_id: int, data: bytes, now: float, *, end_stream: bool = False
    ) -> None:
        conn = self._live(handle)
        try:
            conn.quic.send_stream_data(stream_id, data, end_stream=end_stream)
        except (ValueError, RuntimeError) as exc:
            # aioquic refuses writes to a stream it already finished or discarded.
            raise StreamResetError(f"stream {stream_id} is finished: {exc}") from exc
        conn.last_activity = now
        self._after(conn, now)

    def consume(self, handle: int, stream_id: int, nbytes: int, now: float) -> bool:
        """The application took ``nbytes`` off the stream: the peer may send that much more.

        Returns whether that produced something to send (a window update).
        """
        conn = self._by_handle.get(handle)
        if conn is None or conn.lost:
            return False
        held = conn.open_streams.get(stream_id)
        if held is not None:
            conn.open_streams[stream_id] = held - nbytes
        if conn.quic.consume(stream_id, nbytes):
            # Only worth a packet once the peer's window should grow.
            self._after(conn, now)
            return True
        return False

    def hold_back(self, handle: int, stream_id: int, nbytes: int, now: float) -> None:
        """``nbytes`` of the stream will stay unread for a while: they stop counting against the
        connection's window (the stream's own window still bounds them)."""
        conn = self._by_handle.get(handle)
        if conn is None or conn.lost or not nbytes:
            return
        conn.quic.hold_back(stream_id, nbytes)
        self._after(conn, now)

    def send_room(self, handle: int, stream_id: int) -> int:
        """Bytes the application may queue on the stream now: within the connection's send
        budget, and within what the peer lets this stream send plus a small slack."""
        conn = self._live(handle)
        budget = self.config.send_buffer_bytes - conn.quic.send_buffered()
        return min(budget, conn.quic.stream_send_room(stream_id, _STREAM_SEND_SLACK))

    def reset_stream(self, handle: int, stream_id: int, error_code: int, now: float) -> None:
        """Abandon both directions of a stream (the peer's handler or reader sees a reset)."""
        conn = self._by_handle.get(handle)
        if conn is None or conn.lost:
            return
        stream = conn.quic.stream(stream_id)
        if stream is not None and not stream.sender.is_finished:
            conn.quic.reset_stream(stream_id, error_code)
        conn.open_streams.setdefault(stream_id, 0)
        self.release_stream(handle, stream_id, now, error_code=error_code)

    def release_stream(
        self, handle: int, stream_id: int, now: float, *, error_code: int = APP_CANCELLED
    ) -> None:
        """The application holds the stream no more.

        If the peer is still sending, it is asked to stop (what we sent is still delivered); bytes
        left unread no longer count against the window.
        """
        conn = self._by_handle.get(handle)
        if conn is None:
            return
        unread = conn.open_streams.pop(stream_id, None)
        if unread is None or conn.lost:
            return
        stream = conn.quic.stream(stream_id)
        # Something to send now: a STOP_SENDING, a connection window update, or (for a stream
        # the peer opened, once finished both ways) the MAX_STREAMS that lets it open another.
        due = conn.quic.forget_stream(stream_id, unread)
        if stream is not None and not stream.receiver.is_finished:
            conn.quic.stop_stream(stream_id, error_code)
            due = True
        if not locally_initiated(conn, stream_id):
            # Late frames for it must not look like a new call; aioquic forgets the ID itself
            # once both directions are finished, and then so do we.
            conn.released.add(stream_id)
            conn.released.intersection_update(conn.quic.stream_ids())
            due = due or stream is None or stream.is_finished
        if due:
            self._after(conn, now)

    def adopt_stream(self, handle: int, stream_id: int) -> None:
        """Mark a peer-opened stream as held by the application."""
        conn = self._by_handle.get(handle)
        if conn is not None:
            conn.open_streams.setdefault(stream_id, 0)

    def send_buffered(self, handle: int) -> int:
        """Unacknowledged bytes queued on the connection (what senders wait on)."""
        conn = self._by_handle.get(handle)
        return 0 if conn is None else conn.quic.send_buffered()

    # -- internals ------------------------------------------------------------------------------

    def _live(self, handle: int) -> Conn:
        conn = self._by_handle.get(handle)
        if conn is None or conn.lost:
            raise ConnectionClosed("the connection is closed")
        return conn

    def _after(self, conn: Conn, now: float) -> None:
        """Collect what an operation on ``conn`` produced and schedule its output."""
        self._dirty.add(conn)
        self._drain_quic_events(conn, now)
        closing = conn.quic.close_event()
        if closing is not None and not conn.lost:
            # The peer (or aioquic) ended the connection: say so now, not after the drain period.
            conn.lost = True
            conn.keepalive_at = conn.connect_deadline = None
            self._events.append(ConnectionLost(conn.handle, termination_error(conn, closing)))
        interval = self.config.keepalive_interval_s
        if conn.ready and interval is not None and not conn.lost:
            conn.keepalive_at = conn.last_activity + interval
        self._schedule_probe(conn)

    # -- a silent peer --------------------------------------------------------------------------

    def _schedule_probe(self, conn: Conn) -> None:
        silence = self.config.peer_silence_s
        if silence is None or conn.lost or not conn.ready or not conn.open_streams:
            conn.probe_at = conn.probing_since = None
        elif conn.probing_since is None:
            conn.probe_at = conn.last_received + silence

    def _probe(self, conn: Conn, now: float) -> None:
        """The peer said nothing for ``peer_silence_s`` while calls are open: PING it a few
        times; if none of that draws an answer within the grace period, it is gone."""
        silence = self.config.peer_silence_s
        if silence is None or not conn.open_streams:
            conn.probe_at = conn.probing_since = None
            return
        grace = max(silence, 4 * conn.quic.probe_timeout())
        if conn.probing_since is None:
            conn.probing_since = now
        elif now - conn.probing_since >= grace:
            self._fail(
                conn,
                ConnectionClosed(
                    f"{format_address(conn.address)} stopped answering: nothing for "
                    f"{now - conn.last_received:.1f} s while calls were open, PINGs unanswered"
                ),
                now,
            )
            return
        conn.quic.send_ping(0)
        conn.probe_at = min(now + grace / 3, conn.probing_since + grace)

    def _drain_quic_events(self, conn: Conn, now: float) -> None:
        quic = conn.quic
        while (event := quic.next_event()) is not None:
            if isinstance(event, qe.StreamDataReceived):
                if not conn.lost:
                    self._on_stream_data(conn, event, now)
            elif isinstance(event, qe.StreamReset):
                # aioquic counted the stream up to its final size against the connection;
                # what never reached us will never be consumed, so it is credited back now.
                conn.quic.credit_undelivered(event.stream_id)
                if event.stream_id in conn.open_streams and not conn.lost:
                    self._events.append(StreamReset(conn.handle, event.stream_id, event.error_code))
            elif isinstance(event, qe.StopSendingReceived):
                if event.stream_id in conn.open_streams and not conn.lost:
                    self._events.append(StopSending(conn.handle, event.stream_id, event.error_code))
            elif isinstance(event, qe.HandshakeCompleted):
                self._on_handshake(conn, now)
            elif isinstance(event, qe.ConnectionIdIssued):
                self._by_cid[event.connection_id] = conn
            elif isinstance(event, qe.ConnectionIdRetired):
                if self._by_cid.get(event.connection_id) is conn:
                    del self._by_cid[event.connection_id]
            elif isinstance(event, qe.ConnectionTerminated):
                self._on_terminated(conn, event)

    def _on_stream_data(self, conn: Conn, event: qe.StreamDataReceived, now: float) -> None:
        sid = event.stream_id
        held = conn.open_streams.get(sid)
        if held is None and (locally_initiated(conn, sid) or sid in conn.released):
            # A late packet for a stream we already let go: credit it back at once.
            if event.data:
                conn.quic.consume(sid, len(event.data))
                conn.quic.forget_stream(sid, 0)
            return
        conn.open_streams[sid] = (held or 0) + len(event.data)
        self._events.append(StreamData(conn.handle, sid, event.data, event.end_stream))

    def _on_handshake(self, conn: Conn, now: float) -> None:
        self._admission.proven(conn)
        cert = conn.quic.peer_certificate()
        if cert is None:
            self._fail(conn, IdentityMismatch("the peer presented no certificate"), now)
            return
        try:
            conn.peer_id = check_certificate_identity(cert, conn.expected_peer_id)
        except IdentityMismatch as exc:
            self._fail(conn, exc, now)
            return
        conn.ready = True
        conn.connect_deadline = None
        self._events.append(
            ConnectionReady(conn.handle, conn.peer_id, conn.address, conn.is_client)
        )

    def _fail(self, conn: Conn, error: TransportError, now: float) -> None:
        """Report ``conn`` lost with ``error`` at once and close it on the wire."""
        if conn.lost:
            return
        conn.lost = True
        conn.connect_deadline = None
        conn.keepalive_at = conn.probe_at = None
        code = APP_IDENTITY if isinstance(error, IdentityMismatch) else APP_CLOSED
        conn.quic.close(error_code=code, reason_phrase=str(error)[:200])
        self._dirty.add(conn)
        self._events.append(ConnectionLost(conn.handle, error))

    def _on_terminated(self, conn: Conn, event: qe.ConnectionTerminated) -> None:
        if not conn.lost:
            conn.lost = True
            self._events.append(ConnectionLost(conn.handle, termination_error(conn, event)))
        self._forget(conn)

    def _forget(self, conn: Conn) -> None:
        self._admission.release(conn)
        self._by_handle.pop(conn.handle, None)
        for cid in [cid for cid, c in self._by_cid.items() if c is conn]:
            del self._by_cid[cid]
        self._dirty.discard(conn)


def _moved_across_relay(conn: Conn, address: Address) -> bool:
    """Whether a datagram of ``conn`` comes through a relay where the connection does not, or
    the other way round.  Such a move is never a NAT's doing (a punched hole is a connection
    of its own), and would let a connection slip past the per-host bounds or a relay's."""
    return is_virtual(address) != conn.relayed
