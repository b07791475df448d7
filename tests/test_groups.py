"""One error out of a nursery's exception group: raised as itself, its context kept."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from petals_core._groups import (
    only_cancellation,
    open_block_nursery,
    raising_single_error,
    run_concurrently,
    single_error,
)


def test_single_error_unwraps_nested_groups_of_one() -> None:
    inner = KeyError("k")
    assert single_error(ExceptionGroup("outer", [ExceptionGroup("inner", [inner])])) is inner
    several = ExceptionGroup("two", [KeyError("a"), KeyError("b")])
    assert single_error(several) is several
    plain = ValueError("v")
    assert single_error(plain) is plain


async def _fail(error: BaseException) -> None:
    raise error


async def _tasks_raising(*errors: BaseException) -> None:
    async with trio.open_nursery() as nursery:
        for error in errors:
            nursery.start_soon(_fail, error)


async def test_raising_single_error_raises_the_task_error_with_its_own_context() -> None:
    cause = OSError("disk")
    error = RuntimeError("task")
    error.__context__ = cause
    with pytest.raises(RuntimeError) as info, raising_single_error():
        await _tasks_raising(error)
    assert info.value is error
    assert error.__context__ is cause


async def test_raising_single_error_leaves_a_group_of_several_errors() -> None:
    with pytest.raises(ExceptionGroup) as info, raising_single_error():
        await _tasks_raising(KeyError("a"), KeyError("b"))
    assert sorted(str(e) for e in info.value.exceptions) == ["'a'", "'b'"]


async def test_only_cancellation() -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as caught:
            cancelled = caught
            raise
    assert only_cancellation(cancelled)
    assert only_cancellation(BaseExceptionGroup("g", [cancelled]))
    assert not only_cancellation(BaseExceptionGroup("g", [cancelled, KeyError("k")]))
    assert not only_cancellation(KeyError("k"))


@asynccontextmanager
async def _service(stopped: list[str]) -> AsyncIterator[None]:
    async with open_block_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        try:
            yield
        finally:
            stopped.append("service")
            nursery.cancel_scope.cancel()


async def test_open_block_nursery_raises_the_block_error_itself() -> None:
    stopped: list[str] = []
    with pytest.raises(KeyError):
        async with _service(stopped):
            raise KeyError("from the block")
    assert stopped == ["service"]


async def test_open_block_nursery_raises_the_block_cancellation_from_outside() -> None:
    stopped: list[str] = []
    with trio.CancelScope() as scope:
        async with _service(stopped):
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert stopped == ["service"]


async def test_open_block_nursery_raises_a_task_error_in_its_group() -> None:
    async def block_waiting_for_a_failing_task() -> None:
        async with open_block_nursery() as nursery:
            nursery.start_soon(_fail, KeyError("task"))
            await trio.sleep_forever()

    with pytest.raises(ExceptionGroup) as info:
        await block_waiting_for_a_failing_task()
    assert [type(e) for e in info.value.exceptions] == [KeyError]


async def test_run_concurrently_raises_the_first_failure_itself_naming_the_others() -> None:
    """Two calls fail at once: one error comes out, of its own type, noting the other."""
    both_running = trio.Event()
    started = 0

    async def failing(error: Exception) -> None:
        nonlocal started
        started += 1
        if started == 2:
            # The first is woken, and this one fails before any checkpoint: both fail.
            both_running.set()
            raise error
        await both_running.wait()
        raise error

    with pytest.raises((KeyError, ValueError)) as caught:
        await run_concurrently([lambda: failing(KeyError("a")), lambda: failing(ValueError("b"))])
    assert not isinstance(caught.value, BaseExceptionGroup)
    other = "ValueError: b" if isinstance(caught.value, KeyError) else "KeyError: 'a'"
    assert caught.value.__notes__ == [f"at the same time: {other}"]


async def test_run_concurrently_cancels_the_others_once_one_fails() -> None:
    cancelled = trio.Event()

    async def waits() -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    with trio.fail_after(10), pytest.raises(OSError, match="down"):
        await run_concurrently([waits, lambda: _fail(OSError("down"))])
    assert cancelled.is_set()


async def test_run_concurrently_lets_cancellation_from_outside_through() -> None:
    finished: list[int] = []

    async def slow(i: int) -> None:
        await trio.sleep(1000)
        finished.append(i)

    with trio.move_on_after(0.01) as scope:
        await run_concurrently([lambda: slow(1), lambda: slow(2)])
    assert scope.cancelled_caught and not finished
    await run_concurrently([])  # nothing to run: returns
