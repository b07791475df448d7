"""The transport on its own: in a fresh virtualenv holding only its dependencies (no torch, no
transformers), two nodes connect over loopback and exchange an RPC and a stream.

The dependencies are installed from the package index at the bounds pyproject.toml gives."""

from __future__ import annotations

import subprocess
import tomllib
import venv
from pathlib import Path

from packaging.requirements import Requirement

from ._programs import ECHO_HANDLER

ROOT = Path(__file__).resolve().parents[2]
#: What ``petals_core.transport`` imports besides the standard library.
TRANSPORT_DEPENDENCIES = ("trio", "aioquic", "cryptography", "cbor2", "attrs", "ifaddr")

PROGRAM = (
    """
import importlib.util, sys
import trio
from petals_core.transport import Handlers, call_unary, open_node, serve_rpc

for name in ("torch", "transformers", "numpy"):
    assert importlib.util.find_spec(name) is None, name

"""
    + ECHO_HANDLER
    + """

async def main():
    handlers = Handlers()

    async def add(request, call):
        return {"sum": request["a"] + request["b"]}

    handlers.add_unary("add", add)
    with trio.fail_after(60):
        async with open_node() as server, open_node() as client, trio.open_nursery() as nursery:
            await nursery.start(serve_rpc, server, handlers)
            connection = await client.connect(server.listen_multiaddr)
            assert (await call_unary(connection, "add", {"a": 2, "b": 3}))["sum"] == 5
            nursery.cancel_scope.cancel()
        async with open_node() as server, open_node() as client, trio.open_nursery() as nursery:
            server.set_stream_handler(lambda stream: nursery.start_soon(echo, stream))
            connection = await client.connect(server.listen_multiaddr)
            stream = await connection.open_stream()
            payload = bytes(range(256)) * 4096
            await stream.send_all(payload, eof=True)
            echoed = bytearray()
            while data := await stream.receive_some():
                echoed += data
            assert echoed == payload
            nursery.cancel_scope.cancel()
    print("OK", sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "numpy")))

trio.run(main)
"""
)


def _requirements() -> list[str]:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    chosen = [line for line in dependencies if Requirement(line).name in TRANSPORT_DEPENDENCIES]
    assert len(chosen) == len(TRANSPORT_DEPENDENCIES)
    return chosen


def test_the_transport_runs_with_its_own_dependencies_only(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            *_requirements(),
        ],
        check=True,
        timeout=600,
    )
    done = subprocess.run(
        [str(python), "-c", PROGRAM],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "OK []"
