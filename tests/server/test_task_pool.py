"""TaskPool: priority order, batching, the reserved inference worker, cancellation, shutdown.

A "gate" job blocks the worker threads on a threading.Event so that the queue fills in a known
order; ``wait_all_tasks_blocked`` tells when every submitted caller has queued its job.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import trio
import trio.testing

from petals_core._errors import ConfigError, ServerError
from petals_core.server._task_pool import Priority, TaskPool, open_task_pool

# Generous: these bound a test that went wrong, they are never waited out by a passing one.
DEADLINE_S = 20.0


class Gate:
    """A job that holds a worker thread until released."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def block(self) -> str:
        self.started.set()
        # The timeout only keeps a broken test from hanging the run.
        if not self.release.wait(timeout=DEADLINE_S):
            raise RuntimeError("the gate was never released")
        return "gate"

    async def wait_started(self) -> None:
        await trio.to_thread.run_sync(self.started.wait, DEADLINE_S, abandon_on_cancel=True)
        assert self.started.is_set()


@pytest.fixture
def gate() -> Iterator[Gate]:
    gate = Gate()
    yield gate
    gate.release.set()


async def _hold_worker(nursery: trio.Nursery, pool: TaskPool, gate: Gate, priority: int) -> None:
    nursery.start_soon(lambda: pool.run(gate.block, priority=priority))
    await gate.wait_started()


async def test_queue_order_is_priority_then_arrival(gate: Gate) -> None:
    ran: list[str] = []
    jobs = [
        ("f0", Priority.FORWARD),
        ("i0", Priority.INFERENCE),
        ("f1", Priority.FORWARD),
        ("i1", Priority.INFERENCE),
        ("f2", Priority.FORWARD),
        ("b0", Priority.BACKWARD),
    ]

    async def submit(name: str, priority: int) -> None:
        await pool.run(lambda: ran.append(name), priority=priority)

    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(workers=1, reserved_workers=0) as pool:
            async with trio.open_nursery() as nursery:
                await _hold_worker(nursery, pool, gate, Priority.FORWARD)
                for name, priority in jobs:
                    nursery.start_soon(submit, name, priority)
                    await trio.testing.wait_all_tasks_blocked()
                stats = pool.statistics()
                assert dict(stats.queued) == {Priority.INFERENCE: 2, Priority.FORWARD: 4}
                assert stats.running == 1
                gate.release.set()
            stats = pool.statistics()
            assert (dict(stats.queued), stats.running, stats.completed) == ({}, 0, 7)
    assert ran == ["i0", "i1", "f0", "f1", "f2", "b0"]


async def test_exceptions_reach_the_caller_unchanged() -> None:
    error = KeyError("missing")

    def fail() -> None:
        raise error

    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(workers=1, reserved_workers=0) as pool:
            with pytest.raises(KeyError) as info:
                await pool.run(fail, priority=Priority.FORWARD)
            assert info.value is error
            # The pool keeps working.
            assert await pool.run(lambda: 42, priority=Priority.INFERENCE) == 42


async def test_same_key_jobs_run_as_one_batch(gate: Gate) -> None:
    batches: list[list[int]] = []
    results: dict[int, int] = {}

    def double(items: list[int]) -> list[int]:
        batches.append(list(items))
        return [2 * item for item in items]

    async def submit(key: str, item: int) -> None:
        results[item] = await pool.run_batched(key, item, double, priority=Priority.FORWARD)

    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(workers=1, reserved_workers=0, max_batch_size=3) as pool:
            async with trio.open_nursery() as nursery:
                await _hold_worker(nursery, pool, gate, Priority.FORWARD)
                for key, item in [("a", 1), ("b", 10), ("a", 2), ("a", 3), ("b", 11), ("a", 4)]:
                    nursery.start_soon(submit, key, item)
                    await trio.testing.wait_all_tasks_blocked()
                gate.release.set()
            stats = pool.statistics()
    # "a" items 1-3 fill a batch of 3; then "b" (next in the queue) takes 11 along; then 4.
    assert batches == [[1, 2, 3], [10, 11], [4]]
    assert results == {1: 2, 2: 4, 3: 6, 4: 8, 10: 20, 11: 22}
    assert (stats.batches_run, stats.largest_batch, stats.completed) == (3, 3, 7)


