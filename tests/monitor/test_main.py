"""``python -m petals_core.monitor``: bad flags exit 2 saying what is wrong; a real process joins
a swarm, prints the line naming its URL, serves the API, and exits 0 on SIGTERM; a port already
taken exits 1 saying so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
import trio

from petals_core.dht import open_dht_node
from petals_core.monitor.__main__ import READY, main

from ._http_client import get, get_json

DEADLINE_S = 60
PEER = "/ip4/127.0.0.1/udp/4001/quic-v1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: --initial_peers"),
        (["--initial_peers", "127.0.0.1:4001"], "invalid multiaddr '127.0.0.1:4001'"),
        (["--initial_peers", PEER, "--port", "65536"], "port must be 0..65535, got 65536"),
        (["--initial_peers", PEER, "--port", "http"], "--port: invalid int value: 'http'"),
        (["--initial_peers", PEER, "--refresh_period", "0"], "--refresh_period must be positive"),
        (["--initial_peers", PEER, "--ping_timeout", "-1"], "--ping_timeout must be positive"),
        (["--initial_peers", PEER, "--unknown"], "unrecognized arguments: --unknown"),
    ],
)
def test_bad_flags_exit_2_saying_what_is_wrong(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


async def _start(peer: str, port: int) -> trio.Process:
    command = [sys.executable, "-m", "petals_core.monitor", "--initial_peers", peer]
    command += ["--port", str(port), "--dht_host", "127.0.0.1", "--refresh_period", "0.5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


async def _first_line(stream: trio.abc.ReceiveStream) -> str:
    data = b""
    while b"\n" not in data:
        chunk = await stream.receive_some()
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0].decode()


async def test_serves_until_sigterm_and_a_taken_port_is_an_error() -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_dht_node(host="127.0.0.1") as swarm:
            peer = str(swarm.listen_multiaddr)
            monitor = await _start(peer, 0)
            try:
                assert monitor.stdout is not None and monitor.stderr is not None
                line = await _first_line(monitor.stdout)
                assert line.startswith(READY), line
                url = line.removeprefix(READY)
                assert url.startswith("http://127.0.0.1:")
                state = await get_json(f"{url}/api/v1/state")
                assert state["models"] == []  # a DHT node alone: no model registered
                assert (await get(f"{url}/")).status == 200

                port = urlsplit(url).port
                assert port is not None
                second = await _start(peer, port)
                assert second.stderr is not None
                assert await second.wait() == 1
                error = (await second.stderr.receive_some()).decode()
                assert f"error: cannot listen on 127.0.0.1:{port}" in error

                monitor.send_signal(signal.SIGTERM)
                assert await monitor.wait() == 0
                assert "Traceback" not in (await monitor.stderr.receive_some()).decode()
            finally:
                if monitor.returncode is None:
                    monitor.kill()
                    await monitor.wait()
