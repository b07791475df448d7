"""A UDP relay on loopback that makes a link slow: each datagram is held for a one-way delay
(plus jitter) and some are dropped, in both directions; the link can also carry a limited rate,
behind a queue of limited size, as a bottleneck does.

:class:`DelayRelay` runs in a process of its own, so that the caller's work (torch, the GIL)
does not delay its datagrams.  For each target port it listens on a port of its own; a peer that
sends there is given a socket of its own towards the target, as a NAT would, so the target's
answers find their way back.  Point peers at :attr:`DelayRelay.ports` (a server announces one
with ``--announce_port``) and every datagram between them crosses the slow link once per way.

Datagrams of one flow keep their order (jitter delays, it does not reorder), as on most paths.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
import select
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import attrs

from ._network import Pipe

__all__ = ["DelayRelay", "RelayStats"]

Address = tuple[str, int]

#: Longest wait for the relay process to start, answer or stop.
_CONTROL_TIMEOUT_S = 30.0
_MAX_DATAGRAM = 65535


@attrs.frozen(kw_only=True)
class RelayStats:
    """What the relay did since it started (or since the last :meth:`DelayRelay.set_link`)."""

    forwarded: int
    dropped: int
    #: Mean and largest time a datagram was held, from its arrival to its sending.
    mean_delay_s: float
    max_delay_s: float
    #: Mean time a datagram was sent after it was due (the relay's own lateness).
    mean_late_s: float
    #: The largest datagram forwarded, and how many were dropped for exceeding
    #: ``Pipe.max_payload`` (counted in ``dropped`` too).
    largest_forwarded: int = 0
    too_large: int = 0
    #: Datagrams dropped because the bottleneck's queue was full (counted in ``dropped`` too).
    queue_full: int = 0


class _Link:
    def __init__(
        self, pipe: Pipe, seed: int, *, bytes_per_s: float | None = None, queue_bytes: int = 0
    ) -> None:
        self.latency_s = pipe.latency_s
        self.jitter_s = pipe.jitter_s
        self.loss = pipe.loss
        self.max_payload = pipe.max_payload
        self.bytes_per_s = bytes_per_s
        self.queue_bytes = queue_bytes
        self.rng = random.Random(seed)

    def hold(self, size: int) -> float | None:
        """How long to hold the next datagram (of ``size`` bytes), or None to drop it."""
        if self.max_payload is not None and size > self.max_payload:
            return None
        if self.loss and self.rng.random() < self.loss:
            return None
        return self.latency_s + (self.rng.random() * self.jitter_s if self.jitter_s else 0.0)


class _Counters:
    def __init__(self) -> None:
        self.forwarded = 0
        self.dropped = 0
        self.held = 0.0
        self.max_held = 0.0
        self.late = 0.0
        self.largest = 0
        self.too_large = 0
        self.queue_full = 0

    def stats(self) -> RelayStats:
        count = max(self.forwarded, 1)
        return RelayStats(
            forwarded=self.forwarded,
            dropped=self.dropped,
            mean_delay_s=self.held / count,
            max_delay_s=self.max_held,
            mean_late_s=self.late / count,
            largest_forwarded=self.largest,
            too_large=self.too_large,
            queue_full=self.queue_full,
        )


def _say(answer: IO[str], message: object) -> None:
    answer.write(json.dumps(message) + "\n")
    answer.flush()


#: Kernel buffers of the relay's sockets: a window of small datagrams arriving at once must not
#: overflow them (that would be a bottleneck's queue, which the relay does not model).
_SOCKET_BUFFER_BYTES = 8 << 20


def _socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
    sock.bind((host, 0))
    sock.setblocking(False)
    return sock


def _serve(control: IO[str], answer: IO[str], host: str, targets: list[int], seed: int) -> None:
    listeners: dict[socket.socket, Address] = {}  # listening socket -> its target
    outward: dict[tuple[socket.socket, Address], socket.socket] = {}  # (listener, peer) -> socket
    inward: dict[socket.socket, tuple[socket.socket, Address]] = {}  # socket -> (listener, peer)
    for port in targets:
        listener = _socket(host)
        listeners[listener] = (host, port)
    _say(answer, [listener.getsockname()[1] for listener in listeners])
    link = _Link(Pipe(latency_s=0.0), seed)
    counters = _Counters()
    # (due, order, arrived, socket, destination, payload)
    held: list[tuple[float, int, float, socket.socket, Address, bytes]] = []
    order = itertools.count()
    last_due: dict[tuple[int, Address], float] = {}  # keeps each flow's order
    # When each flow's bottleneck has sent all it holds (with a rate limit).
    free_at: dict[tuple[int, Address], float] = {}

    def hold(sock: socket.socket, destination: Address, data: bytes, now: float) -> None:
        delay = link.hold(len(data))
        if delay is None:
            counters.dropped += 1
            if link.max_payload is not None and len(data) > link.max_payload:
                counters.too_large += 1
            return
        flow = (sock.fileno(), destination)
        leaves = now
        if link.bytes_per_s is not None:
            # The datagram waits behind those queued before it, then takes its own time to
            # leave; the queue holds at most queue_bytes (tail drop).
            start = max(now, free_at.get(flow, 0.0))
            if (start - now) * link.bytes_per_s + len(data) > link.queue_bytes:
                counters.dropped += 1
                counters.queue_full += 1
                return
            free_at[flow] = leaves = start + len(data) / link.bytes_per_s
        due = max(leaves + delay, last_due.get(flow, 0.0))
        last_due[flow] = due
        heapq.heappush(held, (due, next(order), now, sock, destination, data))

    try:
        while True:
            now = time.monotonic()
            while held and held[0][0] <= now:
                due, _, arrived, sock, destination, data = heapq.heappop(held)
                try:
                    sock.sendto(data, destination)
                except OSError:  # nobody listens there (any more): a lost datagram
                    counters.dropped += 1
                    continue
                sent = time.monotonic()
                counters.forwarded += 1
                counters.largest = max(counters.largest, len(data))
                counters.held += sent - arrived
                counters.max_held = max(counters.max_held, sent - arrived)
                counters.late += sent - due
                now = sent
            timeout = max(0.0, held[0][0] - now) if held else None
            waitables: list[Any] = [control, *listeners, *inward]
            readable, _, _ = select.select(waitables, [], [], timeout)
            for ready in readable:
                if ready is control:
                    line = control.readline()
                    if not line:  # the caller is gone
                        return
                    message = json.loads(line)
                    if message["do"] == "link":
                        pipe = Pipe(**message["pipe"])
                        link = _Link(pipe, seed, **message["rate"])
                        counters = _Counters()
                        free_at.clear()
                        _say(answer, None)
                    elif message["do"] == "stats":
                        _say(answer, attrs.asdict(counters.stats()))
                    continue
                while True:
                    try:
                        data, peer = ready.recvfrom(_MAX_DATAGRAM)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:  # e.g. an ICMP error from an earlier send: not a datagram
                        continue
                    arrived = time.monotonic()
                    if ready in listeners:
                        key = (ready, peer)
                        out = outward.get(key)
                        if out is None:
                            out = _socket(host)
                            outward[key] = out
                            inward[out] = key
                        hold(out, listeners[ready], data, arrived)
                    else:
                        listener, back_to = inward[ready]
                        hold(listener, back_to, data, arrived)
    finally:
        for sock in [*listeners, *inward]:
            sock.close()


class DelayRelay:
    """A relay process with one listening port per entry of ``targets`` (ports on ``host``).

    It starts with no delay; :meth:`set_link` sets the one-way delay, jitter, loss and rate of
    every datagram from then on, both ways.  Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, targets: Sequence[int], *, host: str = "127.0.0.1", seed: int = 0) -> None:
        run = f"from {__name__} import main; main()"
        command = [sys.executable, "-c", run, host, str(seed), *map(str, targets)]
        self._process: subprocess.Popen[str] | None = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.host = host
        try:
            self.ports: list[int] = self._answer()
        except BaseException:
            self.close()
            raise

    def _answer(self) -> Any:
        assert self._process is not None and self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], _CONTROL_TIMEOUT_S)
        line = self._process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the delay relay did not answer (exit code {self._process.poll()})")
        return json.loads(line)

    def _ask(self, message: dict[str, Any]) -> Any:
        if self._process is None or self._process.stdin is None:
            raise RuntimeError("the delay relay is closed")
        self._process.stdin.write(json.dumps(message) + "\n")
        self._process.stdin.flush()
        return self._answer()

    def set_link(
        self, pipe: Pipe, *, bytes_per_s: float | None = None, queue_bytes: int = 64 << 10
    ) -> None:
        """From now on, hold each datagram ``pipe.latency_s`` plus up to ``pipe.jitter_s``
        (uniformly), and drop each with probability ``pipe.loss``, and each larger than
        ``pipe.max_payload``; resets :meth:`stats`.

        With ``bytes_per_s``, each flow (one peer towards one target, or back) also leaves at
        that rate, one datagram after the other, behind a queue of at most ``queue_bytes``:
        a datagram arriving at a full queue is dropped.
        """
        if pipe.latency_s < 0 or pipe.jitter_s < 0 or not 0 <= pipe.loss < 1:
            raise ValueError(f"a link needs delays >= 0 and 0 <= loss < 1, not {pipe}")
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"a link's rate must be above 0 bytes/s, not {bytes_per_s}")
        if queue_bytes < _MAX_DATAGRAM:
            raise ValueError(
                f"a bottleneck's queue must hold a datagram ({_MAX_DATAGRAM} bytes), not "
                f"{queue_bytes}"
            )
        if pipe.drop is not None:
            raise ValueError("the relay drops at random only: Pipe.drop is not supported")
        fields = {
            "latency_s": pipe.latency_s,
            "jitter_s": pipe.jitter_s,
            "loss": pipe.loss,
            "max_payload": pipe.max_payload,
        }
        rate = {"bytes_per_s": bytes_per_s, "queue_bytes": queue_bytes}
        self._ask({"do": "link", "pipe": fields, "rate": rate})

    def stats(self) -> RelayStats:
        return RelayStats(**self._ask({"do": "stats"}))

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.close()  # the relay stops at the end of its input
        except OSError:  # it is gone already
            pass
        try:
            process.wait(timeout=_CONTROL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()

    def __enter__(self) -> DelayRelay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def main() -> None:
    """The relay process: ``HOST SEED TARGET_PORT...`` on the command line, requests on stdin."""
    host, seed, *targets = sys.argv[1:]
    _serve(sys.stdin, sys.stdout, host, [int(port) for port in targets], int(seed))
