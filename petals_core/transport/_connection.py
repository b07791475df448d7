"""A QUIC connection to one authenticated peer and its streams, driven by the node's pump.

A :class:`Stream` queues what it sends through its :class:`Connection`, which hands it to the
node's endpoint and flushes; the pump delivers each stream's data, resets and losses back.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import trio

from .._errors import ClosedResourceError, StreamReset, TransportError
from ._endpoint_conn import APP_CANCELLED
from ._endpoint_events import Address
from ._identity import PeerID
from ._multiaddr import Multiaddr
from ._quic_path import PathInfo
from ._relay_wire import split_virtual

if TYPE_CHECKING:
    from ._node import Node

__all__ = ["Connection", "Stream"]

# Largest slice handed to aioquic at once, so one big write does not monopolise the send buffer.
_WRITE_SLICE = 1 << 20
_SMALL_WRITE = 64 << 10


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
        # The relay's socket address and our connection to it (the circuit's), for a
        # connection we dialled through a relay.
        self._relay_address: Address | None = None
        self._relay_connection: Connection | None = None
        # Our address as the relay saw it, for a connection we dialled through a relay.
        self._observed: Multiaddr | None = None
        # Replaced by another connection to the peer: closed once no stream is open.
        self._retiring = False

    @property
    def current_address(self) -> Address:
        """The address the peer sends from now: ``address``, unless its NAT moved it since."""
        return self._node._endpoint.peer_address(self._handle) or self.address

    def path(self) -> PathInfo | None:
        """What this connection learned of its path (datagram size, RTT, congestion window);
        None once it is closed."""
        return self._node._endpoint.path_info(self._handle)

    @property
    def relay(self) -> PeerID | None:
        """The PeerID of the relay this connection goes through; None for a direct one."""
        return self._node.relay_of(self.address)

    @property
    def is_relayed(self) -> bool:
        """Whether this connection goes through a relay (``relay`` names it while we still
        take datagrams from it)."""
        return split_virtual(self.address) is not None

    @property
    def multiaddr(self) -> Multiaddr:
        relay = self.relay
        if relay is not None:
            split = split_virtual(self.address)
            assert split is not None
            host, port = split[0]
            return Multiaddr(host, port, self.peer_id, relay=relay)
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
        self._close("closed")
        await trio.lowlevel.checkpoint()

    def _close(self, reason: str) -> None:
        if self._error is None:
            self._closed_by_us = True
            self._on_lost(ClosedResourceError("this connection was closed"))
            self._node._endpoint.close(self._handle, trio.current_time(), reason=reason)
            self._node._flush()

    def _retire(self) -> None:
        """Close the connection once no stream is open on it: the node hands out another to
        this peer from now on, and the calls under way here finish first."""
        self._retiring = True
        self._close_if_retired()

    def _close_if_retired(self) -> None:
        if self._retiring and not self._streams:
            self._close("replaced by another connection")

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
        self._node._flush_soon()

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
        self._close_if_retired()

    def _release(self, stream_id: int) -> None:
        self._forget(stream_id)
        self._node._endpoint.release_stream(self._handle, stream_id, trio.current_time())
        self._node._flush()
        self._close_if_retired()

    def _forget(self, stream_id: int) -> None:
        stream = self._streams.pop(stream_id, None)
        if stream is not None and peer_initiated(self, stream_id):
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


def peer_initiated(connection: Connection, stream_id: int) -> bool:
    # Client-initiated streams have even IDs (RFC 9000 section 2.1).
    return (stream_id & 1 == 0) != connection._we_dialed
