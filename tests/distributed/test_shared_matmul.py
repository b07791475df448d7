"""Threads reaching the LM head together share one matmul, and each gets its own rows back."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from petals_core.distributed import ChunkedLMHead
from petals_core.distributed._shared_matmul import SharedMatmul

DEADLINE_S = 60.0


def test_a_thread_alone_computes_at_once() -> None:
    shared = SharedMatmul()
    weight = torch.randn(5, 3)
    rows = torch.randn(2, 3)
    assert torch.equal(shared(rows, lambda x: x @ weight.T), rows @ weight.T)
    assert (shared.batches, shared.rows) == (1, 2)


def test_rows_queued_while_one_computes_go_in_one_matmul() -> None:
    shared = SharedMatmul()
    weight = torch.randn(7, 4)
    computing = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    def compute(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        computing.set()
        assert release.wait(DEADLINE_S)
        return x @ weight.T

    inputs = [torch.randn(n, 4) for n in (1, 2, 3)]
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        results[i] = shared(inputs[i], compute)

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert computing.wait(DEADLINE_S)  # the first thread computes ...
    others = [threading.Thread(target=run, args=(i,)) for i in (1, 2)]
    for thread in others:
        thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while len(shared._queue) < 2:  # ... while two queue up
        assert time.monotonic() < deadline, "the other threads did not queue"
        time.sleep(0.001)
    release.set()
    for thread in [first, *others]:
        thread.join(DEADLINE_S)
    assert calls == [1, 5]  # the queued rows went together
    for i, rows in enumerate(inputs):
        torch.testing.assert_close(results[i], rows @ weight.T)
        assert results[i].shape == (rows.shape[0], 7)
    assert not shared._busy


def test_an_error_reaches_every_thread_of_the_batch() -> None:
    shared = SharedMatmul()

    def fail(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        shared(torch.randn(1, 2), fail)
    assert torch.equal(shared(torch.ones(1, 2), lambda x: x * 2), torch.full((1, 2), 2.0))


def test_the_lm_head_shares_only_without_autograd() -> None:
    head = ChunkedLMHead(4, 9)
    torch.nn.init.normal_(head.weight)
    hidden = torch.randn(2, 1, 4)
    expected = head(hidden)
    head.share_across_threads()
    assert head.shared is not None
    with torch.no_grad():
        torch.testing.assert_close(head(hidden), expected)
    assert head.shared.batches == 1
    head(hidden)  # with autograd: not shared
    assert head.shared.batches == 1
    head.share_across_threads(False)
    assert head.shared is None
