"""A trio program on a daemon thread, serving tests that call in from their own threads."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


class TrioThread:
    """Runs :meth:`_program` with ``trio.run`` on a daemon thread.

    :meth:`start` returns once the program calls :meth:`_serving` (and raises if it fails first,
    or takes more than ``start_timeout_s``); :meth:`stop` sets ``self._stop``, on which the
    program returns, and waits for the thread.
    """

    def __init__(self, what: str, *, thread_name: str, start_timeout_s: float) -> None:
        self._what = what
        self._start_timeout_s = start_timeout_s
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=thread_name, daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(self._start_timeout_s):
            raise TimeoutError(f"{self._what} did not start")
        if self._error is not None:
            raise RuntimeError(f"{self._what} failed to start") from self._error

    def stop(self) -> None:
        """Stop the program and wait for its thread; raise what ended it early, if anything did
        (a program that failed while tests used it must not pass for a clean stop)."""
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass  # it already ended: its error, if any, is raised below
        self._thread.join(self._start_timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"{self._what} did not stop")
        if self._error is not None:
            raise RuntimeError(f"{self._what} failed") from self._error

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the program's loop, from a test's thread."""
        assert self._token is not None
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    async def _program(self) -> None:
        """Start serving, call :meth:`_serving`, and return once ``self._stop`` is set."""
        raise NotImplementedError

    def _serving(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._ready.set()

    def _main(self) -> None:
        try:
            trio.run(self._run_program)
        except BaseException as error:
            self._error = error
            self._ready.set()

    async def _run_program(self) -> None:
        self._stop = trio.Event()
        await self._program()
