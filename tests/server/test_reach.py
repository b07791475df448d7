"""A server's reach on loopback: the relays it holds behind a NAT, through rechecks and lost relays.

Loopback has no NAT: a peer of the test's says where it sees the server and that it cannot dial
it back there (or, when told, that it can), so that the server takes itself to be behind a cone
NAT.  The relays are real relaying DHT nodes, and the server's reservations and the sessions
through them are real.  Through real NATs see test_nat.py.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing

from petals_core.dht import Reachability
from petals_core.dht._node import DHTNode, open_dht_node
from petals_core.server._reach import Reach
from petals_core.transport import (
    Handlers,
    Identity,
    Multiaddr,
    RelayLimits,
    ServerCall,
    call_unary,
    open_node,
    serve_rpc,
)

DEADLINE_S = 60
#: Where the test's peer says it sees the server (its NAT's public mapping).
MAPPING = Multiaddr("198.51.100.20", 4000)


@attrs.define(eq=False)
class Peer:
    """How the test's peer answers: whether it dials the server back, and whether it answers
    at all (one that does not is a peer gone, or one whose dial-back cannot reach us in time)."""

    reaches_us: bool = False
    answering: bool = True

    def handlers(self) -> Handlers:
        handlers = Handlers()

        @handlers.unary("dht.ping")
        async def ping(request: dict, call: ServerCall) -> dict:
            if not self.answering:
                await trio.sleep_forever()
            return {"peer_id": str(call.peer_id), "observed": str(MAPPING)}

        @handlers.unary("dht.dial_back")
        async def dial_back(request: dict, call: ServerCall) -> dict:
            if self.reaches_us:
                return {"reachable": True}
            return {"reachable": False, "error": "no answer within 2 s"}

        return handlers


@attrs.define(eq=False)
class Changes:
    """The ``on_change`` of a :class:`Reach`: wait until what it changed satisfies a test."""

    _changed: trio.Event = attrs.Factory(trio.Event)

    def __call__(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def until(self, predicate: Callable[[], object]) -> None:
        while not predicate():
            await self._changed.wait()


@attrs.define(eq=False)
class Path:
    """The path from the server to a relay's host at ``target``, on loopback: the server dials
    :attr:`port`.  Once ``cut`` (the host crashed, or its link went down) nothing crosses it, and
    each new dial that arrives (a QUIC long-header packet) is counted, and told to ``on_dial``."""

    target: tuple[str, int]
    on_dial: Callable[[], None]
    cut: bool = False
    dials_after_cut: int = 0
    _front: trio.socket.SocketType = attrs.Factory(
        lambda: trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    )
    _back: trio.socket.SocketType = attrs.Factory(
        lambda: trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    )

    @property
    def port(self) -> int:
        return int(self._front.getsockname()[1])

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Forward between the one peer that sends to :attr:`port` and ``target``."""
        with self._front, self._back:
            await self._front.bind(("127.0.0.1", 0))
            await self._back.bind(("127.0.0.1", 0))
            peer: list[tuple[str, int]] = []

            async def answers() -> None:
                while True:
                    data, _ = await self._back.recvfrom(1 << 16)
                    if not self.cut and peer:
                        await self._front.sendto(data, peer[0])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(answers)
                task_status.started()
                while True:
                    data, sender = await self._front.recvfrom(1 << 16)
                    peer[:] = [sender]
                    if self.cut:
                        if data[0] & 0x80:
                            self.dials_after_cut += 1
                            self.on_dial()
                    else:
                        await self._back.sendto(data, self.target)


