"""The server's compute pool: blocking work runs in worker threads, most urgent first.

Transformer blocks run as ordinary blocking (torch) calls.  They must not run on the trio event
loop, which has to keep moving packets, so :class:`TaskPool` hands them to threads, in order of
``(priority, arrival)``: smaller :class:`Priority` first, then first come.  The ``points`` that a
request carries are what its sender claims and nobody can check, so they order nothing: a client
that claimed more would jump every queue.

Threads: each of the ``workers`` is a trio task that takes a job from the queue and runs it with
:func:`trio.to_thread.run_sync`, under a :class:`trio.CapacityLimiter` private to the pool (so other
``to_thread`` users in the process neither take the pool's threads nor are taken by it).  Trio
reuses its idle threads, so no thread is started before there is work, and none is left behind.
The first ``reserved_workers`` workers only ever take :attr:`Priority.INFERENCE` jobs: however
long a forward or backward pass runs, one inference step can always go next.

Batching: :meth:`TaskPool.run_batched` jobs name a hashable ``key``.  When a worker picks one, it
takes along the other jobs with the same key *and priority* that are queued then, in queue order,
each one that keeps the batch's total ``size`` within ``max_batch_total_size`` (a job that does
not fit waits for a later batch, which it heads if it is the oldest left), ``max_batch_size``
jobs in all, and calls ``batch_fn(items)`` once for them.  The picked job runs even if its size
alone is larger.  Jobs with equal keys must mean the same ``batch_fn``; the picked job's is
used.  If the batch raises, each item is run alone (``batch_fn([item])``) so that only the
caller whose item is at fault sees the exception.

Small jobs run inline: a :meth:`TaskPool.run_batched` batch (or a :meth:`TaskPool.run` job that
names a ``cost_key``) whose expected duration is below ``inline_below_s`` runs on the event loop's
own thread instead of a worker thread.  Handing a job to a thread and its result back costs two
thread wake-ups and GIL hand-offs, which for a one-token step through a few small blocks is as much
as the step's own compute.  The expectation is learnt per key: the seconds per unit of ``size`` (a
step's tokens) of that key's last batches, as a moving average; a key with no measurement yet runs
in a thread, and so does any batch expected to take longer, so the loop stalls at most about
``inline_below_s`` for one inline batch (a measurement is an average: a batch that takes longer
than usual, e.g. while another thread holds the CPU, stalls it longer).  ``inline_below_s=0``
turns this off.

Cancellation: a caller cancelled while its job waits in the queue takes the job out; it never
runs.  A caller cancelled while its job runs is cancelled at once, but the thread cannot be
interrupted: it runs to the end and its result is dropped (the worker stays busy until then).

Leaving :func:`open_task_pool` fails every queued job with ``ServerError("the server is shutting
down")`` and waits for the running ones.
"""

from __future__ import annotations

import enum
import functools
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import attrs
import outcome
import trio

from .._errors import ConfigError, ServerError
from .._groups import open_block_nursery

__all__ = ["Priority", "TaskPool", "TaskPoolStatistics", "open_task_pool"]

T = TypeVar("T")
ItemT = TypeVar("ItemT")

_SHUTTING_DOWN = "the server is shutting down"


class Priority(enum.IntEnum):
    """How urgent a job is; smaller runs first.

    ``BACKWARD`` has the value of ``FORWARD`` (an alias: the two share one place in the queue and
    are told apart by arrival only).
    """

    INFERENCE = 0
    FORWARD = 1
    BACKWARD = 1


@attrs.frozen(kw_only=True)
class TaskPoolStatistics:
    """A snapshot of the pool.

    ``queued`` maps each priority with waiting jobs to their number; ``completed`` counts jobs
    whose call ran to the end (successfully or not, including those whose caller left);
    ``batches_run`` counts the ``run_batched`` groups and ``largest_batch`` the most items in one.
    """

    workers: int
    reserved_workers: int
    queued: Mapping[int, int]
    running: int
    completed: int
    batches_run: int
    largest_batch: int
    inline_batches: int


class _State(enum.Enum):
    QUEUED = enum.auto()
    RUNNING = enum.auto()
    DONE = enum.auto()
    CANCELLED = enum.auto()


