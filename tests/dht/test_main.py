"""``python -m petals_core.dht`` as a real process: it announces its address, serves, keeps its
identity across restarts and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from petals_core.dht._node import open_dht_node
from petals_core.transport import Multiaddr

ANNOUNCE = "DHT node listening on "
START_TIMEOUT_S = 30
STOP_TIMEOUT_S = 20


async def _read_announced_address(process: trio.Process) -> Multiaddr:
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(START_TIMEOUT_S):
        while b"\n" not in buffer:
            chunk = await process.stdout.receive_some()
            if not chunk:
                raise AssertionError(f"the node exited before announcing; stdout: {buffer!r}")
            buffer += chunk
    line = buffer.split(b"\n", 1)[0].decode()
    assert line.startswith(ANNOUNCE), line
    return Multiaddr.parse(line[len(ANNOUNCE) :])


@asynccontextmanager
async def running_node(identity_path: Path) -> AsyncIterator[tuple[trio.Process, Multiaddr]]:
    command = [sys.executable, "-m", "petals_core.dht", "--host", "127.0.0.1", "--port", "0"]
    command += ["--identity_path", str(identity_path)]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        yield process, await _read_announced_address(process)
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(STOP_TIMEOUT_S):
                await process.wait()


async def _stop(process: trio.Process) -> int:
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(STOP_TIMEOUT_S):
        return await process.wait()


async def test_standalone_node_serves_keeps_its_identity_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    identity_path = tmp_path / "id.key"
    async with running_node(identity_path) as (process, address):
        assert address.peer_id is not None
        assert stat.S_IMODE(identity_path.stat().st_mode) == 0o600
        with trio.fail_after(START_TIMEOUT_S):
            async with open_dht_node(initial_peers=[str(address)], client_mode=True) as client:
                assert await client.store("key", b"value", time.time() + 60) == 1
            async with open_dht_node(initial_peers=[str(address)], client_mode=True) as other:
                found = await other.get("key")
        assert found is not None and found.entries[None].value == b"value"
        assert await _stop(process) == 0
    first_peer_id = address.peer_id

    async with running_node(identity_path) as (process, address):
        assert address.peer_id == first_peer_id
        assert await _stop(process) == 0


def test_a_node_on_every_interface_prints_the_addresses_others_can_dial() -> None:
    """On a host of its own (a network namespace with one address, 198.51.100.x): listening on
    0.0.0.0, the node prints that address beside loopback, not what the host name resolves to;
    and a node on another host reaches it there."""
    from petals_core.testing import missing_nat_tools, open_topology

    from .._system import missing

    reason = missing_nat_tools()
    if reason is not None:
        missing(f"what NAT tests need ({reason})", "apt-get install -y nftables iproute2")
    with open_topology() as topology:
        boot, other = topology.public("boot"), topology.public("other")
        command = boot.command(sys.executable, "-m", "petals_core.dht", "--host", "0.0.0.0")
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        ) as process:
            try:
                assert process.stdout is not None
                lines = [process.stdout.readline().strip() for _ in range(2)]
                addresses = [Multiaddr.parse(line.removeprefix(ANNOUNCE)) for line in lines]
                assert [a.host for a in addresses] == ["127.0.0.1", boot.address]
                probe = (
                    "import sys, trio\n"
                    "from petals_core.transport import open_node\n"
                    "async def main():\n"
                    "    async with open_node(host='0.0.0.0') as node:\n"
                    "        with trio.fail_after(20):\n"
                    "            connection = await node.connect(sys.argv[1])\n"
                    "        print(connection.peer_id)\n"
                    "trio.run(main)\n"
                )
                reached = subprocess.run(
                    other.command(sys.executable, "-c", probe, str(addresses[1])),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert reached.stdout.strip() == str(addresses[1].peer_id), reached.stderr
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=STOP_TIMEOUT_S)
