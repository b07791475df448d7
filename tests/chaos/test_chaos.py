"""Failover at CI size: the chaos runner (``tests/chaos/chaos_run.py``) with two generations where
a server is killed (SIGKILL) at a random step, one where a server stops answering (SIGSTOP), and
one fine-tuning step where a server dies between forward and backward, on a swarm of 4 processes
that holds every block twice.  Every session completes with the output of the same session
without faults.  The full run is ``python -m tests.chaos.chaos_run --generations 20``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from .chaos_run import ChaosConfig, run_chaos


async def test_sessions_survive_kills_and_stalls_with_identical_outputs(tmp_path: Path) -> None:
    lines: list[str] = []
    config = ChaosConfig(generations=2, stalls=1, finetune_steps=1, seed=1, deadline_s=280.0)
    report = await run_chaos(config, work_dir=tmp_path, log=lines.append)
    print("\n".join([*lines, report.summary()]))  # shown when the test fails

    assert report.references == 3
    assert report.references_equal_local == 3
    assert [(o.kind, o.fault) for o in report.outcomes if o.kind == "finetune"] == [
        ("finetune", "kill")
    ]
    assert sorted(o.fault for o in report.outcomes if o.kind == "generation") == [
        "kill",
        "kill",
        "stall",
    ]
    # Each fault struck a server of the session's route, and nothing was lost.
    assert all(o.victim is not None for o in report.outcomes)
    assert [o.result for o in report.outcomes] == ["equal"] * 4, report.summary()
    assert (report.kills, report.stalls) == (3, 1)
    assert report.lost == 0
    # With the default timeouts, a dead or stopped server is noticed by the transport, not by
    # request_timeout_s (180 s) or the connection's idle timeout (60 s).
    times = report.recovery_times()
    assert sorted(times) == ["kill", "stall"] and len(times["kill"]) == 2
    assert max(max(t) for t in times.values()) < 30, report.summary()


@pytest.mark.parametrize("family", ["falcon", "mixtral"])
async def test_other_families_survive_a_kill_with_identical_outputs(
    tmp_path: Path, family: Literal["falcon", "mixtral"]
) -> None:
    """The same on a tiny Falcon of Falcon-7B's layout and a tiny Mixtral: a generation whose
    server is killed, and a fine-tuning step whose server dies between forward and backward."""
    lines: list[str] = []
    config = ChaosConfig(
        generations=1, stalls=0, finetune_steps=1, seed=2, family=family, deadline_s=280.0
    )
    report = await run_chaos(config, work_dir=tmp_path, log=lines.append)
    print("\n".join([*lines, report.summary()]))

    assert report.references == report.references_equal_local == 1
    assert [(o.kind, o.fault) for o in report.outcomes] == [
        ("generation", "kill"),
        ("finetune", "kill"),
    ]
    assert all(o.victim is not None for o in report.outcomes)
    assert [o.result for o in report.outcomes] == ["equal"] * 2, report.summary()
    assert report.lost == 0
