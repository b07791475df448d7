"""Relays: a node others can reach forwards datagrams for peers that cannot be dialled.

A peer behind a NAT that lets nothing in unasked (or maps a new port per destination) holds a
*reservation* with a relay: a ``relay.reserve`` call it keeps open on its connection to the
relay.  Its connection keeps the NAT's mapping towards the relay open, and the relay knows where
to send.  The peer then announces a relayed address (the relay's, then
``/p2p-circuit/p2p/<its PeerID>``).

A dialer asks the relay for a *circuit* to that peer (``relay.connect``) and gets a channel
number.  The relay tells the peer, on its reservation call (if the peer asked, with
``{"circuits": true}``), who opened the circuit and from which address (:class:`CircuitDialers`
keeps that for hole punching, see ``_punch``).  From then on the dialer and the peer exchange
QUIC datagrams through the relay, each prefixed with the channel (see ``_relay_wire``): the
relay forwards between the two addresses its own connections to them use, and only those.  The
QUIC connection inside is end to end: the relay sees ciphertext, and the dialer checks the
peer's key as on any connection.  When that connection ends (closed, failed, abandoned during
its handshake, or given up for a punched hole), the dialer asks the relay to close the circuit
(``relay.close``), freeing its place under the bounds at once.

Bounds (:class:`RelayLimits`): reservations, circuits (in all, per dialer, per host and per IPv6
site) and bytes per second (per circuit, per dialing host and IPv6 site, and in all).  A host is
an IPv4 address or an IPv6 /64 (one machine usually has a whole /64 to pick addresses from); a
site is an IPv6 /48 (a home or a campus picks its /64s in it).  A reservation or circuit beyond
them is refused with :class:`RelayRefused`; datagrams beyond the byte rates are dropped, as a
congested link would, and QUIC's congestion control slows down.  A circuit ends when either end
asks, with either side's connection to the relay, or after ``circuit_idle_s`` without a
datagram.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import secrets
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Final, TypeGuard

import attrs
import trio

from .._errors import (
    CallEnded,
    CodecError,
    ConfigError,
    ConnectionClosed,
    PeerUnreachable,
    RelayRefused,
    RemoteError,
    TransportError,
)
from .._groups import open_block_nursery
from .._ip import places_of
from .._validators import positive, positive_or_none
from ._identity import PeerID
from ._multiaddr import Multiaddr
from ._relay_wire import RELAY_HEADER, Address, split_virtual, virtual_address
from ._rpc import Handlers, ServerCall, call_unary, open_call

if TYPE_CHECKING:
    from ._connection import Connection
    from ._node import Node

__all__ = [
    "CircuitDialers",
    "RELAY_CLOSE",
    "RELAY_CONNECT",
    "RELAY_RESERVE",
    "RelayLimits",
    "RelayService",
    "RelayStatistics",
    "RelayTable",
    "Reservation",
    "close_circuit",
    "hold_reservation",
    "open_relayed_channel",
]

logger = logging.getLogger(__name__)

RELAY_RESERVE = "relay.reserve"
RELAY_CONNECT = "relay.connect"
RELAY_CLOSE = "relay.close"
#: Circuits whose dialers a peer remembers (the oldest are forgotten first).
_MAX_CIRCUITS_KEPT: Final = 1024
#: What each of a connection's places (see ``places_of``) is, in refusals.
_PLACES: Final = ("host", "IPv6 site")


@attrs.frozen(kw_only=True)
class RelayLimits:
    """How much a relay does for others.  Bytes per second None: no bound."""

    #: Peers that may hold a reservation at once, in all and from one host (PeerIDs cost
    #: nothing: one host could otherwise take them all; an IPv6 host is its /64).
    max_reservations: int = attrs.field(default=64, validator=positive)
    max_reservations_per_host: int = attrs.field(default=8, validator=positive)
    #: The same from one IPv6 /48 (a site picks its /64s in it), however many /64s it uses.
    max_reservations_per_site: int = attrs.field(default=16, validator=positive)
    #: Circuits open at once, in all, per dialer and per dialing host.
    max_circuits: int = attrs.field(default=256, validator=positive)
    max_circuits_per_peer: int = attrs.field(default=16, validator=positive)
    max_circuits_per_host: int = attrs.field(default=32, validator=positive)
    max_circuits_per_site: int = attrs.field(default=64, validator=positive)
    #: Bytes forwarded per second on one circuit (both ways together), on all the circuits one
    #: host dialled together (so that one host cannot take the whole budget), on all those of
    #: one IPv6 site (however many /64s it dials from; an IPv4 host is only a host), and in all.
    circuit_bytes_per_s: float | None = attrs.field(default=32 << 20, validator=positive_or_none)
    host_bytes_per_s: float | None = attrs.field(default=32 << 20, validator=positive_or_none)
    site_bytes_per_s: float | None = attrs.field(default=64 << 20, validator=positive_or_none)
    total_bytes_per_s: float | None = attrs.field(default=128 << 20, validator=positive_or_none)
    #: A circuit with no datagram for this long is closed.
    circuit_idle_s: float = attrs.field(default=120.0, validator=positive)


@attrs.frozen(kw_only=True)
class RelayStatistics:
    reservations: int
    circuits: int
    datagrams_relayed: int
    bytes_relayed: int
    #: Datagrams dropped: no such circuit, a stranger's, or beyond a byte rate.
    datagrams_dropped: int


@attrs.define
class _Bucket:
    """A token bucket: ``rate`` bytes per second, up to a quarter second's worth at once."""

    rate: float
    tokens: float
    at: float

    @classmethod
    def full(cls, rate: float, now: float) -> _Bucket:
        return cls(rate, cls._burst(rate), now)

    @staticmethod
    def _burst(rate: float) -> float:
        return max(rate / 4, 256 << 10)

    def refill(self, now: float) -> None:
        self.tokens = min(self._burst(self.rate), self.tokens + (now - self.at) * self.rate)
        self.at = now

    def full_at(self, now: float) -> bool:
        self.refill(now)
        return self.tokens >= self._burst(self.rate)