@attrs.define(kw_only=True, eq=False)
class _Job(Generic[T]):
    """One caller's work: either ``fn()`` or one item of ``batch_fn(items)``."""

    order: tuple[int, int]
    priority: int
    key: Hashable
    fn: Callable[[], T] | None = None
    batch_fn: Callable[[list[Any]], Sequence[T]] | None = None
    item: object = None
    size: float = 1.0
    #: Under which key the job's speed is learnt (None: not learnt, never inline).
    cost_key: Hashable | None = None
    state: _State = attrs.field(default=_State.QUEUED, init=False)
    result: outcome.Outcome[T] | None = attrs.field(default=None, init=False)
    done: trio.Event = attrs.field(factory=trio.Event, init=False)

    def __lt__(self, other: _Job[Any]) -> bool:
        return self.order < other.order


class _Unbatched:
    """The key of a plain :meth:`TaskPool.run` job: equal to nothing else."""

    __slots__ = ()


#: Weight of the newest batch in a key's moving average of seconds per unit of size.
_SPEED_SMOOTHING = 0.25
#: Keys whose speed the pool remembers (the oldest is forgotten past this).
_MAX_SPEED_KEYS = 1024


def _timed(work: Callable[[], T]) -> tuple[T, float]:
    """``work()`` and the seconds it took (in whichever thread runs it)."""
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


def _capture_one(fn: Callable[[], T]) -> list[outcome.Outcome[T]]:
    return [outcome.capture(fn)]


def _run_batch(
    batch_fn: Callable[[list[Any]], Sequence[T]], items: list[Any]
) -> list[outcome.Outcome[T]]:
    """Runs in a worker thread: the whole batch, or each item alone if the batch raises."""
    try:
        return [outcome.Value(result) for result in _call_batch(batch_fn, items)]
    except Exception as exc:
        if len(items) == 1:
            return [outcome.Error(exc)]
    return [outcome.capture(_call_batch_one, batch_fn, item) for item in items]


def _call_batch(batch_fn: Callable[[list[Any]], Sequence[T]], items: list[Any]) -> list[T]:
    results = list(batch_fn(items))
    if len(results) != len(items):
        raise ServerError(
            f"batch_fn returned {len(results)} results for {len(items)} items "
            f"(it must return one result per item, in order)"
        )
    return results


def _call_batch_one(batch_fn: Callable[[list[Any]], Sequence[T]], item: object) -> T:
    return _call_batch(batch_fn, [item])[0]


