"""A swarm of real processes on loopback: one bootstrap DHT node and servers, for the demo, tests
and benchmarks (``petals_core.testing`` offers it to them).

Each process is started with the package's own commands (``python -m petals_core.dht`` and
``python -m petals_core.server``) with one torch thread, and is ready once it prints the line
naming its address.  Everything started is stopped when the block ends, also on errors and
cancellation: SIGTERM, then SIGKILL for whatever has not exited within ``stop_timeout_s``.

A process may also run elsewhere than on loopback: at a :class:`Placement`, e.g. a host of a
``petals_core.testing.Topology`` (inside its network namespace).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Final, Protocol

import attrs
import trio

from ._groups import raising_single_error

__all__ = ["LocalSwarm", "Placement", "SwarmProcess", "fixed_server_args", "open_local_swarm"]

DHT_READY: Final = "DHT node listening on "
SERVER_READY: Final = "Server listening on "


class Placement(Protocol):
    """Where a process runs instead of loopback: the address it listens on there, and the
    command that runs ``argv`` there."""

    @property
    def address(self) -> str: ...

    def command(self, *argv: str) -> list[str]: ...


def fixed_server_args(span: tuple[int, int], **flags: object) -> list[str]:
    """Flags of a server with fixed blocks ``span``, fp32 on the CPU with one torch thread, and a
    given throughput (nothing measured); each of ``flags`` adds ``--name value``."""
    args = [
        "--block_indices",
        f"{span[0]}:{span[1]}",
        "--throughput",
        "1",
        "--torch_dtype",
        "float32",
        "--device",
        "cpu",
        "--num_threads",
        "1",
    ]
    for name, value in flags.items():
        args += [f"--{name}", str(value)]
    return args


@attrs.define(eq=False)
class SwarmProcess:
    """One process of the swarm; ``address`` is the multiaddr it printed."""

    name: str
    process: trio.Process
    address: str
    output: list[str]
    _line: trio.Event = attrs.Factory(trio.Event)
    _ended: bool = False

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    async def wait_output(self, text: str, *, start: int = 0) -> str:
        """The first line of its output (from line ``start`` on) that contains ``text``, once
        one does; ``RuntimeError`` if the process ends first."""
        while True:
            for line in self.output[start:]:
                if text in line:
                    return line
            if self._ended:
                raise RuntimeError(
                    f"{self.name} ended its output without printing {text!r}:\n"
                    + "\n".join(self.output[-30:])
                )
            await self._line.wait()

    def _on_line(self, *, ended: bool = False) -> None:
        self._ended = self._ended or ended
        self._line.set()
        self._line = trio.Event()

    def kill(self) -> None:
        """SIGKILL: it dies at once, announcing nothing (a crash, as far as peers can tell)."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)

    async def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL after ``timeout_s``.  Returns the exit code."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(timeout_s):
            return await self.process.wait()
        self.process.kill()
        return await self.process.wait()


@attrs.define(eq=False)
class LocalSwarm:
    bootstrap: SwarmProcess
    servers: list[SwarmProcess]
    _nursery: trio.Nursery
    _env: Mapping[str, str]
    _named: int = 0
    #: DHT nodes started beside the first (``add_bootstrap``).
    bootstraps: list[SwarmProcess] = attrs.Factory(list)

    @property
    def initial_peers(self) -> list[str]:
        return [self.bootstrap.address] + [node.address for node in self.bootstraps]

    async def add_server(
        self, model: str, args: Sequence[str] = (), *, host: Placement | None = None
    ) -> SwarmProcess:
        """Start one more server (``--initial_peers`` the bootstrap nodes), on loopback, or
        at ``host`` (e.g. a host of a ``petals_core.testing.Topology``), listening on its
        address."""
        command = [
            sys.executable,
            "-m",
            "petals_core.server",
            model,
            "--host",
            "127.0.0.1" if host is None else host.address,
            "--initial_peers",
            *self.initial_peers,
            *args,
        ]
        name = f"server-{self._named}"  # taken now: servers may start concurrently
        self._named += 1
        if host is not None:
            command = host.command(*command)
        server = await _start(self._nursery, name, command, SERVER_READY, self._env)
        self.servers.append(server)
        return server

    async def add_bootstrap(self, *, host: Placement | None = None) -> SwarmProcess:
        """Start one more DHT node, joined to the first (servers started after it list it in
        their ``--initial_peers``, and may use it as a relay)."""
        command = [*_dht_command(host), "--initial_peers", self.bootstrap.address]
        node = await _start(
            self._nursery, f"bootstrap-{len(self.bootstraps) + 1}", command, DHT_READY, self._env
        )
        self.bootstraps.append(node)
        return node


