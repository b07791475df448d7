"""The transport benchmark's tables: QUIC against TCP, the host, and where a round trip and a
bulk transfer go."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._report import print_table, summarize


def report(results: dict[str, Any]) -> None:
    """Print the tables and record the headline numbers for the summary."""
    rows = results["rows"]
    print_table(
        "transport: QUIC (petals_core) vs trio TCP, separate processes on loopback",
        ["metric", "QUIC", "TCP", "QUIC/TCP", "target"],
        [
            (name, row["quic"], row["tcp"], f"{row['ratio']:.2f}x", row["target"])
            for name, row in rows.items()
        ],
    )
    _report_host(results)
    _report_round_trips(results)
    _report_bulk(results)
    rtt = rows["RTT reused stream ms (median)"]
    summarize(
        "transport",
        "RTT reused stream (median), QUIC vs TCP",
        rtt["quic"],
        rtt["tcp"],
        target="<= 2.5x",
        met=rtt["ratio"] <= 2.5,
    )
    for label, target_mb_s in (("1452 B", 60), ("16 KiB", 400)):
        row = rows[f"bulk, {label} datagrams, MB/s"]
        summarize(
            "transport",
            f"bulk, {label} datagrams, QUIC vs TCP",
            row["quic"],
            row["tcp"],
            unit="MB/s",
            target=f">= {target_mb_s} MB/s",
            met=row["quic"] >= target_mb_s,
        )


def _report_host(results: dict[str, Any]) -> None:
    host = results["host"]
    print_table(
        "host: the CPU alone (QUIC: both endpoints in one process, no sockets)",
        ["what", "value"],
        list(host["cpu"].items()) + [(f"QUIC {k}", v) for k, v in host["quic_cpu_us"].items()],
    )
    print_table(
        "host: microseconds per call (median of 5 loops)",
        ["call", "µs"],
        [(name, "n/a" if us is None else us) for name, us in host["syscall_us"].items()],
    )
    print_table(
        "host: how late trio wakes, µs past the deadline",
        ["wait", "median", "p90"],
        [(name, late["median"], late["p90"]) for name, late in host["timer_late_us"].items()],
    )


Side = dict[str, Any]  # what one side of a phase spent (a process tally and its node's counters)


def _counter(name: str) -> Callable[[Side], Any]:
    return lambda side: side["node"][name]


def _cpu(scale: float) -> Callable[[Side], float]:
    return lambda side: (side["user_s"] + side["system_s"]) * scale


def _wait(scale: float) -> Callable[[Side], float]:
    return lambda side: side.get("run_queue_wait_s", float("nan")) * scale


_NODE_ROWS = [
    ("datagrams sent", _counter("datagrams_sent")),
    ("send calls", _counter("send_calls")),
    ("datagrams received", _counter("datagrams_received")),
    ("receive calls", _counter("receive_calls")),
    ("  that found nothing", _counter("empty_receives")),
    ("pump wake-ups", _counter("pump_wakeups")),
    ("  by a timer", _counter("timer_wakeups")),
]
_ROUND_TRIP_ROWS = [
    ("CPU µs, user + system", _cpu(1e6)),
    ("  of which system", lambda side: side["system_s"] * 1e6),
    ("run-queue wait µs", _wait(1e6)),
    ("trio scheduler rounds", lambda side: side["scheduler_rounds"]),
    ("  of which could block", lambda side: side["blocking_rounds"]),
    ("context switches", lambda side: side["voluntary_switches"] + side["involuntary_switches"]),
    *_NODE_ROWS,
]
_BULK_ROWS = [
    ("CPU ms, user + system", _cpu(1e3)),
    ("run-queue wait ms", _wait(1e3)),
    ("trio scheduler rounds", lambda side: side["scheduler_rounds"]),
    ("blocked sends", _counter("blocked_sends")),
    *_NODE_ROWS,
]


def _report_round_trips(results: dict[str, Any]) -> None:
    columns = results["per_round_trip"]
    header = ["per round trip"]
    for name in columns:
        header += [f"{name}: client", "server"]
    table = []
    for label, read in _ROUND_TRIP_ROWS:
        row: list[Any] = [label]
        for sides in columns.values():
            for side in ("client", "server"):
                try:
                    row.append(read(sides[side]))
                except KeyError:
                    row.append(None)
        table.append(row)
    print_table(
        "plain UDP through trio, in the pump's style, round trip ms",
        ["what", "ms"],
        list(results["udp_rtt_ms"].items()),
    )
    print_table("where a round trip goes (each side, per round trip)", header, table)


def _report_bulk(results: dict[str, Any]) -> None:
    header = ["warm bulk, per 1000 datagrams sent"]
    table: list[list[Any]] = []
    columns = results["bulk"]
    for name in columns:
        header += [f"{name}: sender", "receiver"]
    for label, read in _BULK_ROWS:
        row: list[Any] = [label]
        for bulk in columns.values():
            sent = bulk["client"]["node"]["datagrams_sent"] / 1000
            row += [read(bulk["client"]) / sent, read(bulk["server"]) / sent]
        table.append(row)
    for label, read_bulk in (
        (
            "wire bytes per payload byte",
            lambda b: b["client"]["node"]["bytes_sent"] / b["payload_bytes"],
        ),
        ("receiver's socket drops (run)", lambda b: b["server_drops"]),
        ("segmentation offload", lambda b: b["client"]["node"]["segmentation_offload"]),
        ("receive offload", lambda b: b["server"]["node"]["receive_offload"]),
    ):
        row = [label]
        for bulk in columns.values():
            row += [read_bulk(bulk), None]
        table.append(row)
    print_table("where a bulk transfer goes", header, table)
