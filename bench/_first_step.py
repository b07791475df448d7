"""``bench inference``'s first step of a session: by part, beside local transformers, and beside
another tree of the project (``--against REF``) in the same run.

Each tree measured runs in a worker process of its own (``_first_step_worker.py``, with
``PYTHONPATH`` at the tree) that starts its own swarm of that tree on the same checkpoint; the
workers take turns, one first step each, so that a change of load on the machine affects all
alike.  A first step is the first forward of an inference session (``PREFILL`` tokens) on a
client made afresh: planning the route (the client's peer table fills from the swarm),
connecting to the servers, opening the sessions, and the step itself.  Its *fixed cost* is all
but the compute: the first step's time less what the same blocks take for the same tokens in
this process.  The tree measured against is checked out (``git worktree``) into a temporary
folder, and removed after.  With a ``link``, each swarm's servers sit behind a delaying relay
(:class:`~petals_core.testing.DelayRelay`), as in ``bench wan``: there the fixed cost is round
trips.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from petals_core.testing import DelayRelay, Pipe

WORKER = Path(__file__).with_name("_first_step_worker.py")
ROOT = Path(__file__).resolve().parent.parent
#: Longest wait for a worker's swarm to start, or for one first step.
_WORKER_TIMEOUT_S = 300.0


@attrs.frozen(kw_only=True)
class FirstSteps:
    """What one tree's worker measured of one kind of session, one entry per round."""

    #: ``from_pretrained`` of the client.
    made_ms: tuple[float, ...]
    first_ms: tuple[float, ...]
    second_ms: tuple[float, ...]
    #: Per round, the session's own account (``route_ms``, ``open_ms``, ``connect_ms``,
    #: ``step_ms``); None where the tree's sessions give none.
    parts: tuple[Mapping[str, float], ...] | None

    def median(self, name: str) -> float:
        if name in ("made_ms", "first_ms", "second_ms"):
            return statistics.median(getattr(self, name))
        assert self.parts is not None
        return statistics.median(part[name] for part in self.parts)


class _Worker:
    def __init__(self, tree: Path, config: Mapping[str, Any]) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=tree,
        )
        self.tree = tree

    def wait_for(self, prefix: str) -> str:
        stdout = self.process.stdout
        assert stdout is not None
        deadline = time.monotonic() + _WORKER_TIMEOUT_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([stdout], [], [], left)[0]:
                raise TimeoutError(f"the first-step worker of {self.tree} did not say {prefix}")
            line = stdout.readline()
            if not line:
                raise RuntimeError(f"the first-step worker of {self.tree} ended")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def measure(self) -> dict[str, Any]:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write("go\n")
        stdin.flush()
        result: dict[str, Any] = json.loads(self.wait_for("RESULT "))
        return result

    def close(self) -> None:
        stdin: IO[str] | None = self.process.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):
                stdin.write("stop\n")
                stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """The project's tree at ``ref``, in a temporary folder (a detached git worktree)."""
    with tempfile.TemporaryDirectory(prefix="bench-tree-") as temp:
        path = Path(temp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(path), ref],
            check=True,
            capture_output=True,
        )
        try:
            yield path
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                check=False,
                capture_output=True,
            )


def free_udp_port() -> int:
    """A UDP port of loopback that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure_first_steps(
    trees: Mapping[str, Path],
    *,
    folder: str,
    server_args: Sequence[Sequence[str]],
    prefill: int,
    vocab: int,
    rounds: int,
    warmup: int = 1,
    link: Pipe | None = None,
) -> dict[str, FirstSteps]:
    """Per tree (by name) and kind of session (``"<name>, fresh"``: a client's first,
    ``"<name>, running"``: its second), ``rounds`` first steps, the trees taking turns."""
    workers: dict[str, _Worker] = {}
    relays = contextlib.ExitStack()
    try:
        for name, tree in trees.items():
            args = [list(flags) for flags in server_args]
            if link is not None:
                # Each server behind a port of a delaying relay of its own swarm's, announced
                # (as behind port forwarding): every datagram to or between servers crosses
                # the slow link; the bootstrap node is reached directly.
                ports = [free_udp_port() for _ in args]
                relay = relays.enter_context(DelayRelay(ports))
                relay.set_link(link)
                for flags, port, outside in zip(args, ports, relay.ports, strict=True):
                    flags += ["--port", str(port), "--announce_port", str(outside)]
            config = {"folder": folder, "server_args": args, "prefill": prefill, "vocab": vocab}
            workers[name] = _Worker(tree, config)
        for worker in workers.values():
            worker.wait_for("READY")
        results: dict[str, list[dict[str, Any]]] = {name: [] for name in workers}
        for index in range(warmup + rounds):
            for name, worker in workers.items():
                result = worker.measure()
                if index >= warmup:
                    results[name].append(result)
    finally:
        for worker in workers.values():
            worker.close()
        relays.close()
    measured = {}
    for name, rows in results.items():
        for kind in ("fresh", "running"):
            sessions = [row[kind] for row in rows]
            parts = [session["parts"] for session in sessions]
            measured[f"{name}, {kind}"] = FirstSteps(
                made_ms=tuple(row["made_ms"] for row in rows),
                first_ms=tuple(session["first_ms"] for session in sessions),
                second_ms=tuple(session["second_ms"] for session in sessions),
                parts=None if any(part is None for part in parts) else tuple(parts),
            )
    return measured