@asynccontextmanager
async def behind_a_nat(
    peer: Peer, relays: Callable[[], list[Multiaddr]], *, changes: Changes, **settings: Any
) -> AsyncIterator[tuple[DHTNode, Reach]]:
    """A server's DHT node and its :class:`Reach` (running, with ``settings``, telling
    ``changes``), asking the test's ``peer`` and holding reservations with ``relays``."""
    async with (
        open_node() as helper,
        open_dht_node(host="127.0.0.1", dialable=False) as server,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_rpc, helper, peer.handlers())
        reach = Reach(
            dht=server,
            listen=lambda: [server.listen_multiaddr],
            peers=lambda: [str(helper.listen_multiaddr)],
            relay_candidates=relays,
            on_change=changes,
            timeout_s=2.0,
            recheck_interval_s=3600.0,
            **settings,
        )
        nursery.start_soon(reach.run)
        report = await reach.wait_checked()
        assert report.reachability is Reachability.CONE
        yield server, reach
        nursery.cancel_scope.cancel()


async def test_a_check_no_peer_answers_keeps_the_relays_until_one_finds_the_server_public() -> None:
    """Behind a NAT, a server holds a relay and a client's session goes through it.  A recheck
    no peer answers in time (a saturated uplink, say) tells nothing: the server keeps its relay,
    announces its relayed address first, stays out of others' routing tables, and the session
    lives on.  A check that finds it public drops the relay."""
    peer, changes = Peer(), Changes()
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", relay=RelayLimits()) as relay,
            behind_a_nat(
                peer, lambda: [relay.listen_multiaddr], changes=changes, relays_wanted=1
            ) as (server, reach),
            open_node() as client,
        ):
            assert relay.relay is not None
            await changes.until(lambda: reach.reservations)
            (reservation,) = reach.reservations.values()
            assert reach.addresses()[0] == reservation.address
            session = await client.connect(reservation.address)
            await call_unary(session, "dht.ping", {"client": True})

            peer.answering = False
            report = await reach.check()
            assert report.reachability is Reachability.UNKNOWN
            assert reach.addresses()[0] == reservation.address
            assert MAPPING.with_peer_id(server.peer_id) in reach.addresses()
            assert not server._dialable
            assert reach.reachability is Reachability.CONE
            # Whatever the check set off has run: the relay still holds the reservation, and
            # the session still goes through it.
            await trio.testing.wait_all_tasks_blocked()
            assert reach.reservations == {relay.peer_id: reservation}
            assert relay.relay.table.holds(server.peer_id)
            await call_unary(session, "dht.ping", {"client": True})

            peer.answering, peer.reaches_us = True, True
            report = await reach.check()
            assert report.reachability is Reachability.PUBLIC
            await changes.until(lambda: not reach.reservations)
            assert server._dialable
            assert all(not address.is_relayed for address in reach.addresses())


async def test_a_relay_lost_after_long_service_is_asked_again_only_after_the_others() -> None:
    """A relay that held the server's reservation for longer than ``relay_retry_s`` goes silent
    (its host crashed): the server notices, and turns at once to another candidate, not to the
    lost relay first (dialling it would wait out a connect timeout)."""
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", relay=RelayLimits()) as first,
            open_dht_node(host="127.0.0.1", relay=RelayLimits()) as spare,
            trio.open_nursery() as nursery,
        ):
            changes = Changes()
            path = Path(first.listen_multiaddr.socket_address, on_dial=changes)
            await nursery.start(path.serve)
            lost = Multiaddr("127.0.0.1", path.port).with_peer_id(first.peer_id)
            # The loss is noticed after peer_silence_s (0.5 s) at least: longer than this.
            async with behind_a_nat(
                Peer(),
                lambda: [lost, spare.listen_multiaddr],
                changes=changes,
                relays_wanted=1,
                relay_retry_s=0.1,
            ) as (_, reach):
                await changes.until(lambda: first.peer_id in reach.reservations)
                path.cut = True
                await changes.until(lambda: first.peer_id not in reach.reservations)
                # The next relay asked: the spare, or the lost one again.
                await changes.until(lambda: reach.reservations or path.dials_after_cut)
                assert path.dials_after_cut == 0, "the lost relay was dialled first"
                assert list(reach.reservations) == [spare.peer_id]
            nursery.cancel_scope.cancel()


