"""``python -m bench compare --against REF``: whole benchmarks of this tree beside another tree's.

Each named benchmark (``--benchmarks``, by default inference, swarm and api) runs as
``python -m bench NAME`` in a process of its own, once in this tree and once in the project at
git ``REF`` (checked out into a temporary folder), the two taking turns, ``--rounds`` times (the
first tree of each round alternates, so that a drift of the machine's load falls on both).  Each
run's JSON goes to a temporary folder; what is compared is the headline numbers of the summary
table (``bench/results/summary.json``) that both trees report under the same name: per row, the
median over rounds of each tree's own figure, and this tree's over the other's.

Target (a refactoring's): no headline number more than ``--within`` (5%) worse than the other
tree's: times (ms) and overheads (x) at most 1.05 of theirs, rates (tok/s), and ratios whose own
target is a floor (speed-ups, ">= 2x"), at least 0.95.  Rows
that only one tree reports are listed apart.  The table goes to ``bench/results/compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._first_step import checkout
from ._report import print_table, summarize, write_json

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BENCHMARKS = ("inference", "swarm", "api")
#: Longest a single benchmark run may take.
_RUN_TIMEOUT_S = 3600.0
#: Units where more is better; for all others (times, overhead ratios) less is.
_HIGHER_IS_BETTER = ("tok/s", "MB/s", "tokens/s", "/s")

Key = tuple[str, str]


def _run(tree: Path, name: str, results: Path) -> dict[Key, dict[str, Any]]:
    """One ``python -m bench NAME`` in ``tree``: its summary rows by (benchmark, what)."""
    results.mkdir(parents=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "OMP_NUM_THREADS": "1",
        "BENCH_RESULTS": str(results),
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench", name],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
        check=False,
    )
    took = time.monotonic() - started
    summary = results / "summary.json"
    if done.returncode != 0 or not summary.exists():
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"bench {name} in {tree} failed ({done.returncode}):\n{tail}")
    print(f"compare: bench {name} in {tree} took {took:.0f} s", flush=True)
    rows = json.loads(summary.read_text())["results"]["rows"]
    return {(row["benchmark"], row["what"]): row for row in rows}


def _higher_is_better(unit: str, target: str | None) -> bool:
    """Rates, and rows whose own target is a floor (">= 2x"), are better higher."""
    return unit in _HIGHER_IS_BETTER or unit.endswith("/s") or (target or "").startswith(">")


def _worse(ours: float, theirs: float, unit: str, target: str | None = None) -> float:
    """How much worse ours is than theirs, as a factor (above 1: worse)."""
    if _higher_is_better(unit, target):
        return theirs / ours if ours else float("inf")
    return ours / theirs if theirs else float("inf")


def compare(
    against: str, names: Sequence[str], rounds: int, within: float, folder: Path
) -> dict[str, Any]:
    runs: dict[str, list[dict[Key, dict[str, Any]]]] = {"ours": [], "theirs": []}
    with checkout(against) as theirs_tree:
        trees = {"ours": ROOT, "theirs": theirs_tree}
        for index in range(rounds):
            order = ["ours", "theirs"] if index % 2 == 0 else ["theirs", "ours"]
            per_tree: dict[str, dict[Key, dict[str, Any]]] = {"ours": {}, "theirs": {}}
            for name in names:
                for tree in order:
                    out = folder / f"{tree}-{index}-{name}"
                    per_tree[tree].update(_run(trees[tree], name, out))
                # The next benchmark starts with the other tree.
                order.reverse()
            for tree in runs:
                runs[tree].append(per_tree[tree])
    common = [key for key in runs["ours"][0] if all(key in run for run in runs["theirs"])]
    only = sorted(
        {key for run in runs["ours"] + runs["theirs"] for key in run} - set(common),
    )
    rows = []
    for key in common:
        unit = runs["ours"][0][key]["unit"]
        ours = statistics.median(run[key]["ours"] for run in runs["ours"])
        theirs = statistics.median(run[key]["ours"] for run in runs["theirs"])
        worse = _worse(ours, theirs, unit, runs["ours"][0][key].get("target"))
        rows.append(
            {
                "benchmark": key[0],
                "what": key[1],
                "unit": unit,
                "ours": ours,
                "theirs": theirs,
                "worse": worse,
                "met": worse <= 1 + within,
                "ours_rounds": [run[key]["ours"] for run in runs["ours"]],
                "theirs_rounds": [run[key]["ours"] for run in runs["theirs"]],
            }
        )
    return {
        "against": against,
        "rounds": rounds,
        "within": within,
        "rows": rows,
        "only_in_one": [list(key) for key in only],
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__)
    parser.add_argument("--against", required=True, help="git ref of the tree to compare with")
    parser.add_argument(
        "--benchmarks",
        default=",".join(DEFAULT_BENCHMARKS),
        help="comma-separated benchmark names (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs per tree (default: 1)")
    parser.add_argument(
        "--within", type=float, default=0.05, help="largest share worse (default: 0.05)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    names = [name for name in args.benchmarks.split(",") if name]
    if not names or "compare" in names:
        parser.error("--benchmarks names benchmarks other than compare")
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as temp:
        result = compare(args.against, names, args.rounds, args.within, Path(temp))
    target = f"<= {1 + args.within:.2f}x worse"
    print_table(
        f"compare: this tree against {args.against}, medians of {args.rounds} round(s)",
        ["benchmark", "what", "unit", "ours", args.against, "worse by", "target", "met"],
        [
            (
                row["benchmark"],
                row["what"],
                row["unit"],
                row["ours"],
                row["theirs"],
                f"{row['worse']:.3f}x",
                target,
                "yes" if row["met"] else "NO",
            )
            for row in result["rows"]
        ],
    )
    for benchmark, what in result["only_in_one"]:
        print(f"compare: only one tree reports {benchmark}: {what}")
    for row in result["rows"]:
        summarize(
            "compare",
            f"{row['benchmark']}: {row['what']}, vs {args.against}",
            row["ours"],
            row["theirs"],
            unit=row["unit"],
            target=target,
            met=row["met"],
        )
    write_json("compare", result)


if __name__ == "__main__":
    main()
