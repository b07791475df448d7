"""Transport benchmark: QUIC (ours) against trio TCP, client and server in separate processes.

Measures, in one run and on loopback: handshake time; small-message round trip (median and p90) on
a reused stream and on a new stream per message (a unary call); bulk throughput on one stream at
1452-byte and at 16 KiB datagrams, first on a new connection (slow start included) and then again
on the now warm connection (the steady state a long-lived peer connection sees); 8 streams at
once.  TCP does the same work over plain trio TCP connections (no TLS): one connection for
"reused", one connection per bulk stream, and a fresh connection for the handshake row.

Then where the time goes, so that a slow host can be told from slow code:

* the host: microseconds per system call of what the node does per datagram, how late trio's
  timers fire, and plain UDP round trips through trio in the pump's style (no QUIC);
* per round trip (plain UDP, TCP, QUIC on a reused stream, a unary call), on each side: CPU time,
  run-queue wait, trio scheduler rounds, datagrams, socket calls, pump wake-ups and how many of
  those a timer caused;
* per datagram of the warm bulk transfers: each side's CPU time, datagrams per socket call, pump
  wake-ups, timer wake-ups, acknowledgements, drops.

``python -m bench transport`` (or ``nox -s bench -- transport``) runs it;
``python -m bench.transport --quick`` runs a smaller version (about a quarter of the work), and
``--no-offload`` keeps the QUIC nodes to one datagram per system call.  Other benchmarks call
:func:`measure` and :func:`report`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from petals_core.transport import Connection, Multiaddr, Node, call_unary, open_node

from ._report import median, percentile, write_json
from ._transport_probes import (
    TALLY,
    IoWaits,
    cpu_speed,
    difference,
    process_tally,
    quic_cpu,
    sleep_overshoot,
    syscall_costs,
    timer_overshoot,
    udp_drops,
    udp_ping_pong,
)
from ._transport_report import report
from ._transport_servers import Server, node_config

__all__ = ["measure", "report"]

MESSAGE = 64
# How long the plain UDP server computes before answering, in the second UDP row: about what a
# QUIC peer spends on a round trip, so the client idles as long as it does against QUIC.
SERVER_WORK_US = 250
PARALLEL = 8
CHUNK = 1 << 20


@attrs.frozen(kw_only=True)
class Sizes:
    """How much work each part does."""

    rtt_rounds: int
    handshakes: int
    bulk_bytes: int
    parallel_bytes: int


FULL = Sizes(rtt_rounds=2000, handshakes=30, bulk_bytes=64 << 20, parallel_bytes=4 << 20)

QUICK = Sizes(rtt_rounds=500, handshakes=10, bulk_bytes=16 << 20, parallel_bytes=1 << 20)

#: A check of the benchmark itself (its numbers mean little): ``bench gpu --dry-run``.
TINY = Sizes(rtt_rounds=50, handshakes=2, bulk_bytes=2 << 20, parallel_bytes=1 << 20)


@attrs.define
class Results:
    handshake_ms: list[float] = attrs.Factory(list)
    rtt_reused_ms: list[float] = attrs.Factory(list)
    rtt_new_ms: list[float] = attrs.Factory(list)
    bulk_cold_mb_s: float = 0.0
    bulk_mb_s: float = 0.0
    parallel_mb_s: float = 0.0
    #: Per round trip, what each side spent: {"reused" | "unary": {"client", "server"}}.
    per_round_trip: dict[str, dict[str, Any]] = attrs.Factory(dict)
    #: What each side spent over the warm bulk transfer: {"client", "server", ...}.
    bulk: dict[str, Any] = attrs.Factory(dict)


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


async def _read_to_end(stream: Any) -> bytes:
    parts = []
    while data := await stream.receive_some():
        parts.append(data)
    return b"".join(parts)


async def _server_tally(connection: Connection) -> dict[str, Any]:
    stream = await connection.open_stream()
    await stream.send_all(TALLY, eof=True)
    tally: dict[str, Any] = json.loads(await _read_to_end(stream))
    await stream.aclose()
    return tally


class _Tallies:
    """Both sides' totals, before and after a phase of a QUIC client."""

    def __init__(self, node: Node, connection: Connection, io_waits: IoWaits) -> None:
        self._node = node
        self._connection = connection
        self._io_waits = io_waits

    async def take(self) -> tuple[dict[str, Any], dict[str, Any]]:
        server = await _server_tally(self._connection)
        client = process_tally(self._io_waits) | {"node": attrs.asdict(self._node.statistics())}
        return client, server

    async def since(
        self, before: tuple[dict[str, Any], dict[str, Any]], per: float, server_node: str
    ) -> dict[str, Any]:
        client, server = await self.take()
        server_diff = difference(server, before[1], per)
        return {
            "client": difference(client, before[0], per),
            "server": {k: v for k, v in server_diff.items() if k not in ("raw", "rpc")}
            | {"node": server_diff[server_node]},
        }