async def test_batch_mates_keep_the_total_size_within_the_bound(gate: Gate) -> None:
    """Items are their own sizes; a batch adds up to at most 10, but its first item runs even if
    it alone is larger.  A mate that does not fit waits for the next batch."""
    batches: list[list[int]] = []

    def echo(items: list[int]) -> list[int]:
        batches.append(list(items))
        return items

    async def submit(item: int) -> None:
        assert await pool.run_batched("k", item, echo, priority=Priority.FORWARD, size=item) == item

    with trio.fail_after(DEADLINE_S):
        async with (
            open_task_pool(workers=1, reserved_workers=0, max_batch_total_size=10) as pool,
            trio.open_nursery() as nursery,
        ):
            await _hold_worker(nursery, pool, gate, Priority.FORWARD)
            for item in [6, 3, 5, 1, 12, 2]:
                nursery.start_soon(submit, item)
                await trio.testing.wait_all_tasks_blocked()
            gate.release.set()
    assert batches == [[6, 3, 1], [5, 2], [12]]


async def test_batches_keep_to_one_priority_and_the_queue_order(gate: Gate) -> None:
    batches: list[list[str]] = []

    def echo(items: list[str]) -> list[str]:
        batches.append(list(items))
        return items

    async def submit(item: str, priority: int) -> None:
        assert await pool.run_batched("k", item, echo, priority=priority) == item

    with trio.fail_after(DEADLINE_S):
        async with (
            open_task_pool(workers=1, reserved_workers=0) as pool,
            trio.open_nursery() as nursery,
        ):
            await _hold_worker(nursery, pool, gate, Priority.FORWARD)
            for item, priority in [
                ("f-first", Priority.FORWARD),
                ("i", Priority.INFERENCE),
                ("f-second", Priority.FORWARD),
            ]:
                nursery.start_soon(submit, item, priority)
                await trio.testing.wait_all_tasks_blocked()
            gate.release.set()
    assert batches == [["i"], ["f-first", "f-second"]]


async def test_a_failing_item_fails_only_its_own_caller(gate: Gate) -> None:
    calls: list[list[int]] = []
    outcomes: dict[int, object] = {}

    def reciprocal(items: list[int]) -> list[float]:
        calls.append(list(items))
        return [1 / item for item in items]

    async def submit(item: int) -> None:
        try:
            outcomes[item] = await pool.run_batched(
                "r", item, reciprocal, priority=Priority.INFERENCE
            )
        except ZeroDivisionError as exc:
            outcomes[item] = exc

    with trio.fail_after(DEADLINE_S):
        async with (
            open_task_pool(workers=1, reserved_workers=0) as pool,
            trio.open_nursery() as nursery,
        ):
            await _hold_worker(nursery, pool, gate, Priority.FORWARD)
            for item in (1, 0, 4):
                nursery.start_soon(submit, item)
                await trio.testing.wait_all_tasks_blocked()
            gate.release.set()
    assert calls == [[1, 0, 4], [1], [0], [4]]
    assert outcomes[1] == 1.0
    assert outcomes[4] == 0.25
    assert isinstance(outcomes[0], ZeroDivisionError)


async def test_reserved_worker_runs_inference_past_a_blocked_forward(gate: Gate) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(workers=2, reserved_workers=1) as pool:
            async with trio.open_nursery() as nursery:
                await _hold_worker(nursery, pool, gate, Priority.FORWARD)
                # A second forward job waits: the only free worker is reserved for inference.
                nursery.start_soon(lambda: pool.run(lambda: "f", priority=Priority.FORWARD))
                await trio.testing.wait_all_tasks_blocked()
                assert await pool.run(lambda: "step", priority=Priority.INFERENCE) == "step"
                stats = pool.statistics()
                assert (dict(stats.queued), stats.running) == ({Priority.FORWARD: 1}, 1)
                gate.release.set()
            assert pool.statistics().completed == 3


