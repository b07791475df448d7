"""The endpoint's lineup of decode steps, on its own: batches, the hold for a late request, and
leaving. Virtual time (trio's autojump clock): the hold is waited out without real waiting, and
the compute runs inline (a worker thread would let the clock jump while it runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import trio
import trio.testing

from petals_core.api import Sampling
from petals_core.api._lineup import Entry, Lineup
from petals_core.api._sampling import Chooser

GREEDY = Chooser(Sampling(max_tokens=1, temperature=0.0))


class _Head:
    """A compute that records each batch's requests and gives each row its first hidden value."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, entries: list[Entry]) -> None:
        self.batches.append(len(entries))
        for entry in entries:
            entry.tokens = entry.hidden[:, 0].long()


async def _inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _hidden(value: int) -> torch.Tensor:
    return torch.full((1, 4), float(value))


async def test_requests_arriving_together_go_in_one_batch_and_get_their_own_rows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    head = _Head()
    got: dict[int, int] = {}
    async with trio.open_nursery() as nursery:
        lineup = Lineup(head, nursery, run_sync=_inline)

        async def request(value: int) -> None:
            tokens, logprobs = await lineup.choose(value, _hidden(value), GREEDY)
            assert logprobs is None
            got[value] = int(tokens[0])
            lineup.leave(value)

        async with trio.open_nursery() as requests:
            for value in (3, 5, 7):
                requests.start_soon(request, value)
    assert head.batches == [3]
    assert got == {3: 3, 5: 5, 7: 7}
    assert (lineup.batches, lineup.requests) == (1, 3)


async def test_a_late_request_holds_the_others_up_for_about_one_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    head = _Head()
    async with trio.open_nursery() as nursery:
        lineup = Lineup(head, nursery, run_sync=_inline)
        late_released = trio.Event()

        async def steady() -> None:
            for _ in range(4):
                await trio.sleep(1.0)  # (virtual) a step through the servers
                await lineup.choose("steady", _hidden(1), GREEDY)
            lineup.leave("steady")

        async def late() -> None:
            await trio.sleep(1.0)
            await lineup.choose("late", _hidden(2), GREEDY)
            await trio.sleep(30.0)  # a server being replaced
            late_released.set()
            lineup.leave("late")

        start = trio.current_time()
        async with trio.open_nursery() as requests:
            requests.start_soon(steady)
            requests.start_soon(late)
        elapsed = trio.current_time() - start
    # Together once; then the steady request waits one step for the late one each time, and
    # goes on alone: 4 steps and 3 holds, well before the late one comes back.
    assert head.batches == [2, 1, 1, 1]
    assert late_released.is_set()
    assert 31.0 <= elapsed < 32.0


async def test_a_request_that_leaves_completes_the_batch_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    head = _Head()
    async with trio.open_nursery() as nursery:
        lineup = Lineup(head, nursery, run_sync=_inline)
        await lineup.choose("a", _hidden(1), GREEDY)  # alone: at once
        lineup._steps_s.extend([100.0] * 8)  # the usual step is long: the hold would be too
        lineup._members.add("b")  # b decodes, and is still in its step
        waited_from = trio.current_time()

        async def b_fails() -> None:
            await trio.sleep(1.0)
            lineup.leave("b")

        nursery.start_soon(b_fails)
        await lineup.choose("a", _hidden(1), GREEDY)
        assert trio.current_time() - waited_from < 2.0
        lineup.leave("a")
    assert head.batches == [1, 1]


async def test_a_request_whose_choice_fails_fails_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    def head(entries: list[Entry]) -> None:
        for entry in entries:
            if entry.hidden[0, 0] < 0:
                entry.error = ValueError("bad logits")
            else:
                entry.tokens = torch.tensor([1])

    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        lineup = Lineup(head, nursery, run_sync=_inline)

        async def request(name: str, value: int) -> None:
            try:
                outcomes[name] = await lineup.choose(name, _hidden(value), GREEDY)
            except ValueError as exc:
                outcomes[name] = exc
            lineup.leave(name)

        async with trio.open_nursery() as requests:
            requests.start_soon(request, "good", 1)
            requests.start_soon(request, "bad", -1)
    assert isinstance(outcomes["bad"], ValueError)
    good = outcomes["good"]
    assert isinstance(good, tuple) and int(good[0][0]) == 1
