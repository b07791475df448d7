"""Clients run inside a host of a NAT topology (``ip netns exec``), for tests and benchmarks.

:func:`open_host_client` starts a Petals-style generating client there
(``python -m petals_core.demo._remote_client``: the distributed models sit above this package)
and drives it (:class:`HostClient`); :func:`open_host_program` starts any Python program there.

``python -m petals_core.testing._host_client '<json>'``: ``tries`` connections, each from a
fresh node (a new socket: a new mapping in our NAT), to the server ``peer`` of the swarm of
``initial_peers`` and ``dht_prefix``; prints ``DONE <json>``: per try, the seconds it took and
whether it ended direct (a punched hole) or through a relay; with ``pings``, that many
round trips (``dht.ping``) through the relay and through a punched hole, in milliseconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .._local_swarm import SwarmProcess
from ._nat import Host

__all__ = ["HostClient", "open_host_client", "open_host_program", "read_lines"]


@attrs.define(eq=False)
class HostClient:
    """A generating client in a host: ``generate`` runs one generation."""

    process: SwarmProcess

    async def generate(self) -> dict[str, Any]:
        """One generation: ``tokens``, ``connections``, and ``times`` (the seconds since it
        began at which each new token came, for batch 1)."""
        start = len(self.process.output)
        stdin = self.process.process.stdin
        assert stdin is not None
        await stdin.send_all(b"go\n")
        done = await self.process.wait_output("DONE ", start=start)
        report: dict[str, Any] = json.loads(done.removeprefix("DONE "))
        report["times"] = [
            float(line.split()[1])
            for line in self.process.output[start:]
            if line.startswith("TOKEN ")
        ]
        return report


@asynccontextmanager
async def open_host_client(host: Host, settings: dict[str, Any]) -> AsyncIterator[HostClient]:
    """A generating client inside ``host`` (``settings``: see ``petals_core.demo._remote_client``),
    killed when the block ends."""
    argv = ["-m", "petals_core.demo._remote_client", json.dumps(settings)]
    async with open_host_program(host, "client", argv) as process:
        yield HostClient(process)


@asynccontextmanager
async def open_host_program(host: Host, name: str, argv: list[str]) -> AsyncIterator[SwarmProcess]:
    """``python argv...`` inside ``host``, once it printed a line with ``READY``; killed when
    the block ends.  Its output lines (stderr too) are collected as they come."""
    process = await trio.lowlevel.open_process(
        host.command(sys.executable, *argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    started = SwarmProcess(name, process, "", [])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_lines, started)
        try:
            await started.wait_output("READY")
            yield started
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
            nursery.cancel_scope.cancel()


async def read_lines(process: SwarmProcess) -> None:
    """Collect ``process``'s output lines into its ``output`` (waking ``wait_output``)."""
    stdout = process.process.stdout
    assert stdout is not None
    buffer = b""
    async for data in stdout:
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        process.output.extend(raw.decode(errors="replace") for raw in lines)
        process._on_line()
    process._on_line(ended=True)


async def _punch(settings: dict[str, Any]) -> None:
    from petals_core.dht import open_dht_node
    from petals_core.transport import open_node

    async with open_dht_node(
        host="0.0.0.0", initial_peers=settings["initial_peers"], client_mode=True
    ) as dht:
        topic = dht.follow(settings["dht_prefix"], settings["num_blocks"])
        await topic.refresh()
        addresses = topic.addresses_of(settings["peer"])
        tries: list[dict[str, Any]] = []
        for _ in range(settings["tries"]):
            async with open_node(host="0.0.0.0") as node:
                began = time.perf_counter()
                with trio.move_on_after(settings.get("timeout_s", 10.0)):
                    connection = await node.connect_any(addresses)
                    tries.append(
                        {
                            "seconds": time.perf_counter() - began,
                            "direct": connection.relay is None,
                        }
                    )
                    continue
                tries.append({"seconds": None, "direct": False})
        report: dict[str, Any] = {"addresses": [str(a) for a in addresses], "tries": tries}
        if settings.get("pings"):
            report["rtt_ms"] = {
                "relayed": await _round_trips(addresses, settings["pings"], punch=False),
                "direct": await _round_trips(addresses, settings["pings"], punch=True),
            }
        print(f"DONE {json.dumps(report)}")


async def _round_trips(addresses: list[Any], count: int, *, punch: bool) -> list[float]:
    """Milliseconds of ``count`` pings to the peer, through its relay or a punched hole."""
    from petals_core.transport import TransportConfig, call_unary, open_node

    config = TransportConfig(hole_punch_timeout_s=2.0 if punch else None)
    async with open_node(host="0.0.0.0", config=config) as node:
        connection = await node.connect_any(addresses)
        if (connection.relay is None) != punch:
            raise RuntimeError(f"wanted {'direct' if punch else 'relayed'}, got the other")
        rtts = []
        for _ in range(count):
            began = time.perf_counter()
            await call_unary(connection, "dht.ping", {"client": True})
            rtts.append((time.perf_counter() - began) * 1e3)
        return rtts


def main() -> None:
    trio.run(_punch, json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
