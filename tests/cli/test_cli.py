"""Petals' module names for the commands: ``python -m petals_core.cli.run_dht`` and
``python -m petals_core.cli.run_server``, as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import trio

from petals_core.dht import open_dht_node
from petals_core.transport import Multiaddr

ANNOUNCE = "DHT node listening on "
TIMEOUT_S = 60


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_run_server_is_the_server_command() -> None:
    shown = _run("petals_core.cli.run_server", "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == _run("petals_core.server", "--help").stdout
    assert "--initial_peers" in shown.stdout
    refused = _run("petals_core.cli.run_server", "some/model", "--no_such_flag")
    assert refused.returncode == 2
    assert "--no_such_flag" in refused.stderr


async def test_run_dht_serves_and_stops_on_sigterm() -> None:
    command = [
        sys.executable,
        "-m",
        "petals_core.cli.run_dht",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        assert process.stdout is not None
        buffer = b""
        with trio.fail_after(TIMEOUT_S):
            while b"\n" not in buffer:
                chunk = await process.stdout.receive_some()
                assert chunk, f"the node exited before announcing; stdout: {buffer!r}"
                buffer += chunk
        line = buffer.split(b"\n", 1)[0].decode()
        assert line.startswith(ANNOUNCE), line
        address = Multiaddr.parse(line[len(ANNOUNCE) :])
        with trio.fail_after(TIMEOUT_S):
            async with open_dht_node(initial_peers=[str(address)], client_mode=True) as client:
                assert await client.store("key", b"value", time.time() + 60) == 1
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(TIMEOUT_S):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(TIMEOUT_S):
                await process.wait()


def test_run_dht_takes_petals_flags_where_they_mean_something() -> None:
    from petals_core.dht.__main__ import _parse_args

    args = _parse_args(
        ["--host_maddrs", "/ip4/127.0.0.1/udp/31337/quic-v1", "--refresh_period", "5"]
    )
    assert (args.host, args.port, args.refresh_period) == ("127.0.0.1", 31337, 5.0)
    for flags, message in [
        (["--use_ipfs"], "--use_ipfs is a Petals flag that means nothing here"),
        (["--announce_maddrs", "/ip4/1.2.3.4/udp/1/quic-v1"], "listen on the forwarded port"),
        (["--host_maddrs", "/ip4/0.0.0.0/tcp/31337"], "use /udp/PORT/quic-v1"),
        (["--refresh_period", "0"], "--refresh_period must be positive"),
    ]:
        refused = _run("petals_core.cli.run_dht", *flags)
        assert refused.returncode == 2
        assert message in refused.stderr
