"""What the transport benchmark measures besides the transport: the host's costs.

Where a QUIC round trip or a bulk transfer spends its time depends on the host as much as on our
code: what a system call costs (a sandbox such as gVisor serves each one in a user-space kernel),
how late a timer fires, how fast plain UDP moves through trio.  These probes measure exactly that,
so that a slow run can be attributed on any machine:

* :func:`syscall_costs`: microseconds per call of what the node does per datagram (``sendto``,
  ``recvfrom`` with and without a datagram waiting, ``sendmsg`` with segmentation offload), of an
  epoll round, a TCP send and receive, a clock read and a first touch of a fresh page.
* :func:`timer_overshoot` and :func:`sleep_overshoot`: how late trio wakes from a 50 µs and a 1 ms
  sleep and from a deadline around a wait for a readable socket (the QUIC pump's wait), and how
  late the kernel wakes a plain 50 µs sleep.
* :func:`serve_udp` / :func:`udp_ping_pong`: a plain UDP echo through trio, in the pump's style
  (wait until readable, read until empty, send back): the floor under the QUIC round trip.
* :func:`process_tally` and :class:`IoWaits`: what a process spent (CPU time, run-queue wait,
  context switches) and how often trio asked the kernel for events, to be differenced around a
  phase.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import select
import socket
import statistics
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from petals_core.transport import TransportConfig
from petals_core.transport._endpoint import ConnectionReady, Endpoint, StreamData
from petals_core.transport._identity import Identity

from ._report import percentile

_SOL_UDP = 17
_UDP_SEGMENT = 103
_PAGE = mmap.PAGESIZE
# Datagrams sent (or read) between drains (refills) of the receiving socket.
_BURST = 32
TALLY = b"t"
WORK = b"w"
_CLIENT = ("127.0.0.1", 1000)
_SERVER = ("127.0.0.1", 2000)


# -- the cost of one call -------------------------------------------------------------------------


def _per_call_us(call: Callable[[], object], calls: int, *, repeats: int = 5) -> float:
    """The median over ``repeats`` of the mean time of ``calls`` calls, in microseconds."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def _burst_us(
    timed: Callable[[int], float], between: Callable[[], None], calls: int, *, repeats: int = 5
) -> float:
    """Microseconds per call when ``timed(n)`` makes ``n`` calls and returns the seconds they
    took, in bursts of :data:`_BURST` with ``between()`` (untimed) after each; median of
    ``repeats``."""
    bursts = max(1, calls // _BURST)
    times = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(bursts):
            total += timed(_BURST)
            between()
        times.append(total / (bursts * _BURST) * 1e6)
    return statistics.median(times)


def _udp_pair() -> tuple[socket.socket, socket.socket]:
    pair = []
    for _ in range(2):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        pair.append(sock)
    return pair[0], pair[1]


def _drain(sock: socket.socket) -> None:
    while True:
        try:
            sock.recv(65536)
        except BlockingIOError:
            return


def syscall_costs(*, quick: bool = False) -> dict[str, float | None]:
    """Microseconds per call, each the median of five timed loops (``None``: not possible here)."""
    calls = 200 if quick else 1000
    sender, receiver = _udp_pair()
    target = receiver.getsockname()
    small = bytes(64)
    full = bytes(1452)
    costs: dict[str, float | None] = {}
    try:

        def sendto_us(payload: bytes) -> float:
            def send(count: int) -> float:
                start = time.perf_counter()
                for _ in range(count):
                    sender.sendto(payload, target)
                return time.perf_counter() - start

            return _burst_us(send, lambda: _drain(receiver), calls)

        def receive_us(count: int) -> float:
            start = time.perf_counter()
            for _ in range(count):
                receiver.recvfrom(65536)
            return time.perf_counter() - start

        def refill() -> None:
            for _ in range(_BURST):
                sender.sendto(small, target)

        def receive_empty() -> None:
            try:
                receiver.recvfrom(65536)
            except BlockingIOError:
                pass

        costs["sendto 64 B"] = sendto_us(small)
        costs["sendto 1452 B"] = sendto_us(full)
        refill()
        costs["recvfrom 64 B waiting"] = _burst_us(receive_us, refill, calls)
        _drain(receiver)
        costs["recvfrom, nothing waiting"] = _per_call_us(receive_empty, calls)
        costs["sendmsg 45 x 1452 B segmented, per datagram"] = _segmented_send_us(
            sender, receiver, calls
        )
        if not hasattr(select, "epoll"):
            costs["epoll_wait, nothing ready"] = costs["epoll_ctl (re-arm)"] = None
            return costs | _other_costs(calls)
        poller = select.epoll()
        try:
            flags = select.EPOLLIN | select.EPOLLONESHOT
            poller.register(receiver.fileno(), flags)
            costs["epoll_wait, nothing ready"] = _per_call_us(lambda: poller.poll(0), calls)
            costs["epoll_ctl (re-arm)"] = _per_call_us(
                lambda: poller.modify(receiver.fileno(), flags), calls
            )
        finally:
            poller.close()
    finally:
        sender.close()
        receiver.close()
    return costs | _other_costs(calls)


def _other_costs(calls: int) -> dict[str, float | None]:
    return {
        "TCP send + recv 64 B": _tcp_send_receive_us(calls),
        "clock read (perf_counter)": _per_call_us(time.perf_counter, calls * 10),
        "first touch of a fresh page": _fresh_page_us(calls),
    }


def _segmented_send_us(sender: socket.socket, receiver: socket.socket, calls: int) -> float | None:
    """Per datagram, one ``sendmsg`` of 45 datagrams with UDP segmentation offload (None where
    the kernel refuses it)."""
    run = [bytes(1452)] * 45
    ancillary = [(_SOL_UDP, _UDP_SEGMENT, struct.pack("=H", 1452))]
    target = receiver.getsockname()

    try:
        sender.setsockopt(_SOL_UDP, _UDP_SEGMENT, 0)
        sender.sendmsg(run, ancillary, 0, target)
    except OSError:
        return None
    _drain(receiver)
    sends = max(1, calls // len(run))
    times = []
    for _ in range(5):
        total = 0.0
        for _ in range(sends):
            start = time.perf_counter()
            sender.sendmsg(run, ancillary, 0, target)
            total += time.perf_counter() - start
            _drain(receiver)
        times.append(total / (sends * len(run)) * 1e6)
    return statistics.median(times)


def _tcp_send_receive_us(calls: int) -> float:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    try:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = bytes(64)

        def send_receive() -> None:
            client.send(payload)
            server.recv(65536)

        return _per_call_us(send_receive, calls)
    finally:
        client.close()
        server.close()


def _fresh_page_us(calls: int) -> float:
    pages = 64

    def touch() -> None:
        region = mmap.mmap(-1, pages * _PAGE)
        for offset in range(0, pages * _PAGE, _PAGE):
            region[offset] = 1
        region.close()

    return _per_call_us(touch, max(1, calls // pages)) / pages


# -- timers -------------------------------------------------------------------------------------


async def timer_overshoot(*, quick: bool = False) -> dict[str, dict[str, float]]:
    """How late trio wakes (µs past the deadline: median and p90) from sleeps and from a
    deadline around a wait for a socket that stays quiet."""
    rounds = 20 if quick else 50
    results = {}
    for label, delay in (("trio.sleep(50 µs)", 50e-6), ("trio.sleep(1 ms)", 1e-3)):
        late = []
        for _ in range(rounds):
            start = trio.current_time()
            await trio.sleep(delay)
            late.append((trio.current_time() - start - delay) * 1e6)
        results[label] = _spread(late)
    quiet, other = _udp_pair()
    other.close()
    try:
        late = []
        for _ in range(rounds):
            deadline = trio.current_time() + 50e-6
            with trio.move_on_at(deadline):
                await trio.lowlevel.wait_readable(quiet)
            late.append((trio.current_time() - deadline) * 1e6)
        results["move_on_at(50 µs) around wait_readable"] = _spread(late)
    finally:
        quiet.close()
    return results


def sleep_overshoot(*, quick: bool = False) -> dict[str, dict[str, float]]:
    """The same for a plain ``time.sleep(50 µs)``, without an event loop: the kernel's own
    timer slack, which trio's millisecond-rounded waits add to."""
    late = []
    for _ in range(20 if quick else 50):
        start = time.perf_counter()
        time.sleep(50e-6)
        late.append((time.perf_counter() - start - 50e-6) * 1e6)
    return {"time.sleep(50 µs), no event loop": _spread(late)}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "p90": percentile(values, 0.9)}


# -- what a process spent -----------------------------------------------------------------------


class IoWaits(trio.abc.Instrument):
    """Counts trio's requests for I/O events: one per scheduler round (an ``epoll_wait``)."""

    def __init__(self) -> None:
        self.rounds = 0
        #: Rounds that could block (no task was ready to run).
        self.blocking = 0

    def before_io_wait(self, timeout: float) -> None:
        self.rounds += 1
        if timeout > 0:
            self.blocking += 1


def process_tally(io_waits: IoWaits | None = None) -> dict[str, float]:
    """This process's totals so far: CPU seconds (user, system), run-queue wait where Linux's
    schedstat tells it, page faults, context switches, and trio's scheduler rounds."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    tally = {
        "user_s": usage.ru_utime,
        "system_s": usage.ru_stime,
        "minor_faults": float(usage.ru_minflt),
        "voluntary_switches": float(usage.ru_nvcsw),
        "involuntary_switches": float(usage.ru_nivcsw),
    }
    run_queue = _run_queue_wait_s()
    if run_queue is not None:
        tally["run_queue_wait_s"] = run_queue
    if io_waits is not None:
        tally["scheduler_rounds"] = float(io_waits.rounds)
        tally["blocking_rounds"] = float(io_waits.blocking)
    return tally


def _run_queue_wait_s() -> float | None:
    total = 0
    try:
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


def difference(after: dict[str, Any], before: dict[str, Any], per: float) -> dict[str, Any]:
    """``(after - before) / per`` for every number, recursively (booleans as they are after)."""
    out: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            out[key] = difference(value, before.get(key, {}), per)
        elif isinstance(value, bool) or not isinstance(value, int | float):
            out[key] = value
        else:
            out[key] = (value - before.get(key, 0)) / per
    return out


# -- plain UDP through trio ---------------------------------------------------------------------


async def serve_udp(ready: Callable[[str], None]) -> None:
    """Echo every datagram back; answer :data:`TALLY` with this process's tally as JSON.  A
    datagram that starts with :data:`WORK` is answered after computing for the number of
    microseconds that follows (as a QUIC peer computes before it answers)."""
    io_waits = IoWaits()
    trio.lowlevel.add_instrument(io_waits)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    ready(f"127.0.0.1:{sock.getsockname()[1]}")
    while True:
        await trio.lowlevel.wait_readable(sock)
        while True:
            try:
                data, source = sock.recvfrom(65536)
            except BlockingIOError:
                break
            if data == TALLY:
                data = json.dumps(process_tally(io_waits)).encode()
            elif data.startswith(WORK):
                _spin(int(data[len(WORK) :].split(b" ", 1)[0]) / 1e6)
            sock.sendto(data, source)


async def _udp_exchange(sock: socket.socket, payload: bytes, target: tuple[str, int]) -> bytes:
    """Send ``payload`` and wait for one datagram back, reading as the QUIC pump reads."""
    while True:
        sock.sendto(payload, target)
        with trio.move_on_after(1.0):
            while True:
                await trio.lowlevel.wait_readable(sock)
                answer = None
                while True:
                    try:
                        answer = sock.recv(65536)
                    except BlockingIOError:
                        break
                if answer is not None:
                    return answer
        # Lost on loopback (a full buffer): ask again.


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def udp_ping_pong(
    address: str, *, rounds: int, message: int, io_waits: IoWaits, server_work_us: int = 0
) -> dict[str, Any]:
    """Round trips of ``message`` bytes to :func:`serve_udp` (which computes ``server_work_us``
    before each answer): times (ms) and, per round trip, what each process spent."""
    host, port = address.rsplit(":", 1)
    target = (host, int(port))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    payload = bytes(message)
    if server_work_us:
        payload = (WORK + b"%d " % server_work_us).ljust(message, b"\0")
    try:
        for _ in range(rounds // 10):
            await _udp_exchange(sock, payload, target)
        server_before = json.loads(await _udp_exchange(sock, TALLY, target))
        client_before = process_tally(io_waits)
        times = []
        for _ in range(rounds):
            start = trio.current_time()
            await _udp_exchange(sock, payload, target)
            times.append((trio.current_time() - start) * 1e3)
        client_after = process_tally(io_waits)
        server_after = json.loads(await _udp_exchange(sock, TALLY, target))
    finally:
        sock.close()
    return {
        "rtt_ms": times,
        "client": difference(client_after, client_before, rounds),
        "server": difference(server_after, server_before, rounds),
    }


def udp_drops(port: int) -> int | None:
    """Datagrams the kernel dropped for the UDP socket bound to ``port`` (its receive buffer was
    full), from ``/proc/net/udp`` and ``udp6``; None where those do not say."""
    for name in ("udp", "udp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) >= 13 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return int(fields[-1])
    return None


# -- the CPU alone ------------------------------------------------------------------------------


def cpu_speed() -> dict[str, float]:
    """How fast this host runs plain Python and the AEAD that protects every packet."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    def python_loop() -> None:
        x = 0
        for i in range(100_000):
            x = (x * 31 + i) & 0xFFFF

    aead = AESGCM(bytes(16))
    nonce = bytes(12)
    return {
        "plain Python loop, 100k iterations, ms": _per_call_us(python_loop, 5) / 1e3,
        "AES-128-GCM seal 1452 B, µs": _per_call_us(
            lambda: aead.encrypt(nonce, bytes(1452), b""), 200
        ),
        "AES-128-GCM seal 16 KiB, µs": _per_call_us(
            lambda: aead.encrypt(nonce, bytes(16384), b""), 200
        ),
    }


class _Pair:
    """Two endpoints in this process with datagrams handed across at once: QUIC's work alone,
    without sockets or an event loop.  Time is real, but jumps ahead to the next timer whenever
    nothing moved (so that pacing or a delayed ACK never spins).  The server consumes what
    arrives, and with ``echo`` sends it back."""

    def __init__(self, datagram: int, *, echo: bool = False) -> None:
        config = TransportConfig(
            loopback_datagram_bytes=datagram, max_datagram_bytes=datagram, keepalive_interval_s=None
        )
        self.client = Endpoint(Identity.generate(), config)
        self.server = Endpoint(Identity.generate(), config)
        self.echo = echo
        self.received = 0
        self.echoed = 0
        self._skew = 0.0
        self._ready = 0
        self.handle = self.client.connect(_SERVER, self.server.identity.peer_id, self.now())
        while self._ready < 2:
            self.step()

    def now(self) -> float:
        return time.perf_counter() + self._skew

    def step(self) -> int:
        """Deliver what each side has to send and run due timers; the datagrams moved."""
        moved = 0
        now = self.now()
        for endpoint, other, source in (
            (self.client, self.server, _CLIENT),
            (self.server, self.client, _SERVER),
        ):
            timer = endpoint.next_timer()
            if timer is not None and timer <= now:
                endpoint.handle_timers(now)
            for data, _ in endpoint.datagrams_to_send(now):
                other.receive_datagram(data, source, now)
                moved += 1
            self._events(endpoint, now)
        if not moved:
            timers = [t for t in (self.client.next_timer(), self.server.next_timer()) if t]
            if timers and min(timers) > now:
                self._skew += min(timers) - now
        return moved

    def _events(self, endpoint: Endpoint, now: float) -> None:
        for event in endpoint.events():
            if isinstance(event, ConnectionReady):
                self._ready += 1
            elif isinstance(event, StreamData):
                endpoint.adopt_stream(event.handle, event.stream_id)
                endpoint.consume(event.handle, event.stream_id, len(event.data), now)
                if endpoint is self.client:
                    self.echoed += len(event.data)
                    continue
                self.received += len(event.data)
                if self.echo:
                    endpoint.send_stream_data(event.handle, event.stream_id, event.data, now)


def quic_cpu(*, quick: bool = False) -> dict[str, float]:
    """Microseconds of QUIC processing alone (both ends in this process, no sockets): per round
    trip of a 64-byte message on a reused stream, and per datagram of a bulk transfer.  What the
    transport costs over this is sockets, scheduling and waiting."""
    results = {}
    pair = _Pair(16384, echo=True)
    stream_id = pair.client.open_stream(pair.handle)
    message = bytes(64)
    rounds = 200 if quick else 1000
    start = time.process_time()
    for index in range(rounds + rounds // 10):
        if index == rounds // 10:
            start = time.process_time()
        pair.client.send_stream_data(pair.handle, stream_id, message, pair.now())
        expected = pair.echoed + len(message)
        while pair.echoed < expected:
            pair.step()
    results["round trip, both ends, µs"] = (time.process_time() - start) / rounds * 1e6
    for datagram, label in ((1452, "1452 B"), (16384, "16 KiB")):
        pair = _Pair(datagram)
        stream_id = pair.client.open_stream(pair.handle)
        total = (4 if quick else 16) << 20
        block = bytes(256 << 10)
        sent = 0
        start = time.process_time()
        datagrams = 0
        while pair.received < total:
            while sent < total and pair.client.send_room(pair.handle, stream_id) >= len(block):
                pair.client.send_stream_data(pair.handle, stream_id, block, pair.now())
                sent += len(block)
            datagrams += pair.step()
        # Datagrams both ways (data and acknowledgements), each processed by both ends.
        results[f"bulk {label} datagrams, both ends, µs per datagram"] = (
            (time.process_time() - start) / datagrams * 1e6
        )
    return results