class TaskPool:
    """Runs blocking callables in threads by priority; build it with :func:`open_task_pool`."""

    def __init__(
        self,
        *,
        workers: int,
        reserved_workers: int,
        max_batch_size: int,
        max_batch_total_size: float = math.inf,
        shared_inference: bool = True,
        inline_below_s: float = 0.0,
    ) -> None:
        self._shared_inference = shared_inference
        self._inline_below_s = inline_below_s
        #: Key -> moving average of seconds per unit of size of its batches.
        self._seconds_per_unit: dict[Hashable, float] = {}
        self._inline_batches = 0
        self._workers = workers
        self._reserved_workers = reserved_workers
        self._max_batch_size = max_batch_size
        self._max_batch_total_size = max_batch_total_size
        self._limiter = trio.CapacityLimiter(workers)
        self._heap: list[_Job[Any]] = []
        self._by_key: dict[Hashable, list[_Job[Any]]] = {}
        self._queued: dict[int, int] = {}
        self._arrivals = itertools.count()
        self._idle = trio.lowlevel.ParkingLot()
        self._closing = False
        self._running = 0
        self._completed = 0
        self._batches_run = 0
        self._largest_batch = 0

    def statistics(self) -> TaskPoolStatistics:
        return TaskPoolStatistics(
            workers=self._workers,
            reserved_workers=self._reserved_workers,
            queued=MappingProxyType({p: n for p, n in sorted(self._queued.items()) if n}),
            running=self._running,
            completed=self._completed,
            batches_run=self._batches_run,
            largest_batch=self._largest_batch,
            inline_batches=self._inline_batches,
        )

    async def run(
        self,
        fn: Callable[[], T],
        *,
        priority: int,
        cost_key: Hashable | None = None,
        size: float = 1.0,
    ) -> T:
        """``fn()`` in a worker thread, once the jobs ahead of it in the queue have been taken.

        Its exception, if it raises, reaches the caller unchanged.  Raises :class:`ServerError` if
        the pool is shutting down.  Jobs naming a ``cost_key`` have their seconds per unit of
        ``size`` learnt under it, and run inline when expected to be quick (module docstring).
        """
        job: _Job[T] = self._new_job(priority, _Unbatched(), fn=fn, size=size, cost_key=cost_key)
        return await self._submit_and_wait(job)

    async def run_batched(
        self,
        key: Hashable,
        item: ItemT,
        batch_fn: Callable[[list[ItemT]], Sequence[T]],
        *,
        priority: int,
        size: float = 1.0,
    ) -> T:
        """``batch_fn([..., item, ...])[i]``: ``item`` run together with queued jobs of equal
        ``key`` and priority (see the module docstring); ``batch_fn`` must return one result per
        item, in order.  ``size`` (> 0) says how much work the item is (e.g. its tokens): a
        batch's sizes add up to at most ``max_batch_total_size`` (a first item alone may be
        larger), and its expected duration is their sum times the key's measured seconds per
        unit."""
        job: _Job[T] = self._new_job(
            priority, key, batch_fn=batch_fn, item=item, size=size, cost_key=key
        )
        return await self._submit_and_wait(job)

    # -- callers -----------------------------------------------------------------------------------

    def _new_job(self, priority: int, key: Hashable, *, size: float, **work: Any) -> _Job[Any]:
        if not size > 0:
            raise ValueError(f"size must be > 0, not {size!r}")
        order = (int(priority), next(self._arrivals))
        return _Job(order=order, priority=int(priority), key=key, size=float(size), **work)

    async def _submit_and_wait(self, job: _Job[T]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closing:
            raise ServerError(_SHUTTING_DOWN)
        heapq.heappush(self._heap, job)
        self._by_key.setdefault(job.key, []).append(job)
        self._queued[job.priority] = self._queued.get(job.priority, 0) + 1
        self._idle.unpark_all()
        try:
            await job.done.wait()
        except BaseException:
            if job.state is _State.QUEUED:
                self._unqueue(job)
                job.state = _State.CANCELLED
            # A running job finishes in its thread; nobody reads its result.
            raise
        assert job.result is not None
        return job.result.unwrap()

    def _unqueue(self, job: _Job[Any]) -> None:
        """Forget a queued job (its heap entry is skipped when it comes up)."""
        self._queued[job.priority] -= 1
        same_key = self._by_key[job.key]
        same_key.remove(job)
        if not same_key:
            del self._by_key[job.key]

    # -- workers -----------------------------------------------------------------------------------

    def _take(self, reserved: bool) -> list[_Job[Any]] | None:
        """The next job for this worker with its batch mates, marked running; None if none."""
        heap = self._heap
        while heap and heap[0].state is not _State.QUEUED:
            heapq.heappop(heap)
        if self._closing or not heap:
            return None
        if reserved and heap[0].priority > Priority.INFERENCE:
            return None
        if not reserved and not self._shared_inference:
            # Inference runs on the reserved workers only: steps arriving while one runs queue
            # up and go together as a batch.
            candidates = [
                job
                for job in heap
                if job.state is _State.QUEUED and job.priority > Priority.INFERENCE
            ]
            if not candidates:
                return None
            first = min(candidates)
        else:
            first = heapq.heappop(heap)
        batch = [first]
        if first.batch_fn is not None and self._max_batch_size > 1:
            mates = sorted(
                job
                for job in self._by_key[first.key]
                if job is not first and job.priority == first.priority
            )
            total = first.size
            for job in mates:
                if len(batch) == self._max_batch_size:
                    break
                if total + job.size <= self._max_batch_total_size:
                    batch.append(job)
                    total += job.size
        for job in batch:
            self._unqueue(job)
            job.state = _State.RUNNING
        return batch

    async def _worker(self, reserved: bool) -> None:
        while True:
            batch = self._take(reserved)
            if batch is None:
                if self._closing:
                    return
                await self._idle.park()
                continue
            await self._execute(batch)

    async def _execute(self, batch: list[_Job[Any]]) -> None:
        first = batch[0]
        self._running += len(batch)
        results: list[outcome.Outcome[Any]] | None = None
        try:
            work: Callable[[], list[outcome.Outcome[Any]]]
            if first.batch_fn is None:
                assert first.fn is not None
                work = functools.partial(_capture_one, first.fn)
            else:
                self._batches_run += 1
                self._largest_batch = max(self._largest_batch, len(batch))
                work = functools.partial(_run_batch, first.batch_fn, [job.item for job in batch])
            cost_key = first.cost_key
            size = sum(job.size for job in batch)
            if cost_key is not None and self._runs_inline(cost_key, size):
                self._inline_batches += 1
                results, seconds = _timed(work)
            else:
                results, seconds = await trio.to_thread.run_sync(
                    _timed, work, limiter=self._limiter
                )
            if cost_key is not None:
                self._learn(cost_key, seconds / size)
            self._completed += len(batch)
        finally:
            self._running -= len(batch)
            # Cancelled before the thread started (the pool's scope was cancelled): the callers
            # must not wait for ever.
            for index, job in enumerate(batch):
                job.result = (
                    results[index]
                    if results is not None
                    else outcome.Error(ServerError(_SHUTTING_DOWN))
                )
                job.state = _State.DONE
                job.done.set()
        await trio.lowlevel.checkpoint()

    def _runs_inline(self, key: Hashable, size: float) -> bool:
        per_unit = self._seconds_per_unit.get(key)
        return per_unit is not None and per_unit * size < self._inline_below_s

    def _learn(self, key: Hashable, seconds_per_unit: float) -> None:
        known = self._seconds_per_unit.pop(key, None)
        if known is not None:
            seconds_per_unit = known + _SPEED_SMOOTHING * (seconds_per_unit - known)
        elif len(self._seconds_per_unit) >= _MAX_SPEED_KEYS:
            del self._seconds_per_unit[next(iter(self._seconds_per_unit))]
        self._seconds_per_unit[key] = seconds_per_unit  # (re)inserted: the newest

    def _close(self) -> None:
        """Fail every queued job and let idle workers leave; running jobs go on to the end."""
        self._closing = True
        for job in self._heap:
            if job.state is _State.QUEUED:
                job.state = _State.DONE
                job.result = outcome.Error(ServerError(_SHUTTING_DOWN))
                job.done.set()
        self._heap.clear()
        self._by_key.clear()
        self._queued.clear()
        self._idle.unpark_all()


@asynccontextmanager
async def open_task_pool(
    *,
    workers: int = 2,
    reserved_workers: int = 1,
    max_batch_size: int = 16,
    max_batch_total_size: float = math.inf,
    shared_inference: bool = True,
    inline_below_s: float = 0.0,
) -> AsyncIterator[TaskPool]:
    """A :class:`TaskPool` with ``workers`` threads, ``reserved_workers`` of them (fewer than
    ``workers``) kept for :attr:`Priority.INFERENCE`; it runs for the duration of the block.
    A batch holds at most ``max_batch_size`` jobs whose sizes add up to at most
    ``max_batch_total_size`` (see the module docstring).
    With ``shared_inference=False`` the other workers take no inference jobs at all: steps
    then run one batch at a time, and those arriving meanwhile make the next batch.
    ``inline_below_s``: batches expected to take less run on the event loop's thread (see the
    module docstring; 0: never).

    Leaving the block fails queued jobs with ``ServerError("the server is shutting down")`` and
    waits for running ones (a thread cannot be interrupted).
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be an int >= 1, not {workers!r}")
    if not isinstance(reserved_workers, int) or not 0 <= reserved_workers < workers:
        raise ConfigError(
            f"reserved_workers must be an int in [0, workers={workers}) so that some worker takes "
            f"forward and backward jobs, not {reserved_workers!r}"
        )
    if (
        isinstance(max_batch_size, bool)
        or not isinstance(max_batch_size, int)
        or max_batch_size < 1
    ):
        raise ConfigError(f"max_batch_size must be an int >= 1, not {max_batch_size!r}")
    if (
        isinstance(max_batch_total_size, bool)
        or not isinstance(max_batch_total_size, int | float)
        or not max_batch_total_size > 0
    ):
        raise ConfigError(
            f"max_batch_total_size must be a number > 0, not {max_batch_total_size!r}"
        )
    if (
        isinstance(inline_below_s, bool)
        or not isinstance(inline_below_s, int | float)
        or not 0 <= inline_below_s < float("inf")
    ):
        raise ConfigError(
            f"inline_below_s must be a number of seconds >= 0, not {inline_below_s!r}"
        )
    pool = TaskPool(
        inline_below_s=float(inline_below_s),
        workers=workers,
        reserved_workers=reserved_workers,
        max_batch_size=max_batch_size,
        max_batch_total_size=max_batch_total_size,
        shared_inference=shared_inference,
    )
    # The block's own exception is raised as it is, not wrapped in the nursery's group; cancelled
    # from outside, the idle workers leave by Cancelled.
    async with open_block_nursery() as nursery:
        for index in range(workers):
            nursery.start_soon(pool._worker, index < reserved_workers)
        try:
            yield pool
        finally:
            pool._close()