async def test_a_relay_known_at_two_addresses_holds_one_of_the_reservations() -> None:
    """Two relays wanted; the first candidate is given at two addresses (its IP address and a
    DNS name for it): the server holds one reservation with it and the other with the second
    relay, not both with the first."""
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", relay=RelayLimits()) as first,
            open_dht_node(host="127.0.0.1", relay=RelayLimits()) as second,
        ):
            port = first.listen_multiaddr.port
            by_name = Multiaddr.parse(f"/dns4/localhost/udp/{port}/quic-v1/p2p/{first.peer_id}")
            candidates = [first.listen_multiaddr, by_name, second.listen_multiaddr]
            changes = Changes()
            async with behind_a_nat(
                Peer(), lambda: candidates, changes=changes, relays_wanted=2
            ) as (_, reach):
                await changes.until(lambda: len(reach.reservations) == 2)
                assert set(reach.reservations) == {first.peer_id, second.peer_id}
                relayed = [address for address in reach.addresses() if address.is_relayed]
                assert {address.relay for address in relayed} == {first.peer_id, second.peer_id}


def _reach_among(candidates: list[Multiaddr]) -> Reach:
    """A server's reach (on no network) with these relay candidates, ``relay_retry_s`` 30."""
    node = attrs.make_class("Node", {"peer_id": attrs.field()})(Identity.generate().peer_id)
    return Reach(
        dht=node,
        listen=lambda: [],
        peers=lambda: [],
        relay_candidates=lambda: candidates,
        on_change=lambda: None,
        relay_retry_s=30.0,
    )


def test_a_relay_dropped_lately_goes_back_to_its_place_after_relay_retry_s() -> None:
    """Candidates in the order given, a first and a second.  The first, lost after long service,
    comes after the second for ``relay_retry_s``, then first again; one that failed soon is
    not asked for as long, unless no other is left."""
    clock = trio.testing.MockClock()
    first, second = (
        Multiaddr("127.0.0.1", port).with_peer_id(Identity.generate().peer_id)
        for port in (4001, 4002)
    )

    async def main() -> None:
        reach = _reach_among([first, second])
        assert reach._pick_relay() == first
        reach._retry_later(first, trio.current_time() - 100.0)  # lost after long service
        assert reach._pick_relay() == second
        clock.jump(30.0)
        assert reach._pick_relay() == first
        reach._retry_later(first, trio.current_time())  # failed soon
        assert reach._pick_relay() == second
        reach._in_use.add(second.peer_id)
        assert reach._pick_relay() == first  # no other left: the soonest to be asked again
        reach._in_use.discard(second.peer_id)
        clock.jump(30.0)
        assert reach._pick_relay() == first

    trio.run(main, clock=clock)


def test_a_relay_that_refused_is_not_asked_again_at_its_other_address() -> None:
    """The first relay is known at two addresses.  Refused at one, the server turns to the
    second relay and does not ask the first at its other address for ``relay_retry_s``; not
    reached at one address, it may try the other at once (the path, not the relay, failed)."""
    clock = trio.testing.MockClock()
    relay_id = Identity.generate().peer_id
    at_ip, at_name, second = (
        Multiaddr.parse(f"/ip4/127.0.0.1/udp/4001/quic-v1/p2p/{relay_id}"),
        Multiaddr.parse(f"/dns4/localhost/udp/4001/quic-v1/p2p/{relay_id}"),
        Multiaddr("127.0.0.1", 4002).with_peer_id(Identity.generate().peer_id),
    )

    async def main() -> None:
        reach = _reach_among([at_ip, at_name, second])
        reach._retry_later(at_ip, trio.current_time())  # not reached there
        assert reach._pick_relay() == at_name
        clock.jump(30.0)
        reach._retry_later(at_ip, trio.current_time(), refused=True)
        assert reach._pick_relay() == second
        reach._in_use.add(second.peer_id)
        # No other left: the refusing relay, once it may be asked again.
        assert reach._may_ask_at(at_name) == trio.current_time() + 30.0
        clock.jump(30.0)
        assert reach._pick_relay() in (at_ip, at_name)
        assert reach._may_ask_at(at_name) <= trio.current_time()

    trio.run(main, clock=clock)
