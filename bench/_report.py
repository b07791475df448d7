"""Tables on stdout and JSON under ``bench/results/``: what every benchmark reports through."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

#: Where JSON goes: ``bench/results``, or the folder ``BENCH_RESULTS`` names (a GPU machine's
#: ``$OUT``, whose files come back even when the run is cut short).
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def document(name: str, results: dict[str, Any]) -> dict[str, Any]:
    """What a benchmark's JSON holds: its name, when, where, and its results."""
    return {
        "benchmark": name,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "results": results,
    }


def write_json(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(document(name, results), indent=2))
    print(f"\nwrote {path}")
    return path


# -- the summary: one row per headline number, printed once after all benchmarks ran -----------


@attrs.frozen(kw_only=True)
class SummaryRow:
    """One headline number of a benchmark: ours, what it is compared with, and the target."""

    benchmark: str
    #: What the row compares, e.g. "RTT reused stream, QUIC vs TCP".
    what: str
    ours: float
    baseline: float | None = None
    unit: str = "ms"
    #: The goal in words, e.g. "<= 2.5x" or ">= 60 MB/s".
    target: str | None = None
    #: Whether the target was met; None where there is no target or it cannot be judged.
    met: bool | None = None

    @property
    def ratio(self) -> float | None:
        """ours / baseline, None without a baseline (or a zero one)."""
        if self.baseline is None or self.baseline == 0:
            return None
        return self.ours / self.baseline


_SUMMARY: list[SummaryRow] = []


def summarize(
    benchmark: str,
    what: str,
    ours: float,
    baseline: float | None = None,
    *,
    unit: str = "ms",
    target: str | None = None,
    met: bool | None = None,
) -> SummaryRow:
    """Record a headline number for the summary table printed after every benchmark ran."""
    row = SummaryRow(
        benchmark=benchmark,
        what=what,
        ours=float(ours),
        baseline=None if baseline is None else float(baseline),
        unit=unit,
        target=target,
        met=met,
    )
    _SUMMARY.append(row)
    return row


def summarize_ratio(
    benchmark: str, what: str, ours: float, baseline: float, *, at_most: float
) -> SummaryRow:
    """Record a headline number whose target is at most ``at_most`` times its baseline."""
    return summarize(
        benchmark,
        what,
        ours,
        baseline,
        target=f"<= {at_most}x",
        met=ours <= at_most * baseline,
    )


def summary_rows() -> list[SummaryRow]:
    """The rows recorded so far, in the order the benchmarks recorded them."""
    return list(_SUMMARY)


def _met_cell(met: bool | None) -> str | None:
    return None if met is None else ("yes" if met else "NO")


def print_summary() -> None:
    """The one table at the end of ``python -m bench``: every benchmark's headline numbers."""
    if not _SUMMARY:
        print("\nSummary: no benchmark recorded a headline number")
        return
    print_table(
        "Summary",
        ["benchmark", "what it compares", "unit", "ours", "baseline", "ratio", "target", "met"],
        [
            (
                row.benchmark,
                row.what,
                row.unit,
                row.ours,
                row.baseline,
                None if row.ratio is None else f"{row.ratio:.2f}x",
                row.target,
                _met_cell(row.met),
            )
            for row in _SUMMARY
        ],
    )
    judged = [row for row in _SUMMARY if row.met is not None]
    if judged:
        print(f"targets met: {sum(row.met is True for row in judged)} of {len(judged)}")


def write_summary() -> Path:
    """``bench/results/summary.json``: the summary rows, with their ratios."""
    return write_json(
        "summary",
        {"rows": [attrs.asdict(row) | {"ratio": row.ratio} for row in _SUMMARY]},
    )
