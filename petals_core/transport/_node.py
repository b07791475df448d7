"""The trio edge of the transport: one UDP socket, one pump task, its connections.

:func:`open_node` binds a socket and runs the pump for as long as its ``async with`` block; nothing
it starts outlives the block.  :meth:`Node.connect` dials a multiaddr and returns a
:class:`Connection` (one per peer, reused); :meth:`Connection.open_stream` opens a QUIC stream.
Incoming streams go to whatever :meth:`Node.set_stream_handler` registered (``serve_rpc`` does) and
are refused otherwise.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

import attrs
import trio

from .._errors import ClosedResourceError, ConfigError, PeerUnreachable, TransportError
from .._groups import open_block_nursery
from ._config import TransportConfig
from ._connection import Connection, Stream, peer_initiated
from ._endpoint import (
    Address,
    ConnectionLost,
    ConnectionReady,
    Endpoint,
    StopSending,
    StreamData,
    StreamReset as StreamResetEvent,
)
from ._endpoint_conn import APP_REFUSED
from ._identity import Identity, PeerID
from ._multiaddr import Multiaddr, as_multiaddr
from ._punch import punch_hole
from ._relay import CircuitDialers, RelayLimits, RelayTable, close_circuit, open_relayed_channel
from ._relay_wire import PUNCH, PUNCH_PROBE, RELAY_HEADER, RELAYED, split_virtual, virtual_address
from ._repair import REPAIR
from ._udp import DatagramSocket, forbid_fragmentation

__all__ = ["Node", "NodeStatistics", "open_node"]

logger = logging.getLogger(__name__)

# Datagrams the pump takes in before it processes them and lets others run.
_RECV_BATCH = 256


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
    #: Hole-punching probes that arrived (and were dropped, as they are meant to be).
    punches_received: int = 0
    #: Repair datagrams sent on lossy paths, and datagrams rebuilt from peers' repairs (see
    #: ``_repair``).
    repairs_sent: int = 0
    datagrams_rebuilt: int = 0
    #: Handshakes asked to prove their address first (QUIC Retries sent, see
    #: ``TransportConfig.max_unproven_handshakes``).
    retries_sent: int = 0


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
        self._flush_due = False
        self._flush_wanted = trio.Event()
        self._pump_scope: trio.CancelScope | None = None
        self._dispatching = False
        self._stream_handler: Callable[[Stream], None] | None = None
        self._closed = False
        self._pump_wakeups = 0
        self._timer_wakeups = 0
        self._punches_received = 0
        #: What this node relays for others (see start_relaying); None: it does not.
        self.relay: RelayTable | None = None
        # Relays we take relayed datagrams from (those we hold reservations with or dial
        # through): their socket address -> their PeerID and how many uses hold it.
        self._relays: dict[Address, tuple[PeerID, int]] = {}
        #: Who opened the circuits to us through those relays, as they told us.
        self.circuit_dialers = CircuitDialers()
        # Peers that connect_any is dialling now.
        self._dialing: dict[PeerID, trio.Event] = {}
        # Peers a hole could not be punched to, and until when not to try again.
        self._punch_failures: dict[PeerID, float] = {}
        # Where the node's own background tasks run (set by open_node).
        self._tasks: trio.Nursery | None = None
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
            punches_received=self._punches_received,
            repairs_sent=self._endpoint.repairs_sent,
            datagrams_rebuilt=self._endpoint.datagrams_rebuilt,
            retries_sent=self._endpoint.retries_sent,
        )

    @property
    def connections(self) -> list[Connection]:
        """The live connections (handshake done): which peers, which through a relay."""
        return [c for c in self._connections.values() if c._ready.is_set() and c._error is None]

    def start_relaying(self, limits: RelayLimits) -> RelayTable:
        """Forward relayed datagrams for others within ``limits`` (the first call's limits
        stay); the table of reservations and circuits, for ``RelayService`` to fill."""
        if self.relay is None:
            # A relay sends without QUIC's limit on unproven addresses: to proven ones only.
            self.relay = RelayTable(
                limits, functools.partial(self._endpoint.peer_address, validated=True)
            )
        return self.relay

    @contextmanager
    def relayed_through(self, connection: Connection) -> Iterator[None]:
        """Take relayed datagrams from the relay at the other end of ``connection`` while
        inside (a reservation held there, or a connection dialled through it)."""
        address = connection.current_address
        self._trust_relay(address, connection.peer_id)
        try:
            yield
        finally:
            self._untrust_relay(address)

    def _trust_relay(self, address: Address, peer_id: PeerID) -> None:
        _, uses = self._relays.get(address, (peer_id, 0))
        self._relays[address] = (peer_id, uses + 1)

    def _untrust_relay(self, address: Address) -> None:
        peer_id, uses = self._relays.get(address, (None, 0))
        if uses > 1 and peer_id is not None:
            self._relays[address] = (peer_id, uses - 1)
        else:
            self._relays.pop(address, None)

    def relay_of(self, address: Address) -> PeerID | None:
        """The PeerID of the relay behind a virtual address (None for a real address)."""
        split = split_virtual(address)
        if split is None:
            return None
        entry = self._relays.get(split[0])
        return None if entry is None else entry[0]

    def set_stream_handler(self, handler: Callable[[Stream], None] | None) -> None:
        """Route streams that peers open to ``handler`` (called synchronously; spawn a task)."""
        self._stream_handler = handler

    async def connect(self, address: Multiaddr | str) -> Connection:
        """Dial ``address``; if it names a PeerID the peer must prove that key.

        Reuses the live connection to that peer when there is one.  A relayed address is dialled
        through its relay (see ``_relay``).
        """
        if self._closed:
            raise ClosedResourceError("this node was closed")
        maddr = as_multiaddr(address)
        existing = await self._live(maddr.peer_id)
        if existing is not None:
            return existing
        return await self._dial(maddr, register=True)

    async def connect_any(self, addresses: Sequence[Multiaddr | str]) -> Connection:
        """Dial one peer at whichever of its ``addresses`` answers first (all name the same
        PeerID, best first, as the peer announced them).

        Addresses are tried in order, the next one starting when the one before has not
        connected within ``config.dial_stagger_s`` (or failed); the first handshake wins and the
        rest are abandoned.  Loopback addresses are skipped unless this node listens on
        loopback, where nothing else can be dialled.  A peer that announces relayed addresses
        is behind a NAT: it is reached through a relay first, then a hole is punched to its
        direct addresses (see ``_punch``) within ``config.hole_punch_timeout_s``, and the
        direct connection is returned when it opens (the relayed one closes once the calls on
        it end), else the relayed one.  Reuses a live connection to the peer, or the one
        another task is dialling.
        """
        if self._closed:
            raise ClosedResourceError("this node was closed")
        maddrs = [as_multiaddr(address) for address in addresses]
        peers = {maddr.peer_id for maddr in maddrs}
        peer_id = maddrs[0].peer_id if maddrs else None
        if peer_id is None or len(peers) != 1:
            raise ConfigError(
                "connect_any takes one or more addresses of one peer, each with its PeerID"
            )
        while True:
            existing = await self._live(peer_id)
            if existing is not None:
                return existing
            pending = self._dialing.get(peer_id)
            if pending is None:
                break
            # Another task is dialling this peer: its connection will do for us too.
            await pending.wait()
        dialing = self._dialing[peer_id] = trio.Event()
        try:
            return await self._dial_any(peer_id, maddrs)
        finally:
            if self._dialing.get(peer_id) is dialing:
                del self._dialing[peer_id]
            dialing.set()

    async def _dial_any(self, peer_id: PeerID, maddrs: list[Multiaddr]) -> Connection:
        on_loopback = self.listen_multiaddr.is_loopback
        usable = [m for m in maddrs if m.is_loopback == on_loopback or m.is_relayed]
        if not usable:
            raise PeerUnreachable(
                f"{peer_id} announced no address this node can dial from "
                f"{self.listen_multiaddr.host} ({', '.join(map(str, maddrs))})"
            )
        relayed = [m for m in usable if m.is_relayed]
        direct = [m for m in usable if not m.is_relayed]
        if not relayed:
            return await self._connect_first(direct)
        # A peer that announces relayed addresses cannot be dialled unasked: its NAT would drop
        # our datagrams (and, on some routers, keep our port from a hole punched later).  Its
        # direct addresses are for punching, or a last resort.
        try:
            connection = await self._connect_first(relayed)
        except PeerUnreachable:
            if not direct:
                raise
            return await self._connect_first(direct)
        punchable = [m for m in direct if not m.is_loopback]
        if punchable and self.config.hole_punch_timeout_s is not None:
            punched = await punch_hole(self, connection, punchable)
            if punched is not None:
                return punched
        return connection

    async def _live(self, peer_id: PeerID | None) -> Connection | None:
        """The live connection to ``peer_id`` (once its handshake is done), if there is one."""
        if peer_id is None:
            return None
        existing = self._by_peer.get(peer_id)
        if existing is None or existing._error is not None:
            return None
        existing._waiters += 1
        try:
            await existing._ready.wait()
        finally:
            existing._waiters -= 1
        return existing if existing._error is None else None

    async def _dial(self, maddr: Multiaddr, *, register: bool) -> Connection:
        """A new connection to ``maddr``; with ``register``, others dialling its PeerID
        meanwhile wait for this one."""
        relay_address = None
        if maddr.is_relayed:
            relay_connection, sockaddr, observed = await open_relayed_channel(self, maddr)
            relay_address = relay_connection.current_address
            self._trust_relay(relay_address, relay_connection.peer_id)
        else:
            relay_connection = None
            sockaddr = await _resolve(maddr, prefer=self.listen_multiaddr.family)
            observed = None
        handle = self._endpoint.connect(sockaddr, maddr.peer_id, trio.current_time())
        connection = Connection(self, handle, sockaddr, we_dialed=True)
        connection._relay_address = relay_address
        connection._relay_connection = relay_connection
        connection._observed = observed
        self._connections[handle] = connection
        if maddr.peer_id is not None:
            connection.peer_id = maddr.peer_id
            if register:
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

    async def _connect_first(self, addresses: Sequence[Multiaddr]) -> Connection:
        """The first connection made to one of ``addresses``, tried in order, each next one
        once the one before failed or ``dial_stagger_s`` passed; the others are abandoned."""
        won: list[Connection] = []
        errors: list[str] = []
        stagger_s = self.config.dial_stagger_s
        async with trio.open_nursery() as nursery:
            previous_done = trio.Event()
            previous_done.set()
            for address in addresses:
                done = trio.Event()

                async def attempt(address: Multiaddr, done: trio.Event) -> None:
                    try:
                        connection = await self._dial(address, register=False)
                    except TransportError as exc:
                        errors.append(f"{address}: {type(exc).__name__}: {exc}")
                        done.set()
                        return
                    if won:
                        await connection.aclose()
                        return
                    won.append(connection)
                    nursery.cancel_scope.cancel()

                if address is not addresses[0]:
                    with trio.move_on_after(stagger_s):
                        await previous_done.wait()
                nursery.start_soon(attempt, address, done)
                previous_done = done
        if won:
            connection = won[0]
            self._by_peer[connection.peer_id] = connection
            return connection
        raise PeerUnreachable("no address answered: " + "; ".join(errors))

    def send_punches(self, addresses: Sequence[Address]) -> None:
        """Send one hole-punching probe to each of ``addresses`` (it opens our NAT towards
        them; they drop it)."""
        for address in addresses:
            self._outbox.append((PUNCH_PROBE, address))
        self._flush()

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

    def _close_circuit(self, connection: Connection) -> None:
        """Have the circuit of ``connection`` (one we dialled through a relay, now ended)
        closed on its relay, unless the relay connection ended too (which closed it)."""
        relay = connection._relay_connection
        split = split_virtual(connection.address)
        if self._closed or self._tasks is None or relay is None or relay._error is not None:
            return
        assert split is not None
        self._tasks.start_soon(close_circuit, relay, split[1], self.config.connect_timeout_s)

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
                if data and data[0] & 0x40:
                    endpoint.receive_datagram(data, address, now)
                else:
                    self._receive_ours(data, address, now)
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

    def _receive_ours(self, data: bytes, address: Address, now: float) -> None:
        """A datagram that is not QUIC (see ``_relay_wire``): forward it as a relay, take it
        from one of our relays, or drop it."""
        if not data:
            return
        if data[0] == RELAYED and len(data) > RELAY_HEADER.size:
            if self.relay is not None:
                destination = self.relay.forward(data, address, now)
                if destination is not None:
                    self._outbox.append((data, destination))
                    return
            if address in self._relays:
                _, channel = RELAY_HEADER.unpack_from(data)
                self._endpoint.receive_datagram(
                    data[RELAY_HEADER.size :], virtual_address(address, channel), now
                )
        elif data[0] == PUNCH:
            self._punches_received += 1
        elif data[0] == REPAIR:
            self._endpoint.receive_datagram(data, address, now)

    async def _sender(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            while self._outbox:
                await trio.lowlevel.wait_writable(self._udp.sock)
                self._send_outbox()

    def _flush_soon(self) -> None:
        """Flush once the tasks running now have had their turn: the data several of them
        queue (steps of several sessions released together) leave in the same packets."""
        if not self._flush_due:
            self._flush_due = True
            self._flush_wanted.set()

    async def _flusher(self) -> None:
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted = trio.Event()
            if self._flush_due:
                self._flush()

    def _flush(self) -> None:
        """Send what the endpoint produced and hand its events to connections and streams."""
        self._flush_due = False
        endpoint = self._endpoint
        now = trio.current_time()
        datagrams = endpoint.datagrams_to_send(now)
        if self._relays:
            datagrams = [_through_relay(data, address) for data, address in datagrams]
        self._outbox.extend(datagrams)
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
            if connection._error is None and address in (
                connection.address,
                connection._relay_address,
            ):
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
            if self.relay is not None:
                self.relay.connection_lost(event.handle)
            if connection is not None:
                if connection._relay_address is not None:
                    self._untrust_relay(connection._relay_address)
                    self._close_circuit(connection)
                self.circuit_dialers.forget(connection.address)
                if self._by_peer.get(connection.peer_id) is connection:
                    del self._by_peer[connection.peer_id]
                connection._on_lost(event.error)

    def _on_ready(self, event: ConnectionReady) -> None:
        connection = self._connections.get(event.handle)
        if connection is None:
            connection = Connection(self, event.handle, event.address, we_dialed=False)
            self._connections[event.handle] = connection
        connection.peer_id = event.peer_id
        known = self._by_peer.get(event.peer_id)
        if known is None or (known.is_relayed and not connection.is_relayed):
            # A direct connection (a punched hole) takes over new work from a relayed one.
            self._by_peer[event.peer_id] = connection
        connection._ready.set()

    def _incoming_stream(self, connection: Connection, stream_id: int) -> Stream | None:
        endpoint = self._endpoint
        now = trio.current_time()
        if not peer_initiated(connection, stream_id):
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


def _through_relay(data: bytes, address: Address) -> tuple[bytes, Address]:
    """A datagram for a virtual address: to its relay, behind the channel's header."""
    split = split_virtual(address)
    if split is None:
        return data, address
    relay, channel = split
    return RELAY_HEADER.pack(RELAYED, channel) + data, relay


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
        if config.path_mtu_discovery:
            forbid_fragmentation(sock)
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
            nursery.start_soon(node._flusher)
            node._tasks = nursery
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    await node.aclose()
    finally:
        udp.close()


async def _resolve(maddr: Multiaddr, *, prefer: int | None) -> tuple[str, int]:
    """The IP address and port to dial for ``maddr``, its DNS name (if any) resolved now (an
    address of family ``prefer``, 4 or 6, first); :class:`PeerUnreachable` if the name does not
    resolve (to the family it asks for)."""
    if maddr.dns is None:
        return maddr.socket_address
    family = {4: socket.AF_INET, 6: socket.AF_INET6}.get(maddr.family or 0, socket.AF_UNSPEC)
    try:
        infos = await trio.socket.getaddrinfo(maddr.host, maddr.port, family, socket.SOCK_DGRAM)
    except OSError as exc:
        raise PeerUnreachable(f"cannot resolve {maddr.host!r} of {maddr}: {exc}") from None
    preferred = {4: socket.AF_INET, 6: socket.AF_INET6}.get(prefer or 0)
    addresses = sorted(
        (info for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)),
        key=lambda info: info[0] != preferred,
    )
    if addresses:
        return (str(addresses[0][4][0]).split("%", 1)[0], maddr.port)
    raise PeerUnreachable(f"{maddr.host!r} of {maddr} resolves to no IP address")
