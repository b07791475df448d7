"""Where a server should sit among a model's blocks, and when it should move.

The swarm is as fast as its weakest block (every request passes through all of them), so a
server goes where it lifts the weakest blocks most.  Petals' rule, from
``petals/server/block_selection.py``, re-derived here with deterministic choices:

- **Choosing.**  Of all windows of ``num_blocks_to_serve`` consecutive blocks, take the one whose
  throughputs, sorted ascending, are lexicographically smallest: it holds the weakest block, then
  the weakest second block, and so on.  A gap (a block at 0) is thus always covered, and a
  window holds as many gaps as any window can.  Ties go to the smallest start.
- **Rebalancing.**  A running server takes itself out of the swarm and finds its best start.  If
  it is already there (its window ties with the best), it stays.  Otherwise it imagines moving,
  then lets every server (in PeerID order, until none moves, at most ``_MAX_SIMULATION_PASSES``
  passes) re-place itself in the same way, preferring its current place on ties.  It moves iff
  the bottleneck (the weakest block's throughput) would then be better by a margin:
  ``before < (balance_quality - eps) * after``.  ``balance_quality`` 1.0 moves whenever that
  strictly helps (by more than ``eps``, relatively), 0.0 never moves.
- **Safety.**  A move must not by itself uncover a block that is covered, nor lower the
  bottleneck: the other servers move later, if ever, and until then clients see the swarm the
  move leaves behind.  So a swarm of servers that each move when this says so never loses a
  block, and its bottleneck never drops.

Pure functions over :class:`ServerSpan`; imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from .._errors import ConfigError
from ..dht import ServerState
from ._spans import ServerSpan, block_throughputs, check_spans, live_spans

__all__ = ["choose_best_blocks", "choose_best_start", "should_choose_other_blocks"]

#: Relative margin by which a move must improve the bottleneck (as Petals' ``eps``).
BALANCE_EPS: Final = 1e-3
#: Bound on the simulated rounds of re-placement; each round visits every server once.
_MAX_SIMULATION_PASSES: Final = 32


def _check_length(num_blocks_to_serve: int, total_blocks: int) -> None:
    if (
        not isinstance(num_blocks_to_serve, int)
        or isinstance(num_blocks_to_serve, bool)
        or not 1 <= num_blocks_to_serve <= total_blocks
    ):
        raise ConfigError(
            f"num_blocks_to_serve is an integer in [1, {total_blocks}] (the model's block "
            f"count), not {num_blocks_to_serve!r}"
        )


def _window_key(throughputs: Sequence[float], start: int, length: int) -> list[float]:
    return sorted(throughputs[start : start + length])


def _best_start(throughputs: Sequence[float], length: int, keep: int | None = None) -> int:
    """The best start (see the module docstring); ``keep`` wins ties if it is among the best."""
    best = min(
        range(len(throughputs) - length + 1),
        key=lambda start: _window_key(throughputs, start, length),
    )  # min() returns the first of equals: the smallest start
    if keep is not None and _window_key(throughputs, keep, length) == _window_key(
        throughputs, best, length
    ):
        return keep
    return best


def choose_best_start(throughputs: Sequence[float], num_blocks_to_serve: int) -> int:
    """The start of the window of ``num_blocks_to_serve`` blocks whose sorted ``throughputs`` are
    lexicographically smallest (the weakest blocks weakest); ties go to the smallest start.

    ``throughputs`` holds one finite number >= 0 per block of the model.
    """
    values = list(throughputs)
    if not values:
        raise ConfigError("throughputs is empty: the model has at least one block")
    for block, value in enumerate(values):
        if not isinstance(value, int | float) or not 0 <= value < math.inf:
            raise ConfigError(f"throughput of block {block} is a finite number >= 0, not {value!r}")
    _check_length(num_blocks_to_serve, len(values))
    return _best_start(values, num_blocks_to_serve)


def choose_best_blocks(
    num_blocks_to_serve: int, spans: Iterable[ServerSpan], total_blocks: int
) -> range:
    """The blocks a new server of ``num_blocks_to_serve`` blocks should serve, given ``spans``
    (the live ones count) in a model of ``total_blocks`` blocks."""
    throughputs = block_throughputs(spans, total_blocks)
    start = choose_best_start(throughputs, num_blocks_to_serve)
    return range(start, start + num_blocks_to_serve)


class _Swarm:
    """Mutable block throughputs for the simulation; each block's value is the correctly rounded
    sum of its covering spans' throughputs, so it is the same however it was reached."""

    def __init__(self, spans: Mapping[str, ServerSpan], total_blocks: int) -> None:
        self.spans = dict(spans)
        self._covering: list[dict[str, float]] = [{} for _ in range(total_blocks)]
        for span in self.spans.values():
            self._cover(span)
        self.throughputs = [math.fsum(cover.values()) for cover in self._covering]

    def _cover(self, span: ServerSpan) -> None:
        for block in range(span.start, span.end):
            self._covering[block][span.peer_id] = span.throughput

    def _refresh(self, span: ServerSpan) -> None:
        for block in range(span.start, span.end):
            self.throughputs[block] = math.fsum(self._covering[block].values())

    def remove(self, peer_id: str) -> ServerSpan:
        span = self.spans.pop(peer_id)
        for block in range(span.start, span.end):
            del self._covering[block][peer_id]
        self._refresh(span)
        return span

    def add(self, span: ServerSpan) -> None:
        self.spans[span.peer_id] = span
        self._cover(span)
        self._refresh(span)

    def settle(self) -> None:
        """Let each server re-place itself, in PeerID order, until none moves (bounded)."""
        order = sorted(self.spans)
        for _ in range(_MAX_SIMULATION_PASSES):
            moved = False
            for peer_id in order:
                span = self.remove(peer_id)
                start = _best_start(self.throughputs, span.length, keep=span.start)
                moved |= start != span.start
                self.add(span.moved_to(start))
            if not moved:
                return


def should_choose_other_blocks(
    own_peer_id: str,
    spans: Mapping[str, ServerSpan],
    total_blocks: int,
    balance_quality: float,
) -> bool:
    """Whether the server ``own_peer_id`` should move to
    ``choose_best_blocks(its length, the other spans, total_blocks)``: see the module docstring.

    ``spans`` maps PeerIDs to spans (ours included, live); ``balance_quality`` is in [0, 1].
    """
    if (
        not isinstance(balance_quality, int | float)
        or isinstance(balance_quality, bool)
        or not 0.0 <= balance_quality <= 1.0
    ):
        raise ConfigError(f"balance_quality is a number in [0, 1], not {balance_quality!r}")
    check_spans(spans.values(), total_blocks)
    for peer_id, span in spans.items():
        if span.peer_id != peer_id:
            raise ConfigError(f"span of {span.peer_id} is filed under another PeerID, {peer_id}")
    own = spans.get(own_peer_id)
    if own is None:
        raise ConfigError(f"our own span ({own_peer_id}) is not among the swarm's spans")
    if own.state is ServerState.OFFLINE:
        raise ConfigError(f"our own span ({own_peer_id}) is offline: it has no blocks to move")
    if balance_quality == 0.0 or own.throughput == 0.0:
        return False  # never move / moving would change no block's throughput

    live = live_spans(spans)
    before = block_throughputs(live.values(), total_blocks)
    others = [span for peer_id, span in live.items() if peer_id != own_peer_id]
    new_start = _best_start(block_throughputs(others, total_blocks), own.length, keep=own.start)
    if new_start == own.start:
        return False  # already at a best place

    swarm = _Swarm(live, total_blocks)
    swarm.remove(own_peer_id)
    swarm.add(own.moved_to(new_start))
    moved = swarm.throughputs
    if min(moved) < min(before) or any(
        b > 0.0 and m <= 0.0 for b, m in zip(before, moved, strict=True)
    ):
        return False  # the move alone would weaken the swarm until (unless) others follow
    swarm.settle()
    return min(before) < (balance_quality - BALANCE_EPS) * min(swarm.throughputs)
