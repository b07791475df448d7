"""One matmul for the decode steps of several threads that reach the LM head at the same time.

A client serving several generations at once (the OpenAI endpoint runs one ``generate()`` per
request, each in its own thread) computes the LM head once per token of each: on a CPU that
reads the whole ``(vocab, hidden)`` weight every time, which costs far more than the few rows it
multiplies. :class:`SharedMatmul` lets the threads share the read: a thread that arrives while
another computes leaves its rows in a queue; whoever computes next takes every queued row into one
matmul and hands each thread its part. A thread alone computes at once, as before; nobody waits
for company.

Leadership passes from thread to thread: the one computing finishes its batch, wakes the owners
of its rows, and, if rows queued meanwhile, wakes the first of their owners to compute them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

__all__ = ["SharedMatmul"]


class _Rows:
    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.ready = threading.Event()
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.leads = False


class SharedMatmul:
    """Coalesces concurrent ``compute(rows)`` calls (``(n, k) -> (n, m)``, row by row) into one.

    Calls must agree on what ``compute`` does (the same weight); rows of every call are
    concatenated, so their dtype, device and width must match too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[_Rows] = []
        self._busy = False
        #: Matmuls run, and rows computed in them (a ratio above 1 means sharing happened).
        self.batches = 0
        self.rows = 0

    def __call__(
        self, rows: torch.Tensor, compute: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        mine = _Rows(rows)
        with self._lock:
            self._queue.append(mine)
            if not self._busy:
                self._busy = mine.leads = True
        if not mine.leads:
            mine.ready.wait()
        if mine.result is None and mine.error is None:
            self._lead(compute)
        if mine.error is not None:
            raise mine.error
        assert mine.result is not None
        return mine.result

    def _lead(self, compute: Callable[[torch.Tensor], torch.Tensor]) -> None:
        with self._lock:
            batch, self._queue = self._queue, []
        try:
            if len(batch) == 1:
                outputs = [compute(batch[0].rows)]
            else:
                joined = compute(torch.cat([part.rows for part in batch]))
                outputs = list(joined.split([part.rows.shape[0] for part in batch]))
            for part, output in zip(batch, outputs, strict=True):
                part.result = output
        except BaseException as error:
            for part in batch:
                part.error = error
        self.batches += 1
        self.rows += sum(part.rows.shape[0] for part in batch)
        with self._lock:
            successor = self._queue[0] if self._queue else None
            if successor is None:
                self._busy = False
            else:
                successor.leads = True
        for part in batch:
            part.ready.set()
        if successor is not None:
            successor.ready.set()
