"""The trio edge of the transport: one UDP socket, one pump task, streams with backpressure.

:func:`open_node` binds a socket and runs the pump for as long as its ``async with`` block; nothing
it starts outlives the block.  :meth:`Node.connect` dials a multiaddr and returns a
:class:`Connection` (one per peer, reused); :meth:`Connection.open_stream` opens a QUIC stream.
Incoming streams go to whatever :meth:`Node.set_stream_handler` registered (``serve_rpc`` does) and
are refused otherwise.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from .._errors import (
    ClosedResourceError,
    PeerUnreachable,
    StreamReset,
    TransportError,
)
from .._groups import open_block_nursery
from ._config import TransportConfig
from ._endpoint import (
    APP_CANCELLED,
    APP_REFUSED,
    Address,
    ConnectionLost,
    ConnectionReady,
    Endpoint,
    StopSending,
    StreamData,
    StreamReset as StreamResetEvent,
)
from ._identity import Identity, PeerID
from ._multiaddr import Multiaddr, as_multiaddr
from ._udp import DatagramSocket

__all__ = ["Connection", "Node", "NodeStatistics", "Stream", "open_node"]

logger = logging.getLogger(__name__)

# Datagrams the pump takes in before it processes them and lets others run.
_RECV_BATCH = 256
# Largest slice handed to aioquic at once, so one big write does not monopolise the send buffer.
_WRITE_SLICE = 1 << 20
_SMALL_WRITE = 64 << 10


@attrs.frozen(kw_only=True)
class NodeStatistics:
    """What a node holds now, and what it did since it opened (the counters)."""

    connections: int
    streams: int
    datagrams_sent: int
    datagrams_received: int
    bytes_sent: int
    bytes_received: int
    #: System calls that sent datagrams (one sends a run of them with segmentation offload).
    send_calls: int
    #: Sends put off because the socket's buffer was full.
    blocked_sends: int
    #: System calls that received datagrams (one takes a run of them with receive offload).
    receive_calls: int
    #: Receive calls that found nothing waiting (each wake-up's reading ends with one).
    empty_receives: int
    #: Times the pump woke up: a datagram arrived, a timer fell due, or both.
    pump_wakeups: int
    #: Wake-ups at a timer's deadline with no datagram waiting.
    timer_wakeups: int
    #: Whether runs of datagrams leave in one system call (UDP segmentation offload).
    segmentation_offload: bool
    #: Whether runs of datagrams arrive in one system call (UDP receive offload).
    receive_offload: bool


class Stream:
    """One bidirectional QUIC stream: ordered bytes each way, half-closable, resettable."""

    def __init__(self, connection: Connection, stream_id: int) -> None:
        self.connection = connection
        self.stream_id = stream_id
        self._chunks: deque[bytes] = deque()
        self._eof = False
        self._error: TransportError | None = None
        self._send_error: TransportError | None = None
        self._readable = trio.Event()
        self._closed = False
        self._sent_eof = False
        self._send_lock = trio.Lock()
        self._reset_scope: trio.CancelScope | None = None
        self._holding_back = False
        #: The error that broke this stream (reset, connection lost), once one did.
        self.failure: TransportError | None = None

    @property
    def peer_id(self) -> PeerID:
        return self.connection.peer_id

    # -- receiving --------------------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """The bytes the peer sent that we have not read yet (at most ``max_bytes``), waiting for
        some if there are none; ``b""`` once the peer finished its side."""
        if max_bytes is not None and max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, not {max_bytes}")
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._closed:
                raise ClosedResourceError("this stream was closed")
            if self._chunks:
                data = self._take(max_bytes)
                self.connection._consumed(self.stream_id, len(data))
                if self._chunks:
                    # More is waiting: let others run before the caller takes it.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                # Otherwise no schedule point: the caller usually answers at once, and the pump
                # (about to flush) then finds the answer, and our ACK, already gone.  The next
                # call blocks anyway, since everything buffered was just taken.
                return data
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._readable = trio.Event()
            await self._readable.wait()

    def _take(self, max_bytes: int | None) -> bytes:
        chunks = self._chunks
        parts = []
        size = 0
        while chunks and (max_bytes is None or size < max_bytes):
            chunk = chunks.popleft()
            if max_bytes is not None and size + len(chunk) > max_bytes:
                keep = max_bytes - size
                chunks.appendleft(chunk[keep:])
                chunk = chunk[:keep]
            parts.append(chunk)
            size += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- sending -----------------------------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview, *, eof: bool = False) -> None:
        """Queue ``data``; waits while the connection's unacknowledged bytes exceed their bound.

        ``eof=True`` finishes our side with the last bytes (as :meth:`send_eof` would, without
        a packet of its own).
        """
        await self._lock_for_sending()
        try:
            view = memoryview(data).cast("B")
            while True:
                # A schedule point before each large slice lets the pump take in
                # acknowledgements that arrived meanwhile, so the flush below finds the
                # congestion window open (a small message just goes).
                if len(view) > _SMALL_WRITE:
                    await trio.lowlevel.checkpoint()
                self._check_sendable()
                room = self.connection._send_room(self.stream_id)
                if room <= 0:
                    await self.connection._wait_send_room()
                    continue
                size = min(len(view), room, _WRITE_SLICE)
                last = size == len(view)
                self.connection._send(self.stream_id, bytes(view[:size]), end_stream=eof and last)
                view = view[size:]
                if last:
                    self._sent_eof = eof
                    break
        finally:
            self._send_lock.release()
        # Let the packets just queued leave (and the peer answer) before this task goes on.
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def send_eof(self) -> None:
        """Finish our side: the peer reads ``b""`` after the data already sent."""
        await self._lock_for_sending()
        try:
            self._check_sendable()
            self.connection._send(self.stream_id, b"", end_stream=True)
            self._sent_eof = True
        finally:
            self._send_lock.release()
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def _lock_for_sending(self) -> None:
        if self._send_lock.locked():
            await self._send_lock.acquire()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._send_lock.acquire_nowait()

    def _check_sendable(self) -> None:
        if self._closed:
            raise ClosedResourceError("this stream was closed")
        if self._sent_eof:
            raise ClosedResourceError("send_eof() was already called on this stream")
        if self._send_error is not None:
            raise self._send_error

    # -- ending ------------------------------------------------------------------------------------

    def reset(self, error_code: int = APP_CANCELLED) -> None:
        """Abandon the stream both ways at once (the peer sees :class:`StreamReset`)."""
        if not self._closed:
            self._closed = True
            self._readable.set()
            self.connection._reset(self.stream_id, error_code)

    async def aclose(self) -> None:
        """Let go of the stream.

        After :meth:`send_eof` what we sent is still delivered and the peer is only asked to stop
        sending; otherwise the stream is reset both ways (the peer never sees half a message
        as if it were complete).
        """
        if self._closed:
            return
        if self._sent_eof and self._send_error is None:
            self._closed = True
            self._readable.set()
            self.connection._release(self.stream_id)
        else:
            self.reset()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def cancel_on_reset(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` if the peer resets this stream or the connection is lost."""
        self._reset_scope = scope
        if self.failure is not None:
            scope.cancel()

    # -- driven by the node ------------------------------------------------------------------------

    def _broke(self, error: TransportError) -> None:
        if self.failure is None:
            self.failure = error
        if self._reset_scope is not None:
            self._reset_scope.cancel()

    def hold_back(self, holding: bool) -> None:
        """While ``holding``, bytes waiting here stop counting against the connection's window
        (the reader waits its turn for something, and must not starve the other streams)."""
        self._holding_back = holding
        if holding:
            self.connection._hold_back(self.stream_id, sum(len(c) for c in self._chunks))

    def _on_data(self, data: bytes, end_stream: bool) -> None:
        if data:
            self._chunks.append(data)
            if self._holding_back:
                self.connection._hold_back(self.stream_id, len(data))
        if end_stream:
            self._eof = True
        self._readable.set()

    def _on_reset(self, error_code: int) -> None:
        self._error = StreamReset(
            f"the peer reset stream {self.stream_id} (code {error_code:#x})", error_code=error_code
        )
        self._broke(self._error)
        self._readable.set()

    def _on_stop_sending(self, error_code: int) -> None:
        self._send_error = StreamReset(
            f"the peer stopped reading stream {self.stream_id} (code {error_code:#x})",
            error_code=error_code,
        )
        self._broke(self._send_error)
        self.connection._wake_senders()

    def _on_lost(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        if self._send_error is None:
            self._send_error = error
        self._broke(error)
        self._readable.set()


class Connection:
    """A QUIC connection to one authenticated peer."""

    def __init__(self, node: Node, handle: int, address: Address, *, we_dialed: bool) -> None:
        self._node = node
        self._we_dialed = we_dialed
        self._handle = handle
        self.address = address
        # The PeerID dialed, until the handshake proves it (or the one the caller proved).
        self.peer_id: PeerID = None  # type: ignore[assignment]
        self._streams: dict[int, Stream] = {}
        self._ready = trio.Event()
        self._error: TransportError | None = None
        self._closed_by_us = False
        self._room_waiters = trio.lowlevel.ParkingLot()
        self._lost = trio.Event()
        self._incoming = 0
        # Other connect() calls waiting for this connection's handshake.
        self._waiters = 0
        # One stream at a time may assemble a frame over config.large_frame_bytes (see _rpc).
        self._large_frames = trio.Semaphore(1)

    @property
    def multiaddr(self) -> Multiaddr:
        return Multiaddr.from_socket_address(*self.address, peer_id=self.peer_id)

    @property
    def is_closed(self) -> bool:
        return self._error is not None

    async def open_stream(self) -> Stream:
        """Open a new bidirectional stream to the peer (waiting while it allows no more)."""
        endpoint = self._node._endpoint
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        while not endpoint.can_open_stream(self._handle):
            # Woken by the pump as the peer raises its limit (or the connection ends).
            self._node._send_waiters.add(self)
            await self._room_waiters.park()
            self._check_open()
        stream_id = endpoint.open_stream(self._handle)
        stream = Stream(self, stream_id)
        self._streams[stream_id] = stream
        # From here on the caller owns the stream: no cancellation may strand it.
        await trio.lowlevel.cancel_shielded_checkpoint()
        return stream

    async def aclose(self) -> None:
        """Close the connection; its streams fail with :class:`ClosedResourceError`."""
        if self._error is None:
            self._closed_by_us = True
            self._on_lost(ClosedResourceError("this connection was closed"))
            self._node._endpoint.close(self._handle, trio.current_time(), reason="closed")
            self._node._flush()
        await trio.lowlevel.checkpoint()

    async def wait_closed(self) -> TransportError:
        """Wait until the connection ends; returns why."""
        await self._lost.wait()
        assert self._error is not None
        return self._error

    def _check_open(self) -> None:
        if self._error is not None:
            if self._closed_by_us:
                raise ClosedResourceError("this connection was closed") from self._error
            raise self._error

    # -- used by streams ---------------------------------------------------------------------------

    def _send_room(self, stream_id: int) -> int:
        """Bytes we may queue on ``stream_id`` now (see :meth:`Endpoint.send_room`)."""
        self._check_open()
        return self._node._endpoint.send_room(self._handle, stream_id)

    async def _wait_send_room(self) -> None:
        """Wait until acknowledgements free some room (or the connection ends)."""
        self._node._send_waiters.add(self)
        await self._room_waiters.park()

    def _wake_senders(self) -> None:
        self._room_waiters.unpark_all()

    def _send(self, stream_id: int, data: bytes, *, end_stream: bool) -> None:
        self._check_open()
        self._node._endpoint.send_stream_data(
            self._handle, stream_id, data, trio.current_time(), end_stream=end_stream
        )
        self._node._flush()

    def _consumed(self, stream_id: int, nbytes: int) -> None:
        if self._node._endpoint.consume(self._handle, stream_id, nbytes, trio.current_time()):
            self._node._flush()

    def _hold_back(self, stream_id: int, nbytes: int) -> None:
        self._node._endpoint.hold_back(self._handle, stream_id, nbytes, trio.current_time())
        self._node._flush()

    def _reset(self, stream_id: int, error_code: int) -> None:
        self._forget(stream_id)
        self._node._endpoint.reset_stream(self._handle, stream_id, error_code, trio.current_time())
        self._node._flush()

    def _release(self, stream_id: int) -> None:
        self._forget(stream_id)
        self._node._endpoint.release_stream(self._handle, stream_id, trio.current_time())
        self._node._flush()

    def _forget(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None and _peer_initiated(self, stream_id):
            self._incoming -= 1

    # -- driven by the node ------------------------------------------------------------------------

    def _on_lost(self, error: TransportError) -> None:
        if self._error is not None:
            return
        self._error = error
        for stream in self._streams.values():
            stream._on_lost(error)
        self._ready.set()
        self._room_waiters.unpark_all()
        self._lost.set()


def _peer_initiated(connection: Connection, stream_id: int) -> bool:
    # Client-initiated streams have even IDs (RFC 9000 section 2.1).
    return (stream_id & 1 == 0) != connection._we_dialed


class Node:
    """A transport endpoint: identity, one UDP socket, its connections.  Use :func:`open_node`."""

    def __init__(self, identity: Identity, config: TransportConfig, udp: DatagramSocket) -> None:
        self.identity = identity
        self.config = config
        self._udp = udp
        self._endpoint = Endpoint(identity, config)
        self._connections: dict[int, Connection] = {}
        self._by_peer: dict[PeerID, Connection] = {}
        self._send_waiters: set[Connection] = set()
        self._outbox: deque[tuple[bytes, Address]] = deque()
        self._outbox_ready = trio.Event()
        self._pump_scope: trio.CancelScope | None = None
        self._dispatching = False
        self._stream_handler: Callable[[Stream], None] | None = None
        self._closed = False
        self._pump_wakeups = 0
        self._timer_wakeups = 0
        self.listen_multiaddr = Multiaddr.from_socket_address(
            *udp.local_address(), peer_id=identity.peer_id
        )

    @property
    def peer_id(self) -> PeerID:
        return self.identity.peer_id

    def statistics(self) -> NodeStatistics:
        udp = self._udp
        return NodeStatistics(
            connections=len(self._connections),
            streams=sum(len(c._streams) for c in self._connections.values()),
            datagrams_sent=udp.datagrams_sent,
            datagrams_received=udp.datagrams_received,
            bytes_sent=udp.bytes_sent,
            bytes_received=udp.bytes_received,
            send_calls=udp.send_calls,
            blocked_sends=udp.blocked_sends,
            receive_calls=udp.receive_calls,
            empty_receives=udp.empty_receives,
            pump_wakeups=self._pump_wakeups,
            timer_wakeups=self._timer_wakeups,
            segmentation_offload=udp.segmentation,
            receive_offload=udp.coalescing,
        )

    def set_stream_handler(self, handler: Callable[[Stream], None] | None) -> None:
        """Route streams that peers open to ``handler`` (called synchronously; spawn a task)."""
        self._stream_handler = handler

    async def connect(self, address: Multiaddr | str) -> Connection:
        """Dial ``address``; if it names a PeerID the peer must prove that key.

        Reuses the live connection to that peer when there is one.
        """
        if self._closed:
            raise ClosedResourceError("this node was closed")
        maddr = as_multiaddr(address)
        if maddr.peer_id is not None:
            existing = self._by_peer.get(maddr.peer_id)
            if existing is not None and existing._error is None:
                existing._waiters += 1
                try:
                    await existing._ready.wait()
                finally:
                    existing._waiters -= 1
                if existing._error is None:
                    return existing
        sockaddr = maddr.socket_address
        handle = self._endpoint.connect(sockaddr, maddr.peer_id, trio.current_time())
        connection = Connection(self, handle, sockaddr, we_dialed=True)
        self._connections[handle] = connection
        if maddr.peer_id is not None:
            connection.peer_id = maddr.peer_id
            self._by_peer[maddr.peer_id] = connection
        self._flush()
        try:
            await connection._ready.wait()
        except BaseException:
            # Abandoned before the handshake finished: nobody else can be waiting on it
            # unless they found it in _by_peer, and those wait for readiness themselves.
            if not connection._ready.is_set() and connection._waiters == 0:
                self._endpoint.close(handle, trio.current_time(), reason="dial abandoned")
                self._flush()
            raise
        connection._check_open()
        return connection

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        now = trio.current_time()
        for connection in list(self._connections.values()):
            if connection._error is None:
                connection._closed_by_us = True
                connection._on_lost(ClosedResourceError("the node was closed"))
                self._endpoint.close(connection._handle, now, reason="node shutting down")
        self._flush()
        await trio.lowlevel.checkpoint()

    # -- the pump ----------------------------------------------------------------------------------

    async def _pump(self) -> None:
        udp = self._udp
        endpoint = self._endpoint
        while True:
            deadline = endpoint.next_timer()
            with trio.move_on_at(math.inf if deadline is None else deadline) as scope:
                self._pump_scope = scope
                await trio.lowlevel.wait_readable(udp.sock)
            self._pump_scope = None
            now = trio.current_time()
            datagrams = udp.receive(_RECV_BATCH)
            self._pump_wakeups += 1
            if scope.cancelled_caught and not datagrams:
                self._timer_wakeups += 1
            for data, address in datagrams:
                endpoint.receive_datagram(data, address, now)
            endpoint.handle_timers(now)
            self._dispatch_events()
            # Let the tasks just woken answer first (one schedule point to take their data,
            # one to send the answer): their packets then carry our ACKs, and the flush below
            # usually finds nothing left to send.
            await trio.lowlevel.checkpoint()
            await trio.lowlevel.checkpoint()
            self._flush()
            if self._send_waiters:
                waiters, self._send_waiters = self._send_waiters, set()
                for connection in waiters:
                    connection._wake_senders()

    async def _sender(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            while self._outbox:
                await trio.lowlevel.wait_writable(self._udp.sock)
                self._send_outbox()

    def _flush(self) -> None:
        """Send what the endpoint produced and hand its events to connections and streams."""
        endpoint = self._endpoint
        now = trio.current_time()
        self._outbox.extend(endpoint.datagrams_to_send(now))
        if self._outbox:
            self._send_outbox()
            if self._outbox:
                self._outbox_ready.set()
        self._dispatch_events()
        # An operation outside the pump may have armed a timer sooner than the pump sleeps for.
        hint = endpoint.take_timer_hint()
        scope = self._pump_scope
        if hint is not None and scope is not None and hint < scope.deadline:
            scope.deadline = hint

    def _dispatch_events(self) -> None:
        # A handler that acts on a stream synchronously flushes, which lands here again: the
        # outer loop goes on draining the same queue, in order.
        if self._dispatching:
            return
        self._dispatching = True
        try:
            for event in self._endpoint.events():
                self._dispatch(event)
        finally:
            self._dispatching = False

    def _send_outbox(self) -> None:
        outbox = self._outbox
        while outbox:
            try:
                self._udp.send(outbox)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                _, address = outbox.popleft()
                if exc.errno not in (errno.EMSGSIZE,):
                    self._unreachable(address, exc)

    def _unreachable(self, address: Address, exc: OSError) -> None:
        now = trio.current_time()
        for connection in list(self._connections.values()):
            if connection.address == address and connection._error is None:
                error = PeerUnreachable(f"cannot send to {address[0]} port {address[1]}: {exc}")
                error.__cause__ = exc
                self._endpoint.fail(connection._handle, error, now)
        self._dispatch_events()

    def _dispatch(self, event: object) -> None:
        if isinstance(event, StreamData):
            connection = self._connections.get(event.handle)
            if connection is None:
                return
            stream = connection._streams.get(event.stream_id)
            if stream is None:
                stream = self._incoming_stream(connection, event.stream_id)
                if stream is None:
                    return
            stream._on_data(event.data, event.end_stream)
        elif isinstance(event, StreamResetEvent | StopSending):
            connection = self._connections.get(event.handle)
            stream = None if connection is None else connection._streams.get(event.stream_id)
            if stream is not None:
                if isinstance(event, StopSending):
                    stream._on_stop_sending(event.error_code)
                else:
                    stream._on_reset(event.error_code)
        elif isinstance(event, ConnectionReady):
            self._on_ready(event)
        elif isinstance(event, ConnectionLost):
            connection = self._connections.pop(event.handle, None)
            if connection is not None:
                if self._by_peer.get(connection.peer_id) is connection:
                    del self._by_peer[connection.peer_id]
                connection._on_lost(event.error)

    def _on_ready(self, event: ConnectionReady) -> None:
        connection = self._connections.get(event.handle)
        if connection is None:
            connection = Connection(self, event.handle, event.address, we_dialed=False)
            self._connections[event.handle] = connection
        connection.peer_id = event.peer_id
        self._by_peer.setdefault(event.peer_id, connection)
        connection._ready.set()

    def _incoming_stream(self, connection: Connection, stream_id: int) -> Stream | None:
        endpoint = self._endpoint
        now = trio.current_time()
        if not _peer_initiated(connection, stream_id):
            return None
        if self._stream_handler is None or connection._incoming >= self.config.max_incoming_streams:
            endpoint.reset_stream(connection._handle, stream_id, APP_REFUSED, now)
            return None
        endpoint.adopt_stream(connection._handle, stream_id)
        stream = Stream(connection, stream_id)
        connection._streams[stream_id] = stream
        connection._incoming += 1
        try:
            self._stream_handler(stream)
        except Exception:
            # The handler is the application's; its failure costs this stream, not the node.
            logger.exception("the stream handler raised; stream %d refused", stream_id)
            stream.reset(APP_REFUSED)
            return None
        return stream


def _bind(host: str, port: int, config: TransportConfig) -> DatagramSocket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        if family == socket.AF_INET6:
            # Dual stack where the host allows it: one socket reaches IPv4 and IPv6 peers.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            if config.socket_buffer_bytes:
                sock.setsockopt(socket.SOL_SOCKET, option, config.socket_buffer_bytes)
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise PeerUnreachable(f"cannot bind UDP {host} port {port}: {exc}") from exc
    return DatagramSocket(sock, offload=config.udp_offload)


@asynccontextmanager
async def open_node(
    identity: Identity | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    config: TransportConfig | None = None,
) -> AsyncIterator[Node]:
    """Bind a UDP socket on ``host``/``port`` and run a node for the duration of the block.

    ``identity`` defaults to a fresh key (a new PeerID each run); servers pass a persistent one
    from :func:`load_or_create_identity`.  ``host="::"`` listens on IPv6 and IPv4.
    """
    identity = identity if identity is not None else Identity.generate()
    config = config if config is not None else TransportConfig()
    udp = _bind(host, port, config)
    node = Node(identity, config, udp)
    try:
        async with open_block_nursery() as nursery:
            nursery.start_soon(node._pump)
            nursery.start_soon(node._sender)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await node.aclose()
    finally:
        udp.close()
