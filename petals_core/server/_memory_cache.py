"""The attention-cache budget: how many bytes of key/value cache the server's sessions may hold.

A server holds past keys and values for every open inference session; together they must fit in
the memory set aside for them.  :class:`MemoryCache` only *accounts* for that memory: a session
asks for ``nbytes`` with ``async with cache.allocate(nbytes) as grant:``, allocates its tensors
itself once granted, and the bytes return to the budget when the block ends (normally, by an
error or by cancellation).

Unlike Petals' cache (shared memory between processes, a lock and a pipe), everything here lives
in one trio event loop, so the bookkeeping is plain attributes and the waiting is trio events.

A request that fits in the free bytes is granted at once, even while larger requests wait; one
that does not fit waits.  As bytes are freed, the waiting requests are granted in arrival order,
each one that fits then, even if an earlier, larger one still does not.  So no request is held up
by one it could not be granted beside (a stranger's one opening for nearly the whole budget does
not block everyone else's), at a price: a large request can wait behind a stream of small ones
until it gives up, after ``min(timeout_s, max_alloc_timeout_s)`` seconds, with
:class:`AllocationFailed` (its client then opens its session on another server).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from .._errors import AllocationFailed, ConfigError, SessionTooLarge

__all__ = ["CacheGrant", "MemoryCache", "MemoryCacheStatistics"]


@attrs.frozen(kw_only=True)
class CacheGrant:
    """What :meth:`MemoryCache.allocate` reserved: ``nbytes``, after waiting ``waited_s`` (exactly
    0.0 when granted at once)."""

    nbytes: int
    waited_s: float


@attrs.frozen(kw_only=True)
class MemoryCacheStatistics:
    """A snapshot of the budget.

    ``granted`` and ``failed`` count requests since the cache was made; ``active`` is how many
    grants are held now and ``waiting`` how many requests queue for room.
    """

    max_bytes: int
    bytes_used: int
    bytes_left: int
    active: int
    waiting: int
    granted: int
    failed: int


class _Waiter:
    """One queued request; the releasing side grants it (and sets ``event``) when it fits."""

    __slots__ = ("event", "granted", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.granted = False
        self.event = trio.Event()


class MemoryCache:
    """Accounts for up to ``max_bytes`` of attention cache: a request is granted as soon as it
    fits, waiting ones in arrival order (see the module docstring).

    ``max_alloc_timeout_s`` caps how long any request may wait for room, whatever it asks for.
    ``max_bytes == 0`` is allowed: every request for more than zero bytes then fails at once.
    Use it from one trio run only (it is not thread-safe).
    """

    def __init__(self, max_bytes: int, *, max_alloc_timeout_s: float) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ConfigError(f"max_bytes must be an int >= 0, not {max_bytes!r}")
        if not (max_alloc_timeout_s >= 0):  # also rejects NaN
            raise ConfigError(f"max_alloc_timeout_s must be >= 0, not {max_alloc_timeout_s!r}")
        self._max_bytes = max_bytes
        self._max_alloc_timeout_s = float(max_alloc_timeout_s)
        self._bytes_used = 0
        self._active = 0
        self._granted = 0
        self._failed = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def bytes_left(self) -> int:
        """Bytes not granted to anyone right now (each waiting request needs more than this)."""
        return self._max_bytes - self._bytes_used

    def statistics(self) -> MemoryCacheStatistics:
        return MemoryCacheStatistics(
            max_bytes=self._max_bytes,
            bytes_used=self._bytes_used,
            bytes_left=self.bytes_left,
            active=self._active,
            waiting=len(self._waiters),
            granted=self._granted,
            failed=self._failed,
        )

    @asynccontextmanager
    async def allocate(
        self, nbytes: int, *, timeout_s: float = math.inf
    ) -> AsyncIterator[CacheGrant]:
        """Reserve ``nbytes`` of the budget for the duration of the ``async with`` block.

        Granted at once if ``nbytes`` fits in the free bytes, whoever waits.  Raises
        :class:`AllocationFailed` at once if ``nbytes`` exceeds the whole budget or if it does
        not fit now and the effective timeout (``min(timeout_s, max_alloc_timeout_s)``) is zero;
        otherwise after waiting that long.  Cancelled while waiting, the request leaves the line
        without a trace.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, not {nbytes!r}")
        if not (timeout_s >= 0):  # also rejects NaN
            raise ValueError(f"timeout_s must be >= 0, not {timeout_s!r}")
        await trio.lowlevel.checkpoint_if_cancelled()
        if nbytes > self._max_bytes:
            self._failed += 1
            raise SessionTooLarge(
                f"requested {nbytes} bytes of attention cache, more than this server's whole "
                f"budget of {self._max_bytes} bytes"
            )
        if nbytes <= self.bytes_left:
            self._grant(nbytes)
            waited_s = 0.0
            await trio.lowlevel.cancel_shielded_checkpoint()
        else:
            started = trio.current_time()
            await self._wait(nbytes, min(timeout_s, self._max_alloc_timeout_s), started)
            waited_s = trio.current_time() - started
        try:
            yield CacheGrant(nbytes=nbytes, waited_s=waited_s)
        finally:
            self._release(nbytes)

    async def _wait(self, nbytes: int, timeout_s: float, started: float) -> None:
        waiter = _Waiter(nbytes)
        if timeout_s > 0:
            self._waiters.append(waiter)
            try:
                with trio.move_on_after(timeout_s):
                    await waiter.event.wait()
            except BaseException:
                # Cancelled from outside: give back what may have been granted meanwhile.
                if waiter.granted:
                    self._release(nbytes)
                else:
                    self._leave_line(waiter)
                raise
            if waiter.granted:
                return
            self._leave_line(waiter)
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        self._failed += 1
        raise AllocationFailed(
            f"could not allocate {nbytes} bytes of attention cache: only {self.bytes_left} of "
            f"{self._max_bytes} bytes were free after waiting "
            f"{trio.current_time() - started:.3f} s "
            f"(limit {timeout_s:g} s, {len(self._waiters)} other requests waiting)"
        )

    def _grant(self, nbytes: int) -> None:
        self._bytes_used += nbytes
        self._active += 1
        self._granted += 1

    def _release(self, nbytes: int) -> None:
        self._bytes_used -= nbytes
        self._active -= 1
        self._wake()

    def _leave_line(self, waiter: _Waiter) -> None:
        # Nothing was freed: every other waiter still needs more than the free bytes.
        self._waiters.remove(waiter)

    def _wake(self) -> None:
        """Grant, in arrival order, every waiter that fits in what is free by its turn."""
        still_waiting: deque[_Waiter] = deque()
        for waiter in self._waiters:
            if waiter.nbytes <= self.bytes_left:
                self._grant(waiter.nbytes)
                waiter.granted = True
                waiter.event.set()
            else:
                still_waiting.append(waiter)
        self._waiters = still_waiting
