"""The bridge from synchronous code (PyTorch modules, HF ``generate()``) to the trio core.

- Called from a worker thread of a trio program that runs the object's network part (a model
  entered with ``async with``), it runs the coroutine on that program's loop
  (``trio.from_thread.run`` with its token).
- Otherwise (a plain script), it starts one daemon thread running ``trio.run`` on first use and
  runs everything there; network parts started through it live in its service nursery.  Nothing
  starts at import or construction, and a forked child starts its own thread when it needs one.
- Called on a trio thread itself, it refuses: blocking there would stall the program's loop; use
  the async API (``await ...``) instead.

A call interrupted while it waits (Ctrl-C's ``KeyboardInterrupt`` in the main thread, or any
other exception raised there) cancels the coroutine on the loop, waits for it to end, and
re-raises: nothing it started goes on behind the caller's back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

__all__ = ["Bridge", "bridge"]

T = TypeVar("T")


class Bridge:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._thread: threading.Thread | None = None

    def run(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        token: trio.lowlevel.TrioToken | None = None,
    ) -> T:
        """Run ``await fn(*args)`` on ``token``'s loop (default: the bridge's own thread)."""
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "a blocking petals_core call on a trio thread would stall its event loop: "
                "use the async API (await ...) or call it from trio.to_thread.run_sync"
            )
        if token is None:
            token = self.token()
        scope = trio.CancelScope()
        began, ended = threading.Event(), threading.Event()

        async def guarded() -> T:
            began.set()
            try:
                with scope:
                    return await fn(*args)
                raise RuntimeError("cancelled: its caller was interrupted")
            finally:
                ended.set()

        try:
            return trio.from_thread.run(guarded, trio_token=token)
        except BaseException:
            if not ended.is_set():  # interrupted while it waited: the coroutine runs on
                try:
                    token.run_sync_soon(scope.cancel)
                except trio.RunFinishedError:
                    pass
                else:
                    # (One that has not begun starts cancelled, or never: a loop that is
                    # stuck or closing may not start it; waiting for it would hang.)
                    if began.is_set():
                        ended.wait()
            raise

    def token(self) -> trio.lowlevel.TrioToken:
        """The bridge thread's loop, started on first use."""
        with self._lock:
            if self._token is None:
                self._start()
            assert self._token is not None
            return self._token

    def service_nursery(self) -> trio.Nursery:
        """Where long-lived network parts started through the bridge run."""
        self.token()
        assert self._nursery is not None
        return self._nursery

    def _start(self) -> None:
        ready = threading.Event()

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._token = trio.lowlevel.current_trio_token()
                ready.set()
                await trio.sleep_forever()

        thread = threading.Thread(
            target=trio.run, args=(main,), name="petals_core-bridge", daemon=True
        )
        thread.start()
        ready.wait()
        self._thread = thread

    def _forget(self) -> None:
        """In a forked child: the parent's thread does not exist here."""
        self._lock = threading.Lock()
        self._token = None
        self._nursery = None
        self._thread = None


bridge = Bridge()
os.register_at_fork(after_in_child=bridge._forget)
