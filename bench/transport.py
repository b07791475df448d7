"""Transport benchmark: QUIC (ours) against trio TCP, client and server in separate processes.

Measures, in one run and on loopback: handshake time; small-message round trip (median and p90) on
a reused stream and on a new stream per message (a unary call); bulk throughput of 64 MiB on one
stream at 1452-byte and at 16 KiB datagrams, first on a new connection (slow start included) and
then again on the now warm connection (the steady state a long-lived peer connection sees); 8
streams of 4 MiB at once.  TCP does the same work
over plain trio TCP connections (no TLS): one connection for "reused", one connection per bulk
stream, and a fresh connection for the handshake row.

Run with ``nox -s bench -- transport``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from petals_core.transport import (
    Handlers,
    Multiaddr,
    ServerCall,
    Stream,
    TransportConfig,
    TransportError,
    call_unary,
    open_node,
    serve_rpc,
)

from ._report import median, percentile, print_table, summarize, write_json

MESSAGE = 64
BULK_BYTES = 64 << 20
PARALLEL = 8
PARALLEL_BYTES = 4 << 20
CHUNK = 1 << 20
RTT_ROUNDS = 2000
HANDSHAKES = 30
_READY = "ready "


# -- servers (child processes) ----------------------------------------------------------------


async def _drain_and_count(receive: Callable[[], Awaitable[bytes]]) -> int:
    total = 0
    while data := await receive():
        total += len(data)
    return total


async def _quic_stream(stream: Stream) -> None:
    """The first byte says what the stream is for: b"e" echo until EOF, b"s" count and reply."""
    async with stream:
        kind = await stream.receive_some(1)
        if kind == b"e":
            while data := await stream.receive_some():
                await stream.send_all(data)
        elif kind == b"s":
            total = await _drain_and_count(stream.receive_some)
            await stream.send_all(total.to_bytes(8, "big"))
        await stream.send_eof()


async def _quic_stream_guarded(stream: Stream) -> None:
    try:
        await _quic_stream(stream)
    except TransportError:
        pass  # the client may let go of a stream before reading our end of it


async def _serve_quic(datagram: int) -> None:
    config = TransportConfig(loopback_datagram_bytes=datagram, max_datagram_bytes=datagram)
    handlers = Handlers()

    @handlers.unary("ping")
    async def ping(request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        return request

    # One node answers raw streams (byte-level rows), another RPC calls (the unary row).
    async with (
        open_node(config=config) as raw,
        open_node(config=config) as rpc,
        trio.open_nursery() as nursery,
    ):
        raw.set_stream_handler(lambda stream: nursery.start_soon(_quic_stream_guarded, stream))
        await nursery.start(serve_rpc, rpc, handlers)
        print(_READY + f"{raw.listen_multiaddr} {rpc.listen_multiaddr}", flush=True)
        await trio.sleep_forever()


async def _serve_tcp() -> None:
    async def handle(stream: trio.SocketStream) -> None:
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY
        kind = await stream.receive_some(1)
        if kind == b"e":
            while data := await stream.receive_some():
                await stream.send_all(data)
        elif kind == b"s":
            total = await _drain_and_count(stream.receive_some)
            await stream.send_all(total.to_bytes(8, "big"))
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        print(_READY + f"127.0.0.1:{port}", flush=True)
        await trio.sleep_forever()


# -- clients ----------------------------------------------------------------------------------


@attrs.define
class Results:
    handshake_ms: list[float] = attrs.Factory(list)
    rtt_reused_ms: list[float] = attrs.Factory(list)
    rtt_new_ms: list[float] = attrs.Factory(list)
    bulk_cold_mb_s: float = 0.0
    bulk_mb_s: float = 0.0
    parallel_mb_s: float = 0.0


async def _echo_rounds(send: Any, receive: Any, rounds: int) -> list[float]:
    payload = bytes(range(MESSAGE))
    times = []
    for _ in range(rounds):
        start = trio.current_time()
        await send(payload)
        got = 0
        while got < MESSAGE:
            got += len(await receive())
        times.append((trio.current_time() - start) * 1e3)
    return times


def _mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e6


async def _quic_client(address: str, datagram: int, *, full: bool) -> Results:
    config = TransportConfig(loopback_datagram_bytes=datagram, max_datagram_bytes=datagram)
    results = Results()
    raw_address, rpc_address = address.split()
    target = Multiaddr.parse(raw_address)
    async with open_node(config=config) as node:
        if full:
            for _ in range(HANDSHAKES):
                start = trio.current_time()
                connection = await node.connect(target)
                results.handshake_ms.append((trio.current_time() - start) * 1e3)
                await connection.aclose()
        connection = await node.connect(target)
        if full:
            stream = await connection.open_stream()
            await stream.send_all(b"e")
            results.rtt_reused_ms = await _echo_rounds(
                stream.send_all, stream.receive_some, RTT_ROUNDS
            )
            await stream.send_eof()
            assert await stream.receive_some() == b""
            await stream.aclose()
            payload = {"p": bytes(MESSAGE)}
            rpc_connection = await node.connect(rpc_address)
            for _ in range(RTT_ROUNDS // 2):
                start = trio.current_time()
                await call_unary(rpc_connection, "ping", payload)
                results.rtt_new_ms.append((trio.current_time() - start) * 1e3)

        await _bulk(connection.open_stream, results, parallel=full)
    return results


async def _sink(open_stream: Callable[[], Awaitable[Any]], nbytes: int) -> None:
    """Send ``nbytes`` on a new stream (or TCP connection) and check the server counted them."""
    stream = await open_stream()
    await stream.send_all(b"s")
    block = bytes(CHUNK)
    for _ in range(nbytes // CHUNK):
        await stream.send_all(block)
    await stream.send_eof()
    reply = b""
    while len(reply) < 8:
        reply += await stream.receive_some()
    assert int.from_bytes(reply[:8], "big") == nbytes
    await stream.aclose()


async def _bulk(
    open_stream: Callable[[], Awaitable[Any]], results: Results, *, parallel: bool
) -> None:
    """Cold and warm 64 MiB transfers, then (if asked) 8 x 4 MiB at once."""
    start = trio.current_time()
    await _sink(open_stream, BULK_BYTES)
    results.bulk_cold_mb_s = _mb_s(BULK_BYTES, trio.current_time() - start)
    start = trio.current_time()
    await _sink(open_stream, BULK_BYTES)
    results.bulk_mb_s = _mb_s(BULK_BYTES, trio.current_time() - start)
    if parallel:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(PARALLEL):
                nursery.start_soon(_sink, open_stream, PARALLEL_BYTES)
        results.parallel_mb_s = _mb_s(PARALLEL * PARALLEL_BYTES, trio.current_time() - start)


async def _tcp_client(address: str) -> Results:
    host, port = address.rsplit(":", 1)
    results = Results()

    async def connect() -> trio.SocketStream:
        stream = await trio.open_tcp_stream(host, int(port))
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY
        return stream

    for _ in range(HANDSHAKES):
        start = trio.current_time()
        stream = await connect()
        results.handshake_ms.append((trio.current_time() - start) * 1e3)
        await stream.aclose()
    stream = await connect()
    await stream.send_all(b"e")
    results.rtt_reused_ms = await _echo_rounds(stream.send_all, stream.receive_some, RTT_ROUNDS)
    await stream.aclose()

    await _bulk(connect, results, parallel=True)
    return results


class _Server:
    """A benchmark server in a child process (one Python interpreter, its own core if free)."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.transport", "--serve", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(_READY):
            self.close()
            raise SystemExit(f"benchmark server did not start: {line!r}")
        self.address = line[len(_READY) :].strip()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def main() -> None:
    servers = {"tcp": _Server("tcp"), "quic16k": _Server("quic", "16384")}
    servers["quic1452"] = _Server("quic", "1452")
    try:
        tcp = trio.run(_tcp_client, servers["tcp"].address)
        quic = trio.run(lambda: _quic_client(servers["quic16k"].address, 16384, full=True))
        quic1452 = trio.run(lambda: _quic_client(servers["quic1452"].address, 1452, full=False))
    finally:
        for server in servers.values():
            server.close()

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    rows = [
        ("handshake ms (median)", median(quic.handshake_ms), median(tcp.handshake_ms), None),
        (
            "RTT reused stream ms (median)",
            median(quic.rtt_reused_ms),
            median(tcp.rtt_reused_ms),
            "<= 2.5x TCP",
        ),
        (
            "RTT reused stream ms (p90)",
            percentile(quic.rtt_reused_ms, 0.9),
            percentile(tcp.rtt_reused_ms, 0.9),
            "<= 2.5x TCP",
        ),
        (
            "RTT new stream (unary call) ms (median)",
            median(quic.rtt_new_ms),
            median(tcp.rtt_reused_ms),
            "<= 2.5x TCP",
        ),
        (
            "RTT new stream (unary call) ms (p90)",
            percentile(quic.rtt_new_ms, 0.9),
            percentile(tcp.rtt_reused_ms, 0.9),
            "<= 2.5x TCP",
        ),
        (
            "bulk 64 MiB, 1452 B datagrams, new connection, MB/s",
            quic1452.bulk_cold_mb_s,
            tcp.bulk_cold_mb_s,
            None,
        ),
        ("bulk 64 MiB, 1452 B datagrams, MB/s", quic1452.bulk_mb_s, tcp.bulk_mb_s, ">= 60 MB/s"),
        (
            "bulk 64 MiB, 16 KiB datagrams, new connection, MB/s",
            quic.bulk_cold_mb_s,
            tcp.bulk_cold_mb_s,
            None,
        ),
        ("bulk 64 MiB, 16 KiB datagrams, MB/s", quic.bulk_mb_s, tcp.bulk_mb_s, ">= 400 MB/s"),
        ("8 x 4 MiB concurrent, MB/s", quic.parallel_mb_s, tcp.parallel_mb_s, None),
    ]
    table = [(name, q, t, f"{ratio(q, t):.2f}x", target) for name, q, t, target in rows]
    print_table(
        "transport: QUIC (petals_core) vs trio TCP, separate processes on loopback",
        ["metric", "QUIC", "TCP", "QUIC/TCP", "target"],
        table,
    )
    rtt_quic, rtt_tcp = median(quic.rtt_reused_ms), median(tcp.rtt_reused_ms)
    summarize(
        "transport",
        "RTT reused stream (median), QUIC vs TCP",
        rtt_quic,
        rtt_tcp,
        target="<= 2.5x",
        met=ratio(rtt_quic, rtt_tcp) <= 2.5,
    )
    summarize(
        "transport",
        "bulk 64 MiB, 1452 B datagrams, QUIC vs TCP",
        quic1452.bulk_mb_s,
        tcp.bulk_mb_s,
        unit="MB/s",
        target=">= 60 MB/s",
        met=quic1452.bulk_mb_s >= 60,
    )
    summarize(
        "transport",
        "bulk 64 MiB, 16 KiB datagrams, QUIC vs TCP",
        quic.bulk_mb_s,
        tcp.bulk_mb_s,
        unit="MB/s",
        target=">= 400 MB/s",
        met=quic.bulk_mb_s >= 400,
    )
    write_json(
        "transport",
        {
            name: {"quic": q, "tcp": t, "ratio": ratio(q, t), "target": target}
            for name, q, t, target in rows
        }
        | {
            "raw": {
                "quic": attrs.asdict(quic),
                "quic1452": attrs.asdict(quic1452),
                "tcp": attrs.asdict(tcp),
            }
        },
    )


def _serve_main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--serve", nargs="+", required=True)
    args = parser.parse_args()
    kind, *rest = args.serve
    if kind == "tcp":
        trio.run(_serve_tcp)
    else:
        trio.run(_serve_quic, int(rest[0]))


if __name__ == "__main__":
    _serve_main()
