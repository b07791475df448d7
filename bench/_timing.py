"""Timing that is fair to both sides: calls measured in alternating rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from ._report import median, percentile


@attrs.frozen(kw_only=True)
class Timing:
    """Samples (ms) of one operation."""

    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return median(self.samples_ms)

    @property
    def p90_ms(self) -> float:
        return percentile(self.samples_ms, 0.9)

    def summary(self) -> dict[str, float]:
        return {
            "median_ms": self.median_ms,
            "p90_ms": self.p90_ms,
            "mean_ms": statistics.fmean(self.samples_ms),
            "samples": len(self.samples_ms),
        }


def interleaved(
    calls: Mapping[str, Callable[[], object]],
    *,
    warmup: int,
    rounds: int,
    per_round: int,
    each_round: Sequence[Callable[[], object]] = (),
) -> dict[str, Timing]:
    """Time each call alone (ms), ``per_round`` times per round, the calls taking turns.

    Each call first runs ``warmup`` untimed times.  Taking turns spreads any drift of the
    machine's load over every call alike.  ``each_round`` (untimed here: they keep their own
    samples) run once at the end of every round.
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(per_round):
                start = time.perf_counter()
                call()
                samples[name].append((time.perf_counter() - start) * 1e3)
        for extra in each_round:
            extra()
    return {name: Timing(samples_ms=tuple(values)) for name, values in samples.items()}
