"""``python -m bench gpu --dry-run``: every phase of the GPU benchmark on the CPU at its smallest
sizes, one phase killed at its limit, as a GPU run cut short would be.  The numbers mean nothing;
what is checked is that each phase runs, records what it measured, and is judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_dry_run_keeps_what_each_phase_measured_and_judges_every_target(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "BENCH_RESULTS": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "bench", "gpu", "--dry-run", "--limit", "swarm-bloom=3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # the GPU targets are not measured on a CPU
    results = json.loads((tmp_path / "gpu-dry-run.json").read_text())["results"]
    phases = results["phases"]
    statuses = {phase: entry["status"] for phase, entry in phases.items()}
    assert statuses == {
        "tests": "done",
        "kernels": "done",
        "trust": "done",
        "swarm-llama": "done",
        "swarm-bloom": "killed at its limit of 3 s",
        "transport": "done",
        "api": "done",
    }, output
    # What each phase recorded, the killed one's included (what it had by then).
    assert phases["tests"]["data"]["counts"]["skipped"] > 0  # CUDA tests, on a CPU
    parity = phases["kernels"]["data"]["parity"]
    assert parity and all(row["ok"] for row in parity)
    assert {"sdpa, forced", "triton decode, forced", "triton prefill, forced"} <= {
        row["path"] for row in parity
    }
    honest = phases["trust"]["data"]["honest"]
    assert set(honest) == {"float32", "bfloat16", "float16"}
    assert all(entry["answers"] > 0 and entry["beyond_bound"] == 0 for entry in honest.values())
    llama = phases["swarm-llama"]["data"]
    assert llama["fp32"]["greedy_equal"] and llama["concurrency"]
    assert "fp32" not in phases["swarm-bloom"].get("data", {})
    assert phases["transport"]["data"]["headline"]["rtt_quic_ms"] > 0
    assert phases["api"]["data"]["per_token_ms"]["http_stream"] > 0
    # Every target is judged, and printed with its status.
    verdicts = {v["what"]: v["status"] for v in results["targets"]}
    assert verdicts["llama: fp32 greedy tokens equal"] == "MET"
    assert verdicts["kernel parity rows off their bound"] == "MET"
    assert verdicts["bloom: fp32 greedy tokens equal"] == "NOT MEASURED"
    assert verdicts["CUDA tests failing"] == "NOT MEASURED"
    assert verdicts["trust: honest GPU answers beyond the check's bound (CPU replays)"] == (
        "NOT MEASURED"  # the answers came from the CPU too
    )
    assert verdicts["decode attention B8 S16k, fraction of peak"] == "NOT MEASURED"
    assert verdicts["llama: 32 sessions vs one, tokens/s"] == "NOT MEASURED"  # 1 and 4 here
    assert {"transport RTT, QUIC / trio TCP", "api: ms/token, HTTP streaming vs generate()"} <= set(
        verdicts
    )
    assert "NOT MEASURED" in result.stdout and "targets:" in result.stdout
