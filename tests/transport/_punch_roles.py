"""The processes of the hole-punching test, each run inside a host of a NAT topology:
``python -m tests.transport._punch_roles <role> '<json settings>'``.

- ``relay``: a node that relays (with ``max_unproven_handshakes`` if given); prints ``READY <its
  multiaddr>``, and for each line it reads on its stdin ``NO CIRCUITS; RETRIES <n>`` once it
  has no circuit open (``n``: the Retries it sent).
- ``peer``: a node holding a reservation with ``relay`` and serving ``nat.punch`` and a
  ``reverse`` call; prints ``READY <its relayed multiaddr> <its address as the relay sees it>``.
- ``dialer``: dials ``peer`` through its relay, asks it to punch to ``target`` (any address it
  likes); prints ``REPLY <json>`` and then ``PUNCHES <n>`` once ``n`` probes reached it.
- ``dialer_with_a_call``: dials ``peer`` through its relay and starts a ``reverse`` call there;
  punches a hole to the peer at ``direct`` meanwhile and prints ``PUNCHED <direct|relayed>``
  and which connection new work gets, ``NEW WORK <direct|relayed>``; then finishes the call,
  printing ``CALL <the answer>``, and prints ``RELAYED CLOSED`` once the relayed connection is.
- ``listener``: a plain UDP socket at ``port``; prints ``COUNT <datagrams received>`` for each
  line it reads on its stdin.
"""

from __future__ import annotations

import json
import select
import socket
import sys
from typing import Any

import trio

from petals_core.transport import (
    Connection,
    Multiaddr,
    PunchService,
    RelayService,
    ServerCall,
    TransportConfig,
    hold_reservation,
    open_call,
    open_node,
    serve_rpc,
)
from petals_core.transport._punch import _PROBES_AT_S, NAT_PUNCH, punch_hole

from ..dht._swarm import wait_until


async def relay(settings: dict[str, Any]) -> None:
    config = TransportConfig(max_unproven_handshakes=settings.get("max_unproven_handshakes", 32))
    async with (
        open_node(host=settings["host"], config=config) as node,
        trio.open_nursery() as nursery,
    ):
        service = RelayService.on(node)
        await nursery.start(serve_rpc, node, service.handlers())
        print("READY", node.listen_multiaddr, flush=True)
        async for _ in trio.wrap_file(sys.stdin):
            await wait_until(lambda: service.table.statistics().circuits == 0)
            print("NO CIRCUITS; RETRIES", node.statistics().retries_sent, flush=True)


async def peer(settings: dict[str, Any]) -> None:
    async with open_node(host=settings["host"]) as node, trio.open_nursery() as nursery:
        handlers = PunchService(node).handlers()

        @handlers.stream("reverse")
        async def reverse(call: ServerCall) -> None:
            async for message in call:
                await call.send({"chunk": message["chunk"][::-1]})

        await nursery.start(serve_rpc, node, handlers)
        reservation = await nursery.start(hold_reservation, node, settings["relay"])
        print("READY", reservation.address, reservation.observed, flush=True)
        async for line in trio.wrap_file(sys.stdin):
            connection = await node.connect(line.strip())
            print("TOWARDS", _kind(connection), flush=True)


async def dialer(settings: dict[str, Any]) -> None:
    async with open_node(host=settings["host"]) as node:
        print("READY", node.listen_multiaddr, flush=True)
        connection = await node.connect(settings["peer"])
        # The call stays open while the probes come, as a dialer's does while it dials.
        async with open_call(connection, NAT_PUNCH) as call:
            await call.send({"addresses": [settings["target"]]})
            print("REPLY", json.dumps(await call.receive()), flush=True)
            await wait_until(lambda: node.statistics().punches_received >= len(_PROBES_AT_S))
            print("PUNCHES", node.statistics().punches_received, flush=True)
            await trio.sleep_forever()


def _kind(connection: Connection) -> str:
    return "relayed" if connection.is_relayed else "direct"


async def dialer_with_a_call(settings: dict[str, Any]) -> None:
    peer = Multiaddr.parse(settings["peer"])
    direct = Multiaddr.parse(settings["direct"]).with_peer_id(peer.peer_id)
    async with open_node(host=settings["host"]) as node:
        print("READY", node.listen_multiaddr, flush=True)
        relayed = await node.connect(peer)
        async with open_call(relayed, "reverse") as call:
            await call.send({"chunk": "before"})
            assert (await call.receive())["chunk"] == "erofeb"
            punched = await punch_hole(node, relayed, [direct])
            print("PUNCHED", "relayed" if punched is None else _kind(punched), flush=True)
            print("NEW WORK", _kind(await node.connect(peer)), flush=True)
            await trio.wrap_file(sys.stdin).readline()
            await call.send({"chunk": "after"})
            print("CALL", (await call.receive())["chunk"], flush=True)
        await wait_until(lambda: relayed.is_closed)
        print("RELAYED CLOSED", flush=True)
        await trio.sleep_forever()


def listener(settings: dict[str, Any]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((settings["host"], settings["port"]))
        print("READY", flush=True)
        received = 0
        while True:
            ready, _, _ = select.select([sock, sys.stdin], [], [])
            if sock in ready:
                sock.recvfrom(65536)
                received += 1
            if sys.stdin in ready:
                if not sys.stdin.readline():
                    return
                print("COUNT", received, flush=True)


def main() -> None:
    role, settings = sys.argv[1], json.loads(sys.argv[2])
    if role == "listener":
        listener(settings)
    else:
        roles = {
            "relay": relay,
            "peer": peer,
            "dialer": dialer,
            "dialer_with_a_call": dialer_with_a_call,
        }
        trio.run(roles[role], settings)


if __name__ == "__main__":
    main()
