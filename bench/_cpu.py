"""CPU accounting from ``/proc/<pid>/task/*/schedstat`` (Linux): CPU time and run-queue wait of
the processes taking part, per step."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs


@attrs.frozen(kw_only=True)
class SchedTotals:
    """Nanoseconds the threads of some processes ran on a CPU, and waited for one."""

    cpu_ns: int
    wait_ns: int

    def __sub__(self, other: SchedTotals) -> SchedTotals:
        return SchedTotals(cpu_ns=self.cpu_ns - other.cpu_ns, wait_ns=self.wait_ns - other.wait_ns)


def sched_totals(pid: int) -> SchedTotals:
    """The sum over every thread of ``pid`` of ``/proc/<pid>/task/<tid>/schedstat`` (Linux):
    time on a CPU and time runnable but waiting in a run queue.

    The wait is what a busy machine adds: a process woken by a packet or a thread woken by a
    result waits there until a CPU is free.  Threads that ended meanwhile are not counted.
    """
    cpu = wait = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended
        cpu += int(fields[0])
        wait += int(fields[1])
    return SchedTotals(cpu_ns=cpu, wait_ns=wait)


def schedstat_available() -> bool:
    return Path(f"/proc/{os.getpid()}/task").is_dir() and any(
        (task / "schedstat").is_file() for task in Path(f"/proc/{os.getpid()}/task").iterdir()
    )


@attrs.frozen(kw_only=True)
class CpuPerToken:
    """Per decode token (ms): wall time, CPU time of each process, run-queue wait of all."""

    wall_ms: float
    #: Process name ("client", "local", "server 0:4", ...) -> CPU ms per token.
    cpu_ms: Mapping[str, float]
    wait_ms: float

    @property
    def total_cpu_ms(self) -> float:
        return sum(self.cpu_ms.values())

    def summary(self) -> dict[str, Any]:
        return {"wall_ms": self.wall_ms, "cpu_ms": dict(self.cpu_ms), "wait_ms": self.wait_ms}


def cpu_per_token(
    step: Callable[[], object], processes: Mapping[str, int], *, rounds: int, per_round: int
) -> CpuPerToken:
    """Run ``step`` ``rounds * per_round`` times; wall, CPU and run-queue wait per step of the
    named processes (sampled around each round, so that reading ``/proc`` is not counted)."""
    wall = 0.0
    used = dict.fromkeys(processes, SchedTotals(cpu_ns=0, wait_ns=0))
    for _ in range(rounds):
        before = {name: sched_totals(pid) for name, pid in processes.items()}
        start = time.perf_counter()
        for _ in range(per_round):
            step()
        wall += time.perf_counter() - start
        for name, pid in processes.items():
            delta = sched_totals(pid) - before[name]
            used[name] = SchedTotals(
                cpu_ns=used[name].cpu_ns + delta.cpu_ns,
                wait_ns=used[name].wait_ns + delta.wait_ns,
            )
    steps = rounds * per_round
    return CpuPerToken(
        wall_ms=wall * 1e3 / steps,
        cpu_ms={name: totals.cpu_ns / 1e6 / steps for name, totals in used.items()},
        wait_ms=sum(totals.wait_ns for totals in used.values()) / 1e6 / steps,
    )