def _dht_command(host: Placement | None) -> list[str]:
    command = [sys.executable, "-m", "petals_core.dht", "--host"]
    if host is None:
        return [*command, "127.0.0.1"]
    return host.command(*command, host.address)


@asynccontextmanager
async def open_local_swarm(
    model: str,
    server_args: Sequence[Sequence[str]],
    *,
    env: Mapping[str, str] | None = None,
    stop_timeout_s: float = 20.0,
    bootstrap_host: Placement | None = None,
) -> AsyncIterator[LocalSwarm]:
    """A bootstrap node and one server per entry of ``server_args`` (extra flags each, e.g.
    ``["--block_indices", "0:3", "--throughput", "1"]``), started one after the other.

    A process that exits before it is ready raises ``RuntimeError`` with the end of its output;
    bound the whole with a trio deadline (a server that hangs while loading is waited for).
    ``bootstrap_host`` runs the bootstrap node there (e.g. inside a host of a topology).
    """
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    bootstrap: SwarmProcess | None = None
    swarm: LocalSwarm | None = None
    # The nursery wraps what is raised inside it (a process that failed to start, or the caller's
    # own error from the block): raise that itself, as documented.
    with raising_single_error():
        async with trio.open_nursery() as nursery:
            try:
                bootstrap = await _start(
                    nursery, "bootstrap", _dht_command(bootstrap_host), DHT_READY, full_env
                )
                swarm = LocalSwarm(bootstrap, [], nursery, full_env)
                for args in server_args:
                    await swarm.add_server(model, args)
                yield swarm
            finally:
                with trio.CancelScope(shield=True):
                    # Servers leave together (each announces itself offline), then the
                    # bootstrap node.
                    async with trio.open_nursery() as stopping:
                        for process in [] if swarm is None else swarm.servers:
                            stopping.start_soon(process.stop, stop_timeout_s)
                    async with trio.open_nursery() as stopping:
                        for process in [] if swarm is None else swarm.bootstraps:
                            stopping.start_soon(process.stop, stop_timeout_s)
                    if bootstrap is not None:
                        await bootstrap.stop(stop_timeout_s)
                nursery.cancel_scope.cancel()


async def _start(
    nursery: trio.Nursery,
    name: str,
    command: list[str],
    ready: str,
    env: Mapping[str, str],
) -> SwarmProcess:
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(env)
    )
    output: list[str] = []
    found = trio.Event()
    address: list[str] = []
    started = SwarmProcess(name, process, "", output)

    async def read() -> None:
        assert process.stdout is not None
        buffer = b""
        async for data in process.stdout:
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                output.append(line)
                if line.startswith(ready) and not found.is_set():
                    address.append(line[len(ready) :].strip())
                    found.set()
            started._on_line()
        started._on_line(ended=True)
        found.set()

    nursery.start_soon(read)
    try:
        await found.wait()
    except BaseException:
        # Cancelled (or interrupted) before it was ready: nobody else knows of it yet.
        with trio.CancelScope(shield=True):
            process.kill()
            await process.wait()
        raise
    if not address:
        await process.wait()
        tail = "\n".join(output[-30:])
        raise RuntimeError(f"{name} exited with {process.returncode} before it was ready:\n{tail}")
    started.address = address[0]
    return started
