"""The process split alone: a model's spans in worker processes, the hidden state passed on pipes.

Each worker holds one span of our blocks (one torch thread, its own caches) and reads a hidden
state from the previous process's pipe, runs its blocks, and writes the result to the next: this
process -> worker 1 -> ... -> worker N -> this process, as a pushed chain of servers goes.  No
transport, no codec, no sessions, no client model: what splitting the blocks over processes on
this machine costs by itself (each process idles while the others compute, and wakes for its turn).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ._server_steps import server_steps

__all__ = ["PipeChain"]

#: Longest wait for a worker to start or stop.
_START_TIMEOUT_S = 120.0


def _worker(
    receive: multiprocessing.connection.Connection,
    send: multiprocessing.connection.Connection,
    ready: multiprocessing.connection.Connection,
    blocks: list[Any],
    max_length: int,
    hidden_size: int,
) -> None:
    torch.set_num_threads(1)
    with torch.inference_mode():
        caches = [block.allocate_cache(1, max_length) for block in blocks]
        step = server_steps(blocks)
        ready.send_bytes(b"ready")
        while True:
            data = receive.recv_bytes()
            if not data:
                send.send_bytes(b"")  # stop: pass it on
                return
            x = torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, -1, hidden_size)
            (x,) = step(0, len(blocks), [x], [caches])
            send.send_bytes(x.numpy().tobytes())


class PipeChain:
    """Worker processes holding ``spans`` of ``blocks``; :meth:`step` runs a hidden state of
    ``hidden_size`` through all of them.  fp32 only (the bytes on the pipes are float32)."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        spans: Sequence[tuple[int, int]],
        *,
        max_length: int,
        hidden_size: int,
    ) -> None:
        context = multiprocessing.get_context("spawn")  # no forked torch state in the workers
        self._hidden_size = hidden_size
        pipes = [context.Pipe(duplex=False) for _ in range(len(spans) + 1)]  # (receive, send)
        self._send = pipes[0][1]
        self._receive = pipes[-1][0]
        self._processes: list[Any] = []
        try:
            readiness = []
            for index, span in enumerate(spans):
                ready_receive, ready_send = context.Pipe(duplex=False)
                readiness.append(ready_receive)
                process = context.Process(
                    target=_worker,
                    args=(
                        pipes[index][0],
                        pipes[index + 1][1],
                        ready_send,
                        list(blocks[span[0] : span[1]]),
                        max_length,
                        hidden_size,
                    ),
                    daemon=True,
                )
                process.start()
                self._processes.append(process)
            for index, ready in enumerate(readiness):
                if not ready.poll(_START_TIMEOUT_S) or ready.recv_bytes() != b"ready":
                    raise RuntimeError(f"pipe worker {index} did not start")
        except BaseException:
            self.close()
            raise

    def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(1, T, hidden)`` float32 through every span; the last span's output."""
        self._send.send_bytes(hidden.detach().to(torch.float32).contiguous().numpy().tobytes())
        data = self._receive.recv_bytes()
        return torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, -1, self._hidden_size)

    def close(self) -> None:
        if not self._processes:
            return
        try:
            self._send.send_bytes(b"")
            if self._receive.poll(_START_TIMEOUT_S):
                self._receive.recv_bytes()
        except OSError:  # a worker died: the joins below see to the rest
            pass
        for process in self._processes:
            process.join(timeout=_START_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes = []
