"""Exception groups from trio's nurseries, turned back into the one error a caller expects.

A nursery wraps whatever its tasks or its body raise in an exception group.  Code that runs
tasks whose failures its caller handles one by one (a failed chunk of rows, a server that did
not open a session) runs them with :func:`run_concurrently`, which raises one error however many
failed; code that only re-raises a task's error to the top unwraps a group of one with
:func:`raising_single_error`; a context manager that runs a nursery around its
``yield`` keeps the block's own error whole with :func:`open_block_nursery`.  No torch here: the
transport uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator

import trio

__all__ = [
    "only_cancellation",
    "open_block_nursery",
    "raising_single_error",
    "run_concurrently",
    "single_error",
]


def single_error(error: BaseException) -> BaseException:
    """The one error inside (nested) exception groups of one error each, else ``error``."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


@contextlib.contextmanager
def raising_single_error() -> Iterator[None]:
    """Raise the one error of an exception group (nested groups of one error each) itself.

    The error keeps its own ``__context__`` rather than taking the group as its context; a group
    of several errors goes on as it is.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error = single_error(group)
        if error is group:
            raise
        context = error.__context__  # raising it here would set the group as its context
        try:
            raise error
        finally:
            error.__context__ = context


def only_cancellation(exc: BaseException) -> bool:
    """Whether ``exc`` is :class:`trio.Cancelled` or a group holding nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return isinstance(exc, trio.Cancelled)


@contextlib.asynccontextmanager
async def open_block_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for an ``open_*`` context manager's body, which ``yield``\\ s inside it.

    An exception raised by the body (the caller's block included) comes out as itself, not
    wrapped in the nursery's group.  The body stops the nursery's tasks itself (cancelling the
    nursery, or closing what they wait on); when the body raised, the ``Cancelled`` that leaving
    a cancelled scope adds is dropped, as the body's own error is what the caller must see.
    """
    raised: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield nursery
            except BaseException as exc:
                raised = exc
    except BaseException as exc:
        if raised is None or not only_cancellation(exc):
            raise
    if raised is not None:
        raise raised


async def run_concurrently(calls: Iterable[Callable[[], Awaitable[object]]]) -> None:
    """Await every call concurrently.  The first to fail cancels the others, and its error is
    raised itself, not in an exception group, with a note naming each other call that failed
    too (before its cancellation reached it); a caller's ``except`` for one error type then sees
    every failure.  Cancellation from outside passes through as trio raises it."""
    failures: list[Exception] = []

    async with trio.open_nursery() as nursery:

        async def run(call: Callable[[], Awaitable[object]]) -> None:
            try:
                await call()
            except Exception as exc:
                failures.append(exc)
                nursery.cancel_scope.cancel()

        for call in calls:
            nursery.start_soon(run, call)
    if failures:
        first = failures[0]
        for other in failures[1:]:
            first.add_note(f"at the same time: {type(other).__name__}: {other}")
        raise first
