"""The processes of the hole-punching test, each run inside a host of a NAT topology:
``python -m tests.transport._punch_roles <role> '<json settings>'``.

- ``relay``: a node that relays; prints ``READY <its multiaddr>``.
- ``peer``: a node holding a reservation with ``relay`` and serving ``nat.punch``; prints
  ``READY <its relayed multiaddr>``.
- ``dialer``: dials ``peer`` through its relay, asks it to punch to ``target`` (any address it
  likes); prints ``REPLY <json>`` and then ``PUNCHES <n>`` once ``n`` probes reached it.
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
    PunchService,
    RelayService,
    hold_reservation,
    open_call,
    open_node,
    serve_rpc,
)
from petals_core.transport._punch import _PROBES_AT_S, NAT_PUNCH

from ..dht._swarm import wait_until


async def relay(settings: dict[str, Any]) -> None:
    async with open_node(host=settings["host"]) as node, trio.open_nursery() as nursery:
        await nursery.start(serve_rpc, node, RelayService.on(node).handlers())
        print("READY", node.listen_multiaddr, flush=True)
        await trio.sleep_forever()


async def peer(settings: dict[str, Any]) -> None:
    async with open_node(host=settings["host"]) as node, trio.open_nursery() as nursery:
        await nursery.start(serve_rpc, node, PunchService(node).handlers())
        reservation = await nursery.start(hold_reservation, node, settings["relay"])
        print("READY", reservation.address, flush=True)
        await trio.sleep_forever()


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
        trio.run({"relay": relay, "peer": peer, "dialer": dialer}[role], settings)


if __name__ == "__main__":
    main()