def _take(buckets: tuple[_Bucket, ...], n: int, now: float) -> bool:
    """Take ``n`` bytes from every bucket, or from none when one lacks them (a datagram
    dropped costs nothing)."""
    for bucket in buckets:
        bucket.refill(now)
        if bucket.tokens < n:
            return False
    for bucket in buckets:
        bucket.tokens -= n
    return True


@attrs.define(eq=False)
class _Circuit:
    channel: int
    dialer: PeerID
    dialer_handle: int
    target: PeerID
    target_handle: int
    last_used: float
    #: The dialing host, and for IPv6 its site (when the circuit opened).
    places: tuple[str, ...]
    #: The byte rates its datagrams take from: its own, its host's (and site's), the relay's.
    buckets: tuple[_Bucket, ...]


class RelayTable:
    """A relay's reservations and circuits, and the forwarding of datagrams (no I/O).

    Connections are known by their handles; ``address_of(handle)`` gives the address a
    connection's peer last proved it receives at (None once it is gone): a peer whose NAT moves
    it to another port keeps its circuits once QUIC has validated the new path, and one
    datagram from elsewhere redirects nothing.
    """

    def __init__(self, limits: RelayLimits, address_of: Callable[[int], Address | None]) -> None:
        self.limits = limits
        self._address_of = address_of
        #: Reservations: peer -> its connection's handle, and the host (and IPv6 site) it was
        #: made from.
        self._reservations: dict[PeerID, tuple[int, tuple[str, ...]]] = {}
        #: The byte buckets of dialing hosts and IPv6 sites: kept after their last circuit
        #: closes until they refill, so that closing and reopening circuits does not refill them.
        self._place_buckets: dict[str, _Bucket] = {}
        self._circuits: dict[int, _Circuit] = {}
        self._total = (
            None
            if limits.total_bytes_per_s is None
            else _Bucket.full(limits.total_bytes_per_s, 0.0)
        )
        self._relayed = 0
        self._relayed_bytes = 0
        self._dropped = 0

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            reservations=len(self._reservations),
            circuits=len(self._circuits),
            datagrams_relayed=self._relayed,
            bytes_relayed=self._relayed_bytes,
            datagrams_dropped=self._dropped,
        )

    def holds(self, peer_id: PeerID, handle: int | None = None) -> bool:
        """Whether a reservation for ``peer_id`` is held (on its connection ``handle``, if
        given: a newer reservation of the same peer replaces an older one)."""
        held = self._reservations.get(peer_id)
        return held is not None and handle in (None, held[0])

    def reserve(self, peer_id: PeerID, handle: int) -> None:
        """Hold a reservation for ``peer_id`` on its connection ``handle`` (a newer one of the
        same peer replaces the old, whose circuits close)."""
        old = self._reservations.get(peer_id, (None, None))[0]
        if old is None and len(self._reservations) >= self.limits.max_reservations:
            raise RelayRefused(
                f"this relay holds {self.limits.max_reservations} reservations, its most"
            )
        places = self._places_of(handle)
        bounds = (self.limits.max_reservations_per_host, self.limits.max_reservations_per_site)
        for place, bound, what in zip(places, bounds, _PLACES, strict=False):
            held = sum(
                place in p for other, (_, p) in self._reservations.items() if other != peer_id
            )
            if held >= bound:
                raise RelayRefused(
                    f"{place} holds {held} reservations here, the most one {what} may hold"
                )
        if old is not None and old != handle:
            self._close_circuits(lambda c: c.target == peer_id)
        self._reservations[peer_id] = (handle, places)

    def release(self, peer_id: PeerID, handle: int) -> None:
        if self.holds(peer_id, handle):
            del self._reservations[peer_id]
            self._close_circuits(lambda c: c.target == peer_id)

    def open_circuit(self, dialer: PeerID, dialer_handle: int, target: PeerID, now: float) -> int:
        """A new circuit from ``dialer`` (on its connection ``dialer_handle``) to ``target``;
        returns its channel.  Raises :class:`RelayRefused` beyond the bounds, or when no
        reservation for ``target`` is held."""
        target_handle = self._reservations.get(target, (None, None))[0]
        if target_handle is None:
            raise RelayRefused(f"this relay holds no reservation for {target}")
        if target == dialer:
            raise RelayRefused("a peer cannot open a circuit to itself")
        self._close_circuits(lambda c: now - c.last_used > self.limits.circuit_idle_s)
        limits = self.limits
        if len(self._circuits) >= limits.max_circuits:
            raise RelayRefused(f"this relay has {limits.max_circuits} circuits open, its most")
        if sum(c.dialer == dialer for c in self._circuits.values()) >= limits.max_circuits_per_peer:
            raise RelayRefused(
                f"{dialer} has {limits.max_circuits_per_peer} circuits open here, the most a peer "
                "may have"
            )
        places = self._places_of(dialer_handle)
        bounds = (limits.max_circuits_per_host, limits.max_circuits_per_site)
        for place, bound, what in zip(places, bounds, _PLACES, strict=False):
            opened = sum(place in c.places for c in self._circuits.values())
            if opened >= bound:
                raise RelayRefused(
                    f"{place} has {opened} circuits open here, the most one {what} may have"
                )
        channel = 0
        while channel == 0 or channel in self._circuits:
            channel = secrets.randbits(32)
        buckets = []
        if limits.circuit_bytes_per_s is not None:
            buckets.append(_Bucket.full(limits.circuit_bytes_per_s, now))
        self._forget_full_buckets(now)
        rates = (limits.host_bytes_per_s, limits.site_bytes_per_s)
        for place, rate in zip(places, rates, strict=False):
            if rate is not None:
                buckets.append(self._place_buckets.setdefault(place, _Bucket.full(rate, now)))
        if self._total is not None:
            buckets.append(self._total)
        self._circuits[channel] = _Circuit(
            channel, dialer, dialer_handle, target, target_handle, now, places, tuple(buckets)
        )
        return channel

    def close_circuit(self, channel: int, peer_id: PeerID, handle: int) -> bool:
        """Close the circuit on ``channel`` as one of its ends (``peer_id`` on its connection
        ``handle``) asks; whether there was one (another's is left as it is)."""
        circuit = self._circuits.get(channel)
        if circuit is None or (peer_id, handle) not in (
            (circuit.dialer, circuit.dialer_handle),
            (circuit.target, circuit.target_handle),
        ):
            return False
        del self._circuits[channel]
        return True

    def connection_lost(self, handle: int) -> None:
        """A connection ended: its reservation and the circuits through it end."""
        for peer_id in [p for p, (h, _) in self._reservations.items() if h == handle]:
            del self._reservations[peer_id]
        self._close_circuits(lambda c: handle in (c.dialer_handle, c.target_handle))

    def forward(self, data: bytes, source: Address, now: float) -> Address | None:
        """Where the relayed datagram ``data`` from ``source`` goes on to, unchanged; None to
        drop it."""
        if len(data) < RELAY_HEADER.size:
            self._dropped += 1
            return None
        _, channel = RELAY_HEADER.unpack_from(data)
        circuit = self._circuits.get(channel)
        if circuit is None:
            self._dropped += 1
            return None
        dialer = self._address_of(circuit.dialer_handle)
        target = self._address_of(circuit.target_handle)
        if source == dialer:
            destination = target
        elif source == target:
            destination = dialer
        else:
            destination = None
        size = len(data)
        if destination is None or not _take(circuit.buckets, size, now):
            self._dropped += 1
            return None
        circuit.last_used = now
        self._relayed += 1
        self._relayed_bytes += size
        return destination

    def _forget_full_buckets(self, now: float) -> None:
        """Drop the buckets of places with no circuit open that have refilled (a new circuit
        from there would start with a full one anyway)."""
        in_use = {place for c in self._circuits.values() for place in c.places}
        for place in [p for p in self._place_buckets if p not in in_use]:
            if self._place_buckets[place].full_at(now):
                del self._place_buckets[place]

    def _places_of(self, handle: int) -> tuple[str, ...]:
        address = self._address_of(handle)
        return () if address is None else places_of(address[0])

    def _close_circuits(self, which: Callable[[_Circuit], bool]) -> None:
        for channel in [ch for ch, c in self._circuits.items() if which(c)]:
            del self._circuits[channel]


