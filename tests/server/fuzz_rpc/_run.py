"""Running the fuzzing: a server on a trio thread, hypothesis in the calling one."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Final

import attrs
import hypothesis
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from ...models.conftest import TinyCheckpoint
from .._client import connect, serve
from ._harness import Case, Harness
from ._strategies import cases
from ._wire import ATTN_CACHE_TOKENS, BLOCKS, LIMITS

#: Examples per hypothesis run (see :func:`run_fuzz`).
CHUNK_EXAMPLES: Final = 500


@attrs.frozen(kw_only=True)
class FuzzReport:
    """What a run did: examples run (shrinking included), outcome counts, RSS in bytes."""

    examples: int
    outcomes: dict[str, int]
    rss_before_bytes: int
    rss_after_bytes: int
    rss_peak_bytes: int
    #: RSS after each hypothesis run (of CHUNK_EXAMPLES): a leak grows steadily, allocator
    #: slack levels off.
    rss_samples_bytes: tuple[int, ...]
    #: Times the canary session was reopened (it idled past its step timeout on a loaded
    #: machine; any other way for it to end fails the run).
    canary_reopened: int
    elapsed_s: float

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_after_bytes - self.rss_before_bytes


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Collect(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self._records = records

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        self._records.append(record)


async def _host(checkpoint: TinyCheckpoint, cache_dir: Path, handoff: queue.Queue[Any]) -> None:
    async with (
        serve(
            checkpoint,
            cache_dir,
            blocks=BLOCKS,
            limits=LIMITS,
            attn_cache_tokens=ATTN_CACHE_TOKENS,
        ) as server,
        connect(server) as connection,
    ):
        harness = Harness(server, connection)
        with trio.fail_after(60):
            await harness.open_canary()
        handoff.put((harness, trio.lowlevel.current_trio_token()))
        await harness.stop.wait()
        with trio.fail_after(60):
            await harness.close_canary()


def _run_chunk(
    harness: Harness,
    token: trio.lowlevel.TrioToken,
    strategy: st.SearchStrategy[Case],
    examples: int,
    seed: int,
    outcomes: collections.Counter[str],
) -> None:
    @hypothesis.seed(seed)
    @settings(
        max_examples=examples,
        # The explicit seed decides the examples everywhere: hypothesis' CI profile (when CI is
        # set) would otherwise derandomize from the test's source and draw other ones.
        derandomize=False,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=strategy)
    def example(case: Case) -> None:
        outcome = trio.from_thread.run(harness.run_case, case, trio_token=token)
        outcomes[f"{type(case).__name__}:{outcome}"] += 1

    example()


def run_fuzz(
    checkpoint: TinyCheckpoint,
    cache_dir: Path,
    *,
    max_examples: int,
    strategy: st.SearchStrategy[Case] | None = None,
) -> FuzzReport:
    """Run ``max_examples`` hypothesis examples against a fresh server, in runs of at most
    :data:`CHUNK_EXAMPLES` (run ``i`` with seed ``i``: the same examples every time); raises
    the first broken invariant, shrunk.

    Hypothesis keeps every example of a run for shrinking (about 13 KiB each here), so one run
    of 10000 would grow the process by ~130 MB that is not the server's; separate runs give
    that memory back, and what still grows from run to run is the server's.
    """
    handoff: queue.Queue[Any] = queue.Queue()
    failures: list[BaseException] = []

    def trio_thread() -> None:
        try:
            trio.run(_host, checkpoint, cache_dir, handoff)
        except BaseException as exc:
            failures.append(exc)
            handoff.put(exc)

    thread = threading.Thread(target=trio_thread, name="fuzz-server", daemon=True)
    thread.start()
    started = handoff.get(timeout=300)
    if isinstance(started, BaseException):
        raise started
    harness, token = started
    collector = _Collect(harness.errors_logged)
    logging.getLogger("petals_core").addHandler(collector)
    outcomes: collections.Counter[str] = collections.Counter()
    samples: list[int] = []
    began = time.monotonic()
    try:
        rss_before = _status_bytes("VmRSS")
        for index, first in enumerate(range(0, max_examples, CHUNK_EXAMPLES)):
            _run_chunk(
                harness,
                token,
                strategy or cases(),
                min(CHUNK_EXAMPLES, max_examples - first),
                index,
                outcomes,
            )
            samples.append(_status_bytes("VmRSS"))
        rss_after = _status_bytes("VmRSS")
    finally:
        logging.getLogger("petals_core").removeHandler(collector)
        try:
            trio.from_thread.run_sync(harness.stop.set, trio_token=token)
        except trio.RunFinishedError:
            pass
        thread.join(timeout=120)
    if failures:
        raise failures[0]
    return FuzzReport(
        examples=sum(outcomes.values()),
        outcomes=dict(outcomes),
        rss_before_bytes=rss_before,
        rss_after_bytes=rss_after,
        rss_peak_bytes=_status_bytes("VmHWM"),
        rss_samples_bytes=tuple(samples),
        canary_reopened=harness.canary_reopened,
        elapsed_s=time.monotonic() - began,
    )
