"""The decode steps of the endpoint's running requests, lined up so that they go together.

A request whose step came back waits for the other running requests' steps, then the LM head
runs once for all of them (a CPU reads the whole ``(vocab, hidden)`` weight once instead of once
per request), each request picks its tokens, and all of them send their next step at the same
moment. The servers see those steps arrive together and run them as one batch. A request alone
never waits; one whose step is late (a server being replaced) holds the others up for at most
about one step's time, then goes on in a later batch.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import attrs
import torch
import trio

from ._sampling import Chooser, Drafts

__all__ = ["Entry", "Lineup"]

#: How long the requests that are ready wait for a late one, at most: one step of the usual
#: length, within these bounds (seconds).
_HOLD_MIN_S: Final = 0.002
_HOLD_MAX_S: Final = 1.0
#: Steps the hold's "usual length" is the median of.
_STEP_SAMPLES: Final = 32


@attrs.define(eq=False)
class Entry:
    """A request's rows waiting in the lineup, and what comes back for them."""

    hidden: torch.Tensor  # (rows, hidden): the last position's output of the blocks
    chooser: Chooser
    drafts: Drafts | None = None
    done: trio.Event = attrs.Factory(trio.Event)
    tokens: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    error: BaseException | None = None


class Lineup:
    """Lines up the decode steps of the running requests (see the module).

    A request's task calls :meth:`choose` with its step's output once the step is back, and
    decodes from then until it calls :meth:`leave`. A task of the lineup's own (running while
    some request decodes) takes the first arrival's batch, waits until every decoding request
    has arrived (or left) or until about one step's time has passed, runs ``compute`` (the
    final norm, the LM head and each request's choice) for the batch in a worker thread, and
    releases its requests together."""

    def __init__(
        self,
        compute: Callable[[list[Entry]], None],
        nursery: trio.Nursery,
        *,
        run_sync: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync,
    ) -> None:
        self._compute = compute
        #: How ``compute`` is run (a worker thread; the lineup's own tests run it inline).
        self._run_sync = run_sync
        self._nursery = nursery
        self._running = False
        self._members: set[object] = set()
        self._batch: dict[object, Entry] = {}
        self._arrived = trio.Event()  # the batch has its first request
        self._complete = trio.Event()  # every decoding request is in the batch
        #: When each request was last released, and how long its steps took since (recent).
        self._released: dict[object, float] = {}
        self._steps_s: collections.deque[float] = collections.deque(maxlen=_STEP_SAMPLES)
        #: Requests that decode in this group, or will once their prompt is through.
        self.assigned = 0
        #: Batches computed, and requests in them (a ratio above 1: requests went together).
        self.batches = 0
        self.requests = 0

    async def choose(
        self,
        member: object,
        hidden: torch.Tensor,
        chooser: Chooser,
        drafts: Drafts | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens (and log-probabilities) that ``chooser`` picks from ``hidden``'s logits,
        computed with those of the requests that arrive meanwhile (and ``drafts`` checked
        after them)."""
        released = self._released.pop(member, None)
        if released is not None:
            self._steps_s.append(time.monotonic() - released)
        self._members.add(member)
        entry = Entry(hidden, chooser, drafts)
        self._batch[member] = entry
        self._arrived.set()
        if len(self._batch) >= len(self._members):
            self._complete.set()
        if not self._running:
            self._running = True
            self._nursery.start_soon(self._run)
        await entry.done.wait()
        if entry.error is not None:
            raise entry.error
        assert entry.tokens is not None
        return entry.tokens, entry.logprobs

    def leave(self, member: object) -> None:
        """``member`` decodes no more (it finished, failed, or was cancelled)."""
        self._members.discard(member)
        self._released.pop(member, None)
        self._batch.pop(member, None)
        if len(self._batch) >= len(self._members):
            self._complete.set()
            self._arrived.set()  # wakes the lineup's task to leave, when nobody decodes

    def _hold_s(self) -> float:
        """How long a batch waits for late requests: about one step (the recent median)."""
        if not self._steps_s:
            return _HOLD_MIN_S
        median = statistics.median(self._steps_s)
        return min(_HOLD_MAX_S, max(_HOLD_MIN_S, median))

    async def _run(self) -> None:
        try:
            while self._members:
                await self._arrived.wait()
                if len(self._batch) < len(self._members):
                    with trio.move_on_after(self._hold_s()):
                        await self._complete.wait()
                batch, self._batch = self._batch, {}
                self._arrived, self._complete = trio.Event(), trio.Event()
                if batch:
                    await self._release(batch)
        finally:
            self._running = False

    async def _release(self, batch: dict[object, Entry]) -> None:
        entries = list(batch.values())
        try:
            await self._run_sync(self._compute, entries)
        except Exception as exc:  # compute failed as a whole: every request in it fails
            for entry in entries:
                entry.error = exc
        finally:
            self.batches += 1
            self.requests += len(entries)
            released = time.monotonic()
            for member, entry in batch.items():
                if member in self._members:
                    self._released[member] = released
                entry.done.set()