async def test_unshared_inference_waits_for_its_worker_and_goes_as_one_batch(gate: Gate) -> None:
    batches: list[list[int]] = []

    def steps(items: list[int]) -> list[int]:
        batches.append(list(items))
        return items

    with trio.fail_after(DEADLINE_S):
        async with (
            open_task_pool(workers=2, reserved_workers=1, shared_inference=False) as pool,
            trio.open_nursery() as nursery,
        ):
            await _hold_worker(nursery, pool, gate, Priority.INFERENCE)
            for item in range(3):
                nursery.start_soon(
                    lambda i=item: pool.run_batched("k", i, steps, priority=Priority.INFERENCE)
                )
            await trio.testing.wait_all_tasks_blocked()
            # The free worker is not for inference: the steps wait, but a forward runs.
            assert pool.statistics().queued == {Priority.INFERENCE: 3}
            assert await pool.run(lambda: "f", priority=Priority.FORWARD) == "f"
            assert pool.statistics().queued == {Priority.INFERENCE: 3}
            gate.release.set()
    assert [sorted(batch) for batch in batches] == [[0, 1, 2]]


async def test_cancelled_while_queued_never_runs(gate: Gate) -> None:
    ran: list[str] = []
    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(workers=1, reserved_workers=0) as pool:
            async with trio.open_nursery() as nursery:
                await _hold_worker(nursery, pool, gate, Priority.FORWARD)
                scope = trio.CancelScope()

                async def impatient() -> None:
                    with scope:
                        await pool.run(lambda: ran.append("cancelled"), priority=Priority.FORWARD)

                nursery.start_soon(impatient)
                await trio.testing.wait_all_tasks_blocked()
                assert dict(pool.statistics().queued) == {Priority.FORWARD: 1}
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert dict(pool.statistics().queued) == {}
                gate.release.set()
            await pool.run(lambda: ran.append("after"), priority=Priority.FORWARD)
    assert ran == ["after"]
    assert pool.statistics().completed == 2


async def test_cancelled_while_running_returns_at_once(gate: Gate) -> None:
    left = trio.Event()
    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(workers=1, reserved_workers=0) as pool:
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def impatient() -> None:
                    with scope:
                        await pool.run(gate.block, priority=Priority.INFERENCE)
                    left.set()

                nursery.start_soon(impatient)
                await gate.wait_started()
                scope.cancel()
                # The caller leaves while the thread is still blocked.
                await left.wait()
                assert pool.statistics().running == 1
                gate.release.set()
            # The worker is free again once the abandoned call ends.
            assert await pool.run(lambda: 7, priority=Priority.FORWARD) == 7
        assert pool.statistics().completed == 2


async def test_shutdown_fails_queued_jobs_and_waits_for_running_ones(gate: Gate) -> None:
    errors: list[ServerError] = []
    all_failed = trio.Event()
    finished: list[str] = []

    async def queued() -> None:
        try:
            await pool.run(lambda: finished.append("queued"), priority=Priority.FORWARD)
        except ServerError as exc:
            errors.append(exc)
            if len(errors) == 2:
                all_failed.set()

    async def release_gate_after_failures() -> None:
        await all_failed.wait()
        gate.release.set()

    async def running() -> None:
        finished.append(await pool.run(gate.block, priority=Priority.FORWARD))

    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_gate_after_failures)
            async with open_task_pool(workers=1, reserved_workers=0) as pool:
                nursery.start_soon(running)
                await gate.wait_started()
                for _ in range(2):
                    nursery.start_soon(queued)
                    await trio.testing.wait_all_tasks_blocked()
            # Leaving the pool waited for the running job.
            stats = pool.statistics()
            assert (stats.running, stats.completed, dict(stats.queued)) == (0, 1, {})
    assert finished == ["gate"]
    assert [str(exc) for exc in errors] == ["the server is shutting down"] * 2
    with pytest.raises(ServerError, match="shutting down"):
        await pool.run(lambda: None, priority=Priority.INFERENCE)


async def test_the_blocks_own_error_is_raised_as_is() -> None:
    with pytest.raises(KeyError):
        async with open_task_pool(workers=2, reserved_workers=1):
            raise KeyError("boom")


@pytest.mark.parametrize(
    ("workers", "reserved_workers", "max_batch_size"), [(0, 0, 1), (2, 2, 1), (2, -1, 1), (2, 1, 0)]
)
async def test_invalid_configuration(
    workers: int, reserved_workers: int, max_batch_size: int
) -> None:
    with pytest.raises(ConfigError):
        async with open_task_pool(
            workers=workers, reserved_workers=reserved_workers, max_batch_size=max_batch_size
        ):
            pytest.fail("must not open")