async def _quic_client(
    address: str, datagram: int, sizes: Sizes, *, full: bool, offload: bool
) -> Results:
    io_waits = IoWaits()
    trio.lowlevel.add_instrument(io_waits)
    results = Results()
    raw_address, rpc_address = address.split()
    target = Multiaddr.parse(raw_address)
    async with open_node(config=node_config(datagram, offload=offload)) as node:
        if full:
            for _ in range(sizes.handshakes):
                start = trio.current_time()
                connection = await node.connect(target)
                results.handshake_ms.append((trio.current_time() - start) * 1e3)
                await connection.aclose()
        connection = await node.connect(target)
        tallies = _Tallies(node, connection, io_waits)
        if full:
            stream = await connection.open_stream()
            await stream.send_all(b"e")
            await _echo_rounds(stream.send_all, stream.receive_some, sizes.rtt_rounds // 10)
            before = await tallies.take()
            results.rtt_reused_ms = await _echo_rounds(
                stream.send_all, stream.receive_some, sizes.rtt_rounds
            )
            results.per_round_trip["reused"] = await tallies.since(before, sizes.rtt_rounds, "raw")
            await stream.send_eof()
            assert await stream.receive_some() == b""
            await stream.aclose()
            payload = {"p": bytes(MESSAGE)}
            rpc_connection = await node.connect(rpc_address)
            calls = sizes.rtt_rounds // 2
            for _ in range(calls // 10):
                await call_unary(rpc_connection, "ping", payload)
            before = await tallies.take()
            for _ in range(calls):
                start = trio.current_time()
                await call_unary(rpc_connection, "ping", payload)
                results.rtt_new_ms.append((trio.current_time() - start) * 1e3)
            results.per_round_trip["unary"] = await tallies.since(before, calls, "rpc")
        await _bulk(connection.open_stream, results, sizes, parallel=full, tallies=tallies)
        results.bulk["server_drops"] = udp_drops(target.port)
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
    open_stream: Callable[[], Awaitable[Any]],
    results: Results,
    sizes: Sizes,
    *,
    parallel: bool,
    tallies: _Tallies | None = None,
) -> None:
    """Cold and warm transfers, then (if asked) 8 at once."""
    start = trio.current_time()
    await _sink(open_stream, sizes.bulk_bytes)
    results.bulk_cold_mb_s = _mb_s(sizes.bulk_bytes, trio.current_time() - start)
    before = None if tallies is None else await tallies.take()
    start = trio.current_time()
    await _sink(open_stream, sizes.bulk_bytes)
    results.bulk_mb_s = _mb_s(sizes.bulk_bytes, trio.current_time() - start)
    if tallies is not None and before is not None:
        results.bulk = await tallies.since(before, 1, "raw")
        results.bulk["payload_bytes"] = sizes.bulk_bytes
    if parallel:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(PARALLEL):
                nursery.start_soon(_sink, open_stream, sizes.parallel_bytes)
        results.parallel_mb_s = _mb_s(PARALLEL * sizes.parallel_bytes, trio.current_time() - start)


async def _tcp_client(address: str, sizes: Sizes) -> Results:
    io_waits = IoWaits()
    trio.lowlevel.add_instrument(io_waits)
    host, port = address.rsplit(":", 1)
    results = Results()

    async def connect() -> trio.SocketStream:
        stream = await trio.open_tcp_stream(host, int(port))
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY
        return stream

    async def server_tally() -> dict[str, Any]:
        stream = await connect()
        await stream.send_all(TALLY)
        tally: dict[str, Any] = json.loads(await _read_to_end(stream))
        await stream.aclose()
        return tally

    for _ in range(sizes.handshakes):
        start = trio.current_time()
        stream = await connect()
        results.handshake_ms.append((trio.current_time() - start) * 1e3)
        await stream.aclose()
    stream = await connect()
    await stream.send_all(b"e")
    await _echo_rounds(stream.send_all, stream.receive_some, sizes.rtt_rounds // 10)
    server_before, client_before = await server_tally(), process_tally(io_waits)
    results.rtt_reused_ms = await _echo_rounds(
        stream.send_all, stream.receive_some, sizes.rtt_rounds
    )
    client_after, server_after = process_tally(io_waits), await server_tally()
    results.per_round_trip["reused"] = {
        "client": difference(client_after, client_before, sizes.rtt_rounds),
        "server": difference(server_after, server_before, sizes.rtt_rounds),
    }
    await stream.aclose()

    await _bulk(connect, results, sizes, parallel=True)
    return results


async def _udp_client(address: str, sizes: Sizes) -> dict[str, Any]:
    io_waits = IoWaits()
    trio.lowlevel.add_instrument(io_waits)
    plain = await udp_ping_pong(
        address, rounds=sizes.rtt_rounds, message=MESSAGE, io_waits=io_waits
    )
    working = await udp_ping_pong(
        address,
        rounds=sizes.rtt_rounds // 4,
        message=MESSAGE,
        io_waits=io_waits,
        server_work_us=SERVER_WORK_US,
    )
    return plain | {"rtt_with_work_ms": working["rtt_ms"]}


def measure(*, quick: bool = False, offload: bool = True, tiny: bool = False) -> dict[str, Any]:
    """Run every part; the results as one JSON-ready dict (what :func:`report` prints).
    ``tiny``: the fewest rounds and bytes that exercise every part (implies ``quick``)."""
    quick = quick or tiny
    sizes = TINY if tiny else QUICK if quick else FULL
    flag = "offload" if offload else "no-offload"
    servers = {
        "tcp": Server("tcp"),
        "udp": Server("udp"),
        "quic16k": Server("quic", "16384", flag),
        "quic1452": Server("quic", "1452", flag),
    }
    try:
        host = {
            "cpu": cpu_speed(),
            "quic_cpu_us": quic_cpu(quick=quick),
            "syscall_us": syscall_costs(quick=quick),
            "timer_late_us": trio.run(lambda: timer_overshoot(quick=quick))
            | sleep_overshoot(quick=quick),
        }
        udp = trio.run(_udp_client, servers["udp"].address, sizes)
        tcp = trio.run(_tcp_client, servers["tcp"].address, sizes)
        quic = trio.run(
            lambda: _quic_client(
                servers["quic16k"].address, 16384, sizes, full=True, offload=offload
            )
        )
        quic1452 = trio.run(
            lambda: _quic_client(
                servers["quic1452"].address, 1452, sizes, full=False, offload=offload
            )
        )
    finally:
        for server in servers.values():
            server.close()
    return {
        "sizes": attrs.asdict(sizes),
        "offload": offload,
        "rows": _rows(quic, quic1452, tcp),
        "host": host,
        "udp_rtt_ms": {
            "median": median(udp["rtt_ms"]),
            "p90": percentile(udp["rtt_ms"], 0.9),
            f"median, less {SERVER_WORK_US} µs of server work": median(udp["rtt_with_work_ms"])
            - SERVER_WORK_US / 1e3,
        },
        "per_round_trip": {
            "udp": {"client": udp["client"], "server": udp["server"]},
            "tcp": tcp.per_round_trip["reused"],
            "quic reused stream": quic.per_round_trip["reused"],
            "quic unary call": quic.per_round_trip["unary"],
        },
        "bulk": {"1452 B": quic1452.bulk, "16 KiB": quic.bulk},
        "raw": {
            "quic": attrs.asdict(quic, filter=_plain),
            "quic1452": attrs.asdict(quic1452, filter=_plain),
            "tcp": attrs.asdict(tcp, filter=_plain),
        },
    }


def _plain(attribute: attrs.Attribute[Any], value: Any) -> bool:
    return attribute.name not in ("per_round_trip", "bulk")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _median_and_p90(
    what: str, quic_ms: list[float], tcp_ms: list[float]
) -> list[tuple[str, float, float, str]]:
    """Rows of round-trip samples against TCP's, whose target is at most 2.5x TCP."""
    return [
        (f"{what} ms (median)", median(quic_ms), median(tcp_ms), "<= 2.5x TCP"),
        (f"{what} ms (p90)", percentile(quic_ms, 0.9), percentile(tcp_ms, 0.9), "<= 2.5x TCP"),
    ]


def _rows(quic: Results, quic1452: Results, tcp: Results) -> dict[str, dict[str, Any]]:
    rows = [
        ("handshake ms (median)", median(quic.handshake_ms), median(tcp.handshake_ms), None),
        *_median_and_p90("RTT reused stream", quic.rtt_reused_ms, tcp.rtt_reused_ms),
        *_median_and_p90("RTT new stream (unary call)", quic.rtt_new_ms, tcp.rtt_reused_ms),
        (
            "bulk, 1452 B datagrams, new connection, MB/s",
            quic1452.bulk_cold_mb_s,
            tcp.bulk_cold_mb_s,
            None,
        ),
        ("bulk, 1452 B datagrams, MB/s", quic1452.bulk_mb_s, tcp.bulk_mb_s, ">= 60 MB/s"),
        (
            "bulk, 16 KiB datagrams, new connection, MB/s",
            quic.bulk_cold_mb_s,
            tcp.bulk_cold_mb_s,
            None,
        ),
        ("bulk, 16 KiB datagrams, MB/s", quic.bulk_mb_s, tcp.bulk_mb_s, ">= 400 MB/s"),
        ("8 streams at once, MB/s", quic.parallel_mb_s, tcp.parallel_mb_s, None),
    ]
    return {
        name: {"quic": q, "tcp": t, "ratio": _ratio(q, t), "target": target}
        for name, q, t, target in rows
    }


def main(*, quick: bool = False, offload: bool = True) -> None:
    results = measure(quick=quick, offload=offload)
    report(results)
    write_json("transport", results)


def _command_line() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.transport", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about a quarter of the work")
    parser.add_argument(
        "--no-offload", action="store_true", help="one datagram per system call in QUIC nodes"
    )
    args = parser.parse_args()
    main(quick=args.quick, offload=not args.no_offload)


if __name__ == "__main__":
    _command_line()