def _direct_caller(call: ServerCall) -> Connection:
    connection = call.connection
    if split_virtual(connection.address) is not None:
        raise RelayRefused("a peer reached through a relay cannot use this relay")
    return connection


@attrs.define(eq=False)
class RelayService:
    """The ``relay.*`` handlers of a node that relays for others (see the module)."""

    node: Node
    table: RelayTable
    #: Whether new reservations are taken (a node others cannot dial relays for nobody).
    accepting: bool = True
    # Where to tell each reservation's holder of a new circuit to it.
    _notices: dict[PeerID, trio.MemorySendChannel[dict[str, Any]]] = attrs.field(
        factory=dict, init=False
    )

    @classmethod
    def on(cls, node: Node, limits: RelayLimits | None = None) -> RelayService:
        """Make ``node`` relay (its datagrams with a relay header are forwarded)."""
        return cls(node, node.start_relaying(limits or RelayLimits()))

    def handlers(self) -> Handlers:
        handlers = Handlers()
        handlers.add_stream(RELAY_RESERVE, self._reserve)
        handlers.add_unary(RELAY_CONNECT, self._connect)
        handlers.add_unary(RELAY_CLOSE, self._close)
        return handlers

    async def _reserve(self, call: ServerCall) -> None:
        connection = _direct_caller(call)
        if not self.accepting:
            raise RelayRefused("this node cannot be dialled directly, so it relays for nobody")
        self.table.reserve(call.peer_id, connection._handle)
        notices, pending = trio.open_memory_channel[dict[str, Any]](self.table.limits.max_circuits)
        try:
            reply = {"reserved": True, "observed": str(_observed(connection)), "circuits": True}
            await call.send(reply)
            async with open_block_nursery() as nursery:
                nursery.start_soon(_send_all, call, pending)
                # Held until the peer ends the call or its connection ends.  A peer that asks
                # for them is told of each circuit opened to it.
                async for message in call:
                    if message.get("circuits") is True and self.table.holds(
                        call.peer_id, connection._handle
                    ):
                        self._notices[call.peer_id] = notices
                nursery.cancel_scope.cancel()
        finally:
            self.table.release(call.peer_id, connection._handle)
            if self._notices.get(call.peer_id) is notices:
                del self._notices[call.peer_id]

    async def _connect(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        connection = _direct_caller(call)
        peer = request.get("peer") if isinstance(request, dict) else None
        if not isinstance(peer, str):
            raise CodecError("relay.connect takes {'peer': <PeerID>}")
        try:
            target = PeerID.from_string(peer)
        except ConfigError as exc:
            raise CodecError(f"invalid 'peer': {exc}") from None
        channel = self.table.open_circuit(
            call.peer_id, connection._handle, target, trio.current_time()
        )
        observed = str(_observed(connection))
        notices = self._notices.get(target)
        if notices is not None:
            # Sent before the dialer learns the channel: it arrives ahead of the dialer's
            # handshake, which only then begins.  A peer that does not read them loses them.
            notice = {"circuit": channel, "dialer": str(call.peer_id), "observed": observed}
            with contextlib.suppress(trio.WouldBlock):
                notices.send_nowait(notice)
        return {"channel": channel, "observed": observed}

    async def _close(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        connection = _direct_caller(call)
        channel = request.get("channel") if isinstance(request, dict) else None
        if not isinstance(channel, int) or isinstance(channel, bool):
            raise CodecError("relay.close takes {'channel': <the circuit's channel>}")
        return {"closed": self.table.close_circuit(channel, call.peer_id, connection._handle)}


async def _send_all(call: ServerCall, pending: trio.MemoryReceiveChannel[dict[str, Any]]) -> None:
    """Send the notices as they come; a call that can no longer send ends by itself (its
    receiving side sees why)."""
    try:
        async for message in pending:
            await call.send(message)
    except TransportError as exc:
        logger.debug("no more circuit notices to %s: %r", call.peer_id, exc)


def _observed(connection: Connection) -> Multiaddr:
    return Multiaddr.from_socket_address(*connection.current_address)


@attrs.frozen
class Reservation:
    """A reservation held with a relay: the address to announce, and ours as the relay sees it."""

    address: Multiaddr
    observed: Multiaddr | None


class CircuitDialers:
    """Who opened each circuit to us through the relays we hold reservations with, as those
    relays told us: a relayed connection's virtual address -> the dialer's PeerID and its
    address as the relay saw it (the newest :data:`_MAX_CIRCUITS_KEPT`).  Each circuit's is
    handed out once (:meth:`claim`): one punch per circuit."""

    def __init__(self) -> None:
        # None: claimed already.
        self._dialers: dict[Address, tuple[PeerID, Address] | None] = {}
        self._changed = trio.Event()
        # Relays that said they tell us of circuits, and how many reservations say so.
        self._telling: collections.Counter[Address] = collections.Counter()

    @contextlib.contextmanager
    def told_by(self, relay: Address) -> Iterator[None]:
        """While inside, the relay at ``relay`` tells us of each circuit opened to us."""
        self._telling[relay] += 1
        try:
            yield
        finally:
            self._telling[relay] -= 1
            if self._telling[relay] <= 0:
                del self._telling[relay]

    def told(self, address: Address) -> bool:
        """Whether the relay of the relayed connection at ``address`` tells us of circuits."""
        split = split_virtual(address)
        return split is not None and split[0] in self._telling

    def record(self, relay: Address, channel: int, dialer: PeerID, observed: Address) -> None:
        address = virtual_address(relay, channel)
        self._dialers.pop(address, None)
        self._dialers[address] = (dialer, observed)
        while len(self._dialers) > _MAX_CIRCUITS_KEPT:
            del self._dialers[next(iter(self._dialers))]
        self._changed.set()
        self._changed = trio.Event()

    def forget(self, address: Address) -> None:
        self._dialers.pop(address, None)

    def dialer(self, address: Address) -> tuple[PeerID, Address] | None:
        """What the relay said of the circuit at ``address``, unless unsaid or claimed."""
        return self._dialers.get(address)

    async def claim(self, address: Address, timeout_s: float) -> tuple[PeerID, Address] | None:
        """The dialer of the relayed connection at ``address`` and where its relay saw it,
        once its relay said; None if it has not said within ``timeout_s``, or if this circuit's
        was claimed already."""
        with trio.move_on_after(timeout_s):
            while address not in self._dialers:
                await self._changed.wait()
        dialer = self._dialers.get(address)
        if dialer is not None:
            self._dialers[address] = None
        return dialer


def _refused(exc: RemoteError, relay: Multiaddr) -> PeerUnreachable:
    if exc.remote_type == "RelayRefused":
        return RelayRefused(f"relay {relay} refused: {exc.remote_message}")
    if exc.remote_type == "UnknownMethod":
        return RelayRefused(f"{relay} does not relay")
    return PeerUnreachable(f"relay {relay} failed: {exc}")


def _observed_untrusted(reply: dict[str, Any]) -> Multiaddr | None:
    text = reply.get("observed")
    try:
        return Multiaddr.parse(text) if isinstance(text, str) else None
    except ConfigError:
        return None


async def hold_reservation(
    node: Node,
    relay: Multiaddr | str,
    *,
    task_status: trio.TaskStatus[Reservation] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Hold a reservation with ``relay`` (a multiaddr with its PeerID) for as long as this runs;
    ``task_status.started`` gets the :class:`Reservation` once it is held.  Raises
    :class:`RelayRefused` if the relay refuses, and :class:`PeerUnreachable` (or another
    :class:`TransportError`) when the relay cannot be reached, does not answer the reservation
    within the node's ``connect_timeout_s``, or the reservation is lost."""
    relay = Multiaddr.parse(relay) if isinstance(relay, str) else relay
    if relay.peer_id is None or relay.is_relayed:
        raise ConfigError(f"a relay is given by its direct address with its PeerID, not {relay}")
    answer_timeout_s = node.config.connect_timeout_s
    connection = await node.connect(relay)
    try:
        async with open_call(connection, RELAY_RESERVE) as call:
            await call.send({"circuits": True})
            try:
                # A relay that takes the call and never answers would hold this slot forever,
                # never failing over to another.
                with trio.fail_after(answer_timeout_s):
                    reply = await call.receive()
            except RemoteError as exc:
                raise _refused(exc, relay) from None
            except CallEnded:
                raise PeerUnreachable(f"relay {relay} ended the reservation") from None
            except trio.TooSlowError:
                raise PeerUnreachable(
                    f"relay {relay} did not answer the reservation within {answer_timeout_s:g} s"
                ) from None
            if reply.get("reserved") is not True:
                raise PeerUnreachable(f"relay {relay} answered no reservation: {reply!r:.200}")
            with contextlib.ExitStack() as stack:
                stack.enter_context(node.relayed_through(connection))
                if reply.get("circuits") is True:
                    stack.enter_context(node.circuit_dialers.told_by(connection.current_address))
                task_status.started(
                    Reservation(relay.relayed(node.peer_id), _observed_untrusted(reply))
                )
                try:
                    async for notice in call:
                        _record_circuit_untrusted(node, connection.current_address, notice)
                except RemoteError:
                    raise
                except TransportError as exc:
                    raise PeerUnreachable(f"relay {relay} ended the reservation ({exc})") from exc
                raise PeerUnreachable(f"relay {relay} ended the reservation")
    except RemoteError as exc:
        raise _refused(exc, relay) from None


def _is_channel(value: object) -> TypeGuard[int]:
    """Whether a relay's ``value`` is a circuit's channel (a 32-bit number, never 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32


def _record_circuit_untrusted(node: Node, relay: Address, notice: dict[str, Any]) -> None:
    """Keep what a relay said of a new circuit to us; a notice that makes no sense is dropped
    (the circuit then gets no punched hole)."""
    channel, dialer, observed = (notice.get(k) for k in ("circuit", "dialer", "observed"))
    if not _is_channel(channel):
        return
    try:
        peer_id = PeerID.from_string(dialer) if isinstance(dialer, str) else None
        address = Multiaddr.parse(observed) if isinstance(observed, str) else None
    except ConfigError:
        return
    if peer_id is None or address is None or address.dns is not None or address.is_relayed:
        return
    node.circuit_dialers.record(relay, channel, peer_id, address.socket_address)


async def open_relayed_channel(
    node: Node, address: Multiaddr
) -> tuple[Connection, Address, Multiaddr | None]:
    """Ask the relay of the relayed ``address`` for a circuit to its peer: our connection to
    the relay, the virtual address to dial, and our address as the relay sees it."""
    relay = address.relay_multiaddr
    connection = await node.connect(relay)
    try:
        reply = await _ask_for_circuit(node, connection, {"peer": str(address.peer_id)})
    except RemoteError as exc:
        raise _refused(exc, relay) from None
    except TransportError as exc:
        if isinstance(exc, PeerUnreachable):
            raise
        raise PeerUnreachable(f"relay {relay} opened no circuit ({exc})") from exc
    channel = reply.get("channel")
    if not _is_channel(channel):
        raise PeerUnreachable(f"relay {relay} answered no channel: {reply!r:.200}")
    virtual = virtual_address(connection.current_address, channel)
    return connection, virtual, _observed_untrusted(reply)


async def _ask_for_circuit(node: Node, relay: Connection, request: dict[str, Any]) -> Any:
    """``relay.connect``'s reply to ``request``.  The call runs in the node's own tasks, so that
    a dial cancelled before the reply came (the losing address of ``connect_any``, a caller's
    timeout) still learns the circuit it was given and has it closed at once, instead of
    leaving it to count against its bounds on the relay until it idles."""
    tasks = node._tasks
    if tasks is None or node._closed:
        return await call_unary(relay, RELAY_CONNECT, request)
    outcome: list[Any] = []
    done = trio.Event()
    scope = trio.CancelScope()
    abandoned = False

    async def ask() -> None:
        if abandoned:  # before it began: nothing asked, nothing to close
            done.set()
            return
        try:
            with scope:
                try:
                    outcome.append(await call_unary(relay, RELAY_CONNECT, request))
                except Exception as exc:  # handed to the dialer, which raises it
                    outcome.append(exc)
        finally:
            done.set()
        if abandoned and outcome:
            await _close_granted(relay, outcome[0], node.config.connect_timeout_s)

    tasks.start_soon(ask)
    try:
        await done.wait()
    except BaseException:
        abandoned = True
        # Nobody waits for the reply any more: it gets as long as a dial would have had.
        scope.deadline = trio.current_time() + node.config.connect_timeout_s
        if outcome:  # it came as we were cancelled, after ``ask`` looked
            tasks.start_soon(_close_granted, relay, outcome[0], node.config.connect_timeout_s)
        raise
    if not outcome:
        raise ConnectionClosed("the node was closed while asking the relay for a circuit")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


async def _close_granted(relay: Connection, reply: Any, timeout_s: float) -> None:
    channel = reply.get("channel") if isinstance(reply, dict) else None
    if _is_channel(channel):
        await close_circuit(relay, channel, timeout_s)


async def close_circuit(relay: Connection, channel: int, timeout_s: float) -> None:
    """Ask the relay at the other end of ``relay`` (the connection the circuit was opened on)
    to close the circuit on ``channel``.  Best effort: a relay that cannot be asked, or does
    not know ``relay.close``, closes it when it idles."""
    with trio.move_on_after(timeout_s):
        try:
            await call_unary(relay, RELAY_CLOSE, {"channel": channel})
        except TransportError as exc:
            logger.debug("relay %s did not close circuit %08x: %r", relay.peer_id, channel, exc)