@pytest.mark.parametrize("total", [0, -1.0, float("nan"), True, "10"])
async def test_invalid_batch_total_size(total: float) -> None:
    with pytest.raises(ConfigError, match="max_batch_total_size"):
        async with open_task_pool(max_batch_total_size=total):
            pytest.fail("must not open")


@pytest.mark.parametrize("inline_below_s", [-1.0, float("inf"), float("nan"), True])
async def test_invalid_inline_threshold(inline_below_s: float) -> None:
    with pytest.raises(ConfigError, match="inline_below_s"):
        async with open_task_pool(inline_below_s=inline_below_s):
            pytest.fail("must not open")


def _where(items: list[int]) -> list[str]:
    return [threading.current_thread().name] * len(items)


async def test_quick_batches_run_on_the_loop_thread_once_measured() -> None:
    loop_thread = threading.current_thread().name
    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(inline_below_s=10.0) as pool:
            # Unknown speed: a worker thread, which measures it.
            first = await pool.run_batched("k", 1, _where, priority=Priority.INFERENCE)
            assert first != loop_thread
            # Known to be quick: the loop's own thread, also for a batch of several items.
            assert await pool.run_batched("k", 1, _where, priority=Priority.INFERENCE) == (
                loop_thread
            )
            # Another key is measured first on its own.
            other = await pool.run_batched("other", 1, _where, priority=Priority.INFERENCE)
            assert other != loop_thread
            assert pool.statistics().inline_batches == 1


async def test_batches_expected_to_be_slow_go_to_a_thread() -> None:
    loop_thread = threading.current_thread().name

    def slow(items: list[float]) -> list[str]:
        done = threading.Event()
        done.wait(items[0])  # stands for compute (a worker thread, or the blocked loop)
        return [threading.current_thread().name]

    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(inline_below_s=0.05) as pool:
            assert await pool.run_batched("k", 0.01, slow, priority=Priority.INFERENCE, size=1) != (
                loop_thread
            )
            # ~10 ms per unit: one unit is expected to take ~10 ms (inline) ...
            assert (
                await pool.run_batched("k", 0.0, slow, priority=Priority.INFERENCE, size=1)
                == loop_thread
            )
            # ... 100 units ~1 s: a thread (the average fell meanwhile, still far above 50 ms).
            assert (
                await pool.run_batched("k", 0.0, slow, priority=Priority.INFERENCE, size=100)
                != loop_thread
            )


async def test_plain_jobs_run_inline_only_under_a_cost_key() -> None:
    loop_thread = threading.current_thread().name

    def where() -> str:
        return threading.current_thread().name

    with trio.fail_after(DEADLINE_S):
        async with open_task_pool(inline_below_s=10.0) as pool:
            for _ in range(2):
                assert await pool.run(where, priority=Priority.INFERENCE) != loop_thread
            assert await pool.run(where, priority=Priority.INFERENCE, cost_key="c") != loop_thread
            assert await pool.run(where, priority=Priority.INFERENCE, cost_key="c") == loop_thread
            # An exception from an inline job reaches its caller as from a thread.
            with pytest.raises(ZeroDivisionError):
                await pool.run(lambda: 1 / 0, priority=Priority.INFERENCE, cost_key="c")


async def test_inline_off_by_default() -> None:
    loop_thread = threading.current_thread().name
    with trio.fail_after(DEADLINE_S):
        async with open_task_pool() as pool:
            for _ in range(3):
                assert await pool.run_batched("k", 1, _where, priority=Priority.INFERENCE) != (
                    loop_thread
                )
            assert pool.statistics().inline_batches == 0


@pytest.mark.parametrize("size", [0, -1.0, float("nan")])
async def test_sizes_must_be_positive(size: float) -> None:
    async with open_task_pool() as pool:
        with pytest.raises(ValueError, match="size"):
            await pool.run_batched("k", 1, _where, priority=Priority.INFERENCE, size=size)
        with pytest.raises(ValueError, match="size"):
            await pool.run(lambda: None, priority=Priority.INFERENCE, size=size)
