"""Relays on loopback: reservations, circuits, end-to-end QUIC through a relay, and the bounds.

Through real NATs (network namespaces) see tests/server/test_nat.py; here three nodes on one
host exercise the protocol and the relay's bookkeeping.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from petals_core import RemoteError
from petals_core._ip import host_of
from petals_core.transport import (
    Connection,
    Handlers,
    Identity,
    IdentityMismatch,
    Multiaddr,
    Node,
    PeerUnreachable,
    PunchService,
    RelayLimits,
    RelayRefused,
    RelayService,
    Reservation,
    ServerCall,
    TransportConfig,
    call_unary,
    hold_reservation,
    open_call,
    open_node,
    serve_rpc,
)
from petals_core.transport._punch import NAT_PUNCH, _unpunchable
from petals_core.transport._relay import (
    RELAY_CLOSE,
    RELAY_CONNECT,
    RELAY_RESERVE,
    CircuitDialers,
    RelayTable,
    open_relayed_channel,
)
from petals_core.transport._relay_wire import RELAY_HEADER, RELAYED, virtual_address

from ..dht._swarm import wait_until

DEADLINE_S = 60


def _peer_handlers() -> Handlers:
    handlers = Handlers()

    @handlers.unary("echo")
    async def echo(request: dict, call: ServerCall) -> dict:
        return {"echo": request, "caller": str(call.peer_id), "relay": str(call.connection.relay)}

    @handlers.stream("reverse")
    async def reverse(call: ServerCall) -> None:
        async for message in call:
            await call.send({"chunk": message["chunk"][::-1]})

    return handlers


@attrs.frozen
class Trio:
    relay: Node
    service: RelayService
    peer: Node
    reservation: Reservation
    dialer: Node


@asynccontextmanager
async def three_nodes() -> AsyncIterator[tuple[Node, Node, Node, trio.Nursery]]:
    """A relay, a peer and a dialer (nothing served yet), and a nursery to serve them in."""
    async with (
        open_node() as relay,
        open_node() as peer,
        open_node() as dialer,
        trio.open_nursery() as nursery,
    ):
        yield relay, peer, dialer, nursery


@asynccontextmanager
async def relayed(limits: RelayLimits | None = None) -> AsyncIterator[Trio]:
    """A relay, a peer holding a reservation there (serving echo, reverse and ``nat.punch``),
    and a dialer."""
    async with three_nodes() as (relay, peer, dialer, nursery):
        service = RelayService.on(relay, limits)
        await nursery.start(serve_rpc, relay, service.handlers())
        handlers = _peer_handlers()
        handlers.include(PunchService(peer).handlers())
        await nursery.start(serve_rpc, peer, handlers)
        reservation = await nursery.start(hold_reservation, peer, relay.listen_multiaddr)
        try:
            yield Trio(relay, service, peer, reservation, dialer)
        finally:
            nursery.cancel_scope.cancel()


async def test_a_peer_is_reached_through_its_relay_end_to_end() -> None:
    with trio.fail_after(DEADLINE_S):
        async with relayed() as t:
            address = t.reservation.address
            assert address.is_relayed and address.peer_id == t.peer.peer_id
            assert address.relay == t.relay.peer_id
            assert str(address) == (f"{t.relay.listen_multiaddr}/p2p-circuit/p2p/{t.peer.peer_id}")
            assert Multiaddr.parse(str(address)) == address
            # The relay tells the peer where it sees it from.
            assert t.reservation.observed == Multiaddr.from_socket_address(
                *t.peer.listen_multiaddr.socket_address
            )

            connection = await t.dialer.connect(address)
            assert connection.peer_id == t.peer.peer_id
            assert connection.relay == t.relay.peer_id
            assert connection.multiaddr == address
            reply = await call_unary(connection, "echo", {"x": 1})
            assert reply == {
                "echo": {"x": 1},
                "caller": str(t.dialer.peer_id),
                "relay": str(t.relay.peer_id),
            }

            # A few MiB each way, end to end through the relay.
            async with open_call(connection, "reverse") as call:
                for i in range(20):
                    chunk = hashlib.sha256(bytes([i])).digest() * 3125
                    await call.send({"chunk": chunk})
                    assert (await call.receive())["chunk"] == chunk[::-1]
            stats = t.service.table.statistics()
            assert stats.reservations == 1 and stats.circuits == 1
            assert stats.bytes_relayed > 2 * 20 * 100_000
            # Nothing was dropped on the way.
            assert stats.datagrams_dropped == 0


async def test_the_relay_names_each_circuits_dialer_and_the_peer_punches_only_there() -> None:
    """The relay tells the peer who opened a circuit and from where; ``nat.punch`` aims at that
    address whatever the caller names (here the relay saw loopback, where no hole is punched,
    so the peer refuses rather than probe the stranger's address the caller asks for)."""
    with trio.fail_after(DEADLINE_S):
        async with relayed() as t:
            connection = await t.dialer.connect(t.reservation.address)
            await wait_until(lambda: _connections_to(t.peer, t.dialer) != [])
            (at_peer,) = _connections_to(t.peer, t.dialer)
            dialers = t.peer.circuit_dialers
            await wait_until(lambda: dialers.dialer(at_peer.address) is not None)
            dialer = dialers.dialer(at_peer.address)
            assert dialer == (t.dialer.peer_id, t.dialer.listen_multiaddr.socket_address)
            elsewhere = str(Multiaddr("198.51.100.7", 4001))
            reply = await _ask_punch(connection, {"addresses": [elsewhere]})
            assert reply == {
                "punching": False,
                "reason": "no hole to punch to a loopback address (127.0.0.1)",
            }
            # One punch per circuit: asked again, the peer refuses.
            reply = await _ask_punch(connection, {})
            assert reply["reason"] == (
                "the relay named no dialer for this circuit, or it had its punch"
            )
            # Asked directly, not through a relay: refused.
            async with open_node() as neighbour:
                direct = await neighbour.connect(t.peer.listen_multiaddr)
                with pytest.raises(RemoteError, match=r"nat\.punch is asked through a relay"):
                    await _ask_punch(direct, {})


def _connections_to(node: Node, peer: Node) -> list[Connection]:
    return [c for c in node.connections if c.peer_id == peer.peer_id]


async def _ask_punch(connection: Connection, request: dict[str, object]) -> dict[str, object]:
    async with open_call(connection, NAT_PUNCH) as call:
        await call.send(request)
        return await call.receive()


def test_probes_go_to_unicast_addresses_only() -> None:
    assert _unpunchable("198.51.100.7") is None
    assert _unpunchable("2001:db8::7") is None
    for host, kind in [
        ("127.0.0.1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("224.0.0.251", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("255.255.255.255", "reserved"),
    ]:
        assert _unpunchable(host) == f"no hole to punch to a {kind} address ({host})"


async def test_circuit_dialers_keep_the_newest_and_hand_each_out_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dialers = CircuitDialers()
    relay, dialer = ("198.51.100.1", 4001), Identity.generate().peer_id
    for channel in range(1, 1026):
        dialers.record(relay, channel, dialer, ("192.0.2.5", channel))
    first, second, last = (virtual_address(relay, channel) for channel in (1, 2, 1025))
    # The oldest of 1025 is forgotten; the others are known at once, and handed out once.
    assert await dialers.claim(first, 5.0) is None
    assert dialers.dialer(last) == (dialer, ("192.0.2.5", 1025))
    assert await dialers.claim(last, 0.0) == (dialer, ("192.0.2.5", 1025))
    assert await dialers.claim(last, 5.0) is None and dialers.dialer(last) is None
    # One not yet named is waited for until the relay names it.
    async with trio.open_nursery() as nursery:
        began = trio.current_time()

        async def name_it_later() -> None:
            await trio.sleep(1.0)
            dialers.record(relay, 1, dialer, ("192.0.2.5", 9))

        nursery.start_soon(name_it_later)
        assert await dialers.claim(first, 5.0) == (dialer, ("192.0.2.5", 9))
        assert trio.current_time() - began == pytest.approx(1.0)
    dialers.forget(second)
    assert await dialers.claim(second, 0.0) is None
    # Whether a relayed connection's relay tells of circuits.
    assert not dialers.told(first)
    with dialers.told_by(relay), dialers.told_by(relay):
        assert dialers.told(first) and not dialers.told(relay)
    assert not dialers.told(first)


async def test_a_peer_that_does_not_ask_is_told_of_no_circuit_and_keeps_its_reservation() -> None:
    """A peer holding its reservation as before circuit notices existed (it never asks for
    them) gets nothing on its reservation call, which any message would end; the dialer still
    learns where the relay sees it, which such a peer punches to."""
    with trio.fail_after(DEADLINE_S):
        async with three_nodes() as (relay, peer, dialer, nursery):
            await nursery.start(serve_rpc, relay, RelayService.on(relay).handlers())
            await nursery.start(serve_rpc, peer, _peer_handlers())
            to_relay = await peer.connect(relay.listen_multiaddr)
            async with open_call(to_relay, RELAY_RESERVE) as call:
                reply = await call.receive()
                assert reply["reserved"] is True and reply["circuits"] is True
                with peer.relayed_through(to_relay):
                    address = relay.listen_multiaddr.relayed(peer.peer_id)
                    _, _, observed = await open_relayed_channel(dialer, address)
                    assert observed == dialer.listen_multiaddr.with_peer_id(None)
                    connection = await dialer.connect(address)
                    assert (await call_unary(connection, "echo", {}))["caller"] == str(
                        dialer.peer_id
                    )
                    # Our side ends: whatever the relay sent on the call comes before its end.
                    await call.send_eof()
                    assert [message async for message in call] == []
            nursery.cancel_scope.cancel()


async def test_the_relay_cannot_impersonate_the_peer() -> None:
    """A relayed address that names another PeerID than the one behind the channel fails the
    handshake's identity check: the relay forwards, it does not vouch."""
    with trio.fail_after(DEADLINE_S):
        async with relayed() as t:
            stranger = Identity.generate().peer_id
            # A reservation for the stranger does not exist: the relay refuses.
            with pytest.raises(RelayRefused, match="holds no reservation for"):
                await t.dialer.connect(t.relay.listen_multiaddr.relayed(stranger))
            # The relay forwards to the peer, but the dialer expects another key.
            table = t.service.table
            table.reserve(stranger, table._reservations[t.peer.peer_id][0])
            with pytest.raises(IdentityMismatch):
                await t.dialer.connect(t.relay.listen_multiaddr.relayed(stranger))


async def test_bounds_are_refused_with_a_clear_error_and_nothing_else_is_disturbed() -> None:
    limits = RelayLimits(max_reservations=1, max_circuits=4, max_circuits_per_peer=1)
    with trio.fail_after(DEADLINE_S):
        async with relayed(limits) as t, open_node() as other:
            first = await t.dialer.connect(t.reservation.address)
            # A second reservation is beyond the relay's bound.
            with pytest.raises(RelayRefused, match="holds 1 reservations, its most"):
                await hold_reservation(other, t.relay.listen_multiaddr)
            # The dialer's second circuit is beyond the per-peer bound.
            with pytest.raises(RelayRefused, match="circuits open here, the most a peer may have"):
                await open_relayed_channel(t.dialer, t.reservation.address)
            assert (await call_unary(first, "echo", {"x": 1}))["echo"] == {"x": 1}
            # Bad requests: no PeerID, a malformed one; the relay answers and goes on.
            relay_connection = await other.connect(t.relay.listen_multiaddr)
            for request, match in (({}, "takes"), ({"peer": "Qm-nope"}, "invalid 'peer'")):
                with pytest.raises(Exception, match=match):
                    await call_unary(relay_connection, "relay.connect", request)
            # Another dialer still gets through, and the reservation still works.
            async with open_node() as third:
                connection = await third.connect(t.reservation.address)
                assert (await call_unary(connection, "echo", {"y": 2}))["echo"] == {"y": 2}
            assert t.service.table.statistics().reservations == 1


async def test_a_relayed_connection_that_ends_frees_its_circuit_at_once() -> None:
    """A dialer may hold two circuits at this relay; its relayed connections end (closed, or
    failed in the handshake) and their circuits close on the relay at once, not after
    ``circuit_idle_s``: it dials through the relay many times more than that, each dial
    working.  Only an end of a circuit closes it."""
    limits = RelayLimits(max_circuits_per_peer=2)
    with trio.fail_after(DEADLINE_S):
        async with relayed(limits) as t:
            table = t.service.table
            stranger = Identity.generate().peer_id
            table.reserve(stranger, table._reservations[t.peer.peer_id][0])
            for attempt in range(3 * limits.max_circuits_per_peer):
                connection = await t.dialer.connect(t.reservation.address)
                assert (await call_unary(connection, "echo", {"n": attempt}))["echo"] == {
                    "n": attempt
                }
                assert table.statistics().circuits == 1
                await connection.aclose()
                await wait_until(lambda: table.statistics().circuits == 0)
                # The relay forwards to the peer, which proves another key: the dial fails.
                with pytest.raises(IdentityMismatch):
                    await t.dialer.connect(t.relay.listen_multiaddr.relayed(stranger))
                await wait_until(lambda: table.statistics().circuits == 0)
            # Asked by neither end of the circuit, or for no circuit, the relay closes nothing.
            connection = await t.dialer.connect(t.reservation.address)
            (channel,) = table._circuits
            async with open_node() as other:
                to_relay = await other.connect(t.relay.listen_multiaddr)
                reply = await call_unary(to_relay, RELAY_CLOSE, {"channel": channel})
                assert reply == {"closed": False}
                with pytest.raises(RemoteError, match=r"relay\.close takes"):
                    await call_unary(to_relay, RELAY_CLOSE, {"channel": "1"})
            assert table.statistics().circuits == 1
            assert (await call_unary(connection, "echo", {}))["echo"] == {}


async def test_a_dial_cancelled_while_the_relay_answers_still_frees_its_circuit() -> None:
    """The relay opens the circuit, but its answer reaches a dialer that gave up meanwhile (a
    timeout, the losing address of ``connect_any``): the circuit it was given is closed at once,
    and the dialer's next dial through the relay, at one circuit per dialer, gets through."""
    limits = RelayLimits(max_circuits_per_peer=1)
    with trio.fail_after(DEADLINE_S):
        async with three_nodes() as (relay, peer, dialer, nursery):
            service = RelayService.on(relay, limits)
            handlers = service.handlers()
            found = handlers.lookup(RELAY_CONNECT)
            assert found is not None
            open_circuit = found[1]
            answer = trio.Event()

            async def answer_late(request: dict, call: ServerCall) -> dict:
                reply = await open_circuit(request, call)
                await answer.wait()
                return reply

            handlers.add_unary(RELAY_CONNECT, answer_late)
            await nursery.start(serve_rpc, relay, handlers)
            await nursery.start(serve_rpc, peer, _peer_handlers())
            reservation = await nursery.start(hold_reservation, peer, relay.listen_multiaddr)
            table = service.table
            async with trio.open_nursery() as dialing:
                dialing.start_soon(dialer.connect, reservation.address)
                await wait_until(lambda: table.statistics().circuits == 1)
                dialing.cancel_scope.cancel()
            answer.set()
            await wait_until(lambda: table.statistics().circuits == 0)
            connection = await dialer.connect(reservation.address)
            assert (await call_unary(connection, "echo", {"n": 1}))["echo"] == {"n": 1}
            nursery.cancel_scope.cancel()


async def test_a_reservation_ends_with_the_relay_and_dialers_see_it() -> None:
    with trio.fail_after(DEADLINE_S):
        async with three_nodes() as (relay, peer, dialer, nursery):
            service = RelayService.on(relay)
            relay_scope = trio.CancelScope()

            async def serve_relay(task_status: trio.TaskStatus[None]) -> None:
                with relay_scope:
                    await serve_rpc(relay, service.handlers(), task_status=task_status)

            await nursery.start(serve_relay)
            await nursery.start(serve_rpc, peer, _peer_handlers())
            failures: list[BaseException] = []
            failed = trio.Event()

            async def hold(task_status: trio.TaskStatus[Reservation]) -> None:
                try:
                    await hold_reservation(peer, relay.listen_multiaddr, task_status=task_status)
                except PeerUnreachable as exc:
                    failures.append(exc)
                    failed.set()

            reservation = await nursery.start(hold)
            await call_unary(await dialer.connect(reservation.address), "echo", {})
            # The relay stops serving: the reservation call is cancelled on both sides.
            relay_scope.cancel()
            await failed.wait()
            assert "ended the reservation" in str(failures[0])
            assert service.table.statistics().reservations == 0
            with pytest.raises(PeerUnreachable):
                await dialer.connect(relay.listen_multiaddr.relayed(Identity.generate().peer_id))
            nursery.cancel_scope.cancel()


async def test_a_relay_that_never_answers_the_reservation_fails_it_in_time() -> None:
    """A relay that completes the handshake and takes the reservation call but never answers:
    the reservation fails within the connect timeout, as one refused does, instead of waiting
    for ever (a server would then never turn to another relay)."""
    config = TransportConfig(connect_timeout_s=1.0)
    with trio.fail_after(DEADLINE_S):
        async with (
            open_node() as relay,
            open_node(config=config) as peer,
            trio.open_nursery() as nursery,
        ):
            taken = trio.Event()
            handlers = Handlers()

            @handlers.stream(RELAY_RESERVE)
            async def never_answers(call: ServerCall) -> None:
                taken.set()
                await trio.sleep_forever()

            await nursery.start(serve_rpc, relay, handlers)
            with pytest.raises(PeerUnreachable, match="did not answer the reservation within 1 s"):
                await hold_reservation(peer, relay.listen_multiaddr)
            assert taken.is_set()
            nursery.cancel_scope.cancel()


def test_the_table_forwards_only_between_a_circuits_two_ends() -> None:
    addresses = {1: ("198.51.100.2", 4000), 2: ("198.51.100.3", 5000)}
    table = RelayTable(RelayLimits(circuit_bytes_per_s=1 << 20), addresses.get)
    dialer, target = Identity.generate().peer_id, Identity.generate().peer_id
    table.reserve(target, 2)
    assert table.holds(target) and table.holds(target, 2)
    assert not table.holds(target, 1) and not table.holds(dialer)
    channel = table.open_circuit(dialer, 1, target, now=0.0)
    datagram = RELAY_HEADER.pack(RELAYED, channel) + b"x" * 1000
    assert table.forward(datagram, addresses[1], 0.0) == addresses[2]
    assert table.forward(datagram, addresses[2], 0.0) == addresses[1]
    # A stranger, an unknown channel, a runt: dropped.
    assert table.forward(datagram, ("198.51.100.9", 4000), 0.0) is None
    assert table.forward(RELAY_HEADER.pack(RELAYED, channel ^ 1) + b"x", addresses[1], 0.0) is None
    assert table.forward(b"\x00\x01", addresses[1], 0.0) is None
    assert table.statistics().datagrams_dropped == 3
    # Beyond the circuit's byte rate (a quarter second's burst), datagrams are dropped; a
    # second later there is room again.
    sent = sum(table.forward(datagram, addresses[1], 0.5) is not None for _ in range(400))
    assert 200 < sent < 300
    assert table.forward(datagram, addresses[1], 1.5) == addresses[2]
    # The NAT moved the dialer to another port: the circuit follows its connection.
    addresses[1] = ("198.51.100.2", 4001)
    assert table.forward(datagram, ("198.51.100.2", 4001), 1.5) == addresses[2]
    # Losing either connection ends the circuit.
    table.connection_lost(2)
    assert table.forward(datagram, addresses[1], 1.5) is None
    assert table.statistics().circuits == 0 and table.statistics().reservations == 0


async def test_a_relay_forwards_only_to_where_its_peer_proved_it_receives() -> None:
    """One datagram of a dialer's relay connection arrives from another host's address (what
    one spoofed datagram does): QUIC moves the connection there, unproven.  The relay keeps
    forwarding the circuit to the address the dialer proved, not to the spoofed one (QUIC itself
    sends an unproven address at most three times what came from it; a relay forwarding a
    circuit there would aim the other end's traffic at any host)."""
    victim = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    victim.bind(("127.0.0.1", 0))
    victim.setblocking(False)
    with victim, trio.fail_after(DEADLINE_S):
        async with relayed() as trio_:
            relay, dialer = trio_.relay, trio_.dialer
            connection, virtual, _ = await open_relayed_channel(dialer, trio_.reservation.address)
            channel = int(virtual[0][6:14], 16)
            relay_address = relay.listen_multiaddr.socket_address
            # The dialer's datagrams from now leave from the victim's socket (a spoofer's).
            dialer._udp.send = lambda outbox: outbox.clear()  # type: ignore[method-assign]
            quic = dialer._endpoint._by_handle[connection._handle].quic
            quic.send_ping(7)
            for data, _ in quic.datagrams_to_send(now=trio.current_time()):
                victim.sendto(data, relay_address)
            (on_relay,) = [c for c in relay.connections if c.peer_id == dialer.peer_id]
            await wait_until(lambda: on_relay.current_address == victim.getsockname())
            # The peer's end of the circuit sends 300 datagrams towards the dialer.
            payload = RELAY_HEADER.pack(RELAYED, channel) + b"x" * 1300
            before = trio_.service.table.statistics().datagrams_relayed
            for _ in range(300):
                trio_.peer._udp.sock.sendto(payload, relay_address)
            await wait_until(
                lambda: trio_.service.table.statistics().datagrams_relayed >= before + 300
            )
            relayed_to_victim = 0
            with contextlib.suppress(BlockingIOError):
                while True:
                    data = victim.recv(65536)
                    relayed_to_victim += data[:1] == b"\x00"
            assert relayed_to_victim == 0


def test_one_host_cannot_take_every_reservation_or_circuit() -> None:
    """PeerIDs cost nothing: one host, under as many of them as it likes, may hold only its share
    of reservations and dial only its share of circuits; other hosts are served as before."""
    limits = RelayLimits(max_reservations_per_host=2, max_circuits_per_host=3)
    addresses = {handle: ("198.51.100.2", 4000 + handle) for handle in range(1, 10)}
    addresses[10] = ("203.0.113.5", 4000)
    table = RelayTable(limits, addresses.get)
    peers = [Identity.generate().peer_id for _ in range(10)]
    table.reserve(peers[0], 1)
    table.reserve(peers[1], 2)
    table.reserve(peers[0], 1)  # renewing its own is no new reservation
    with pytest.raises(RelayRefused, match=r"198\.51\.100\.2 holds 2 reservations here"):
        table.reserve(peers[2], 3)
    table.reserve(peers[9], 10)  # another host
    for index, handle in enumerate((4, 5, 6)):
        table.open_circuit(peers[3 + index], handle, peers[9], now=0.0)
    with pytest.raises(RelayRefused, match=r"198\.51\.100\.2 has 3 circuits open here"):
        table.open_circuit(peers[8], 7, peers[9], now=0.0)
    table.open_circuit(peers[9], 10, peers[0], now=0.0)  # another host dials on
    assert table.statistics().circuits == 4 and table.statistics().reservations == 3


def test_an_ipv6_host_is_its_64() -> None:
    assert host_of("2001:db8:1:2::7") == host_of("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert host_of("2001:db8:1:3::7") != host_of("2001:db8:1:2::7")
    assert host_of("::ffff:198.51.100.2") == host_of("198.51.100.2") == "198.51.100.2"
    assert host_of("fe80::1%eth0") == "fe80::/64"


@pytest.mark.parametrize(
    ("limits", "address", "place", "what"),
    [
        (
            RelayLimits(max_reservations_per_host=2, max_circuits_per_host=2),
            "2001:db8:1:2::{:x}",
            "2001:db8:1:2::/64",
            "host",
        ),
        (
            RelayLimits(max_reservations_per_site=2, max_circuits_per_site=2),
            "2001:db8:1:{:x}::1",
            "2001:db8:1::/48",
            "IPv6 site",
        ),
    ],
    ids=["a host's /64", "a site's /48"],
)
def test_an_ipv6_host_or_site_cannot_dodge_its_bounds_with_new_addresses(
    limits: RelayLimits, address: str, place: str, what: str
) -> None:
    """A machine usually has a whole IPv6 /64 to pick source addresses from, and a home or a
    campus a whole /48 of /64s: the bounds per host count the /64, and those per site the /48,
    so new addresses in them buy no more reservations or circuits.  Another site is served."""
    addresses = {handle: (address.format(handle), 4000) for handle in range(1, 8)}
    addresses[8] = ("2001:db8:9:9::1", 4000)
    table = RelayTable(limits, addresses.get)
    peers = [Identity.generate().peer_id for _ in range(8)]
    table.reserve(peers[0], 1)
    table.reserve(peers[1], 2)
    with pytest.raises(RelayRefused, match=f"{place} holds 2 reservations here.* one {what} "):
        table.reserve(peers[2], 3)
    table.reserve(peers[7], 8)
    table.open_circuit(peers[3], 4, peers[7], now=0.0)
    table.open_circuit(peers[4], 5, peers[7], now=0.0)
    with pytest.raises(RelayRefused, match=f"{place} has 2 circuits open here.* one {what} "):
        table.open_circuit(peers[5], 6, peers[7], now=0.0)
    table.open_circuit(peers[7], 8, peers[0], now=0.0)  # another site dials on
    assert table.statistics().circuits == 3 and table.statistics().reservations == 3


_RATE = 1 << 20


@pytest.mark.parametrize(
    ("limits", "hosts", "other"),
    [
        (  # four circuits from one IPv4 host
            RelayLimits(circuit_bytes_per_s=_RATE, host_bytes_per_s=_RATE, total_bytes_per_s=None),
            ["198.51.100.2"] * 4,
            "203.0.113.5",
        ),
        (  # four /64s of one /48 (the hosts' rates off)
            RelayLimits(
                circuit_bytes_per_s=_RATE,
                host_bytes_per_s=None,
                site_bytes_per_s=_RATE,
                total_bytes_per_s=None,
            ),
            [f"2001:db8:7:{n}::2" for n in range(4)],
            "2001:db8:8::2",
        ),
    ],
    ids=["host", "ipv6-site"],
)
def test_one_host_cannot_take_the_relays_whole_byte_budget(
    limits: RelayLimits, hosts: list[str], other: str
) -> None:
    """The circuits one host (or IPv6 site) dialled share one byte rate: many circuits from it
    forward no more than one, and another's circuit still gets its own rate."""
    addresses = {handle: (host, 4000 + handle) for handle, host in enumerate(hosts, start=1)}
    addresses[5] = (other, 4000)
    addresses[6] = ("192.0.2.7", 4000)
    table = RelayTable(limits, addresses.get)
    target, other = Identity.generate().peer_id, Identity.generate().peer_id
    table.reserve(target, 6)
    table_dialers = {}
    for handle in range(1, 5):
        dialer = Identity.generate().peer_id
        table_dialers[table.open_circuit(dialer, handle, target, now=0.0)] = dialer
    channels = list(table_dialers)
    other_channel = table.open_circuit(other, 5, target, now=0.0)
    payload = b"x" * 1000

    def sent(channel: int, handle: int, count: int) -> int:
        datagram = RELAY_HEADER.pack(RELAYED, channel) + payload
        return sum(
            table.forward(datagram, addresses[handle], 0.0) is not None for _ in range(count)
        )

    # A quarter second's burst of one rate, over all four circuits of the one host together.
    from_host = sum(
        sent(channel, handle, 400) for channel, handle in zip(channels, range(1, 5), strict=True)
    )
    assert 200 < from_host < 300
    assert 200 < sent(other_channel, 5, 400) < 300
    # Closing its circuits and opening new ones does not refill the host's rate.
    for channel, handle in zip(channels, range(1, 5), strict=True):
        assert table.close_circuit(channel, table_dialers[channel], handle)
    again = table.open_circuit(Identity.generate().peer_id, 1, target, now=0.0)
    assert sent(again, 1, 10) == 0


def test_a_datagram_dropped_for_one_rate_costs_the_others_nothing() -> None:
    """A datagram beyond the relay's total rate is dropped without taking from its circuit's
    rate: when the relay is busy, a circuit's share does not drain on datagrams it never sent."""
    rate = 1 << 20
    limits = RelayLimits(
        circuit_bytes_per_s=rate, host_bytes_per_s=None, total_bytes_per_s=4 * rate
    )
    addresses = {handle: (f"198.51.100.{handle}", 4000) for handle in range(1, 6)}
    addresses[9] = ("203.0.113.5", 4000)
    table = RelayTable(limits, addresses.get)
    target = Identity.generate().peer_id
    table.reserve(target, 9)
    channels = [
        table.open_circuit(Identity.generate().peer_id, handle, target, now=0.0)
        for handle in range(1, 6)
    ]

    def sent(index: int, count: int, now: float) -> int:
        datagram = RELAY_HEADER.pack(RELAYED, channels[index]) + b"x" * 1000
        address = addresses[index + 1]
        return sum(table.forward(datagram, address, now) is not None for _ in range(count))

    # Four circuits take the whole total's burst, each its own quarter second's worth; the
    # fifth's datagrams are dropped, but for the few the total had left.
    assert all(200 < sent(index, 400, 0.0) < 300 for index in range(4))
    assert sent(4, 400, 0.0) < 10
    # A tenth of a second later the total has room for about 400 datagrams again, and the
    # fifth circuit its whole burst: the datagrams dropped took nothing from it (else it would
    # have only a tenth of a second's rate, about 100).
    assert 200 < sent(4, 400, 0.1) < 300
