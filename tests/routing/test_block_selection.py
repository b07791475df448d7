"""Block choice and rebalancing: spans and their throughputs, the best window for a new server
(gaps first, weakest blocks next, ties to the smallest start), when a running server moves, and
properties on random swarms checked against brute force: optimal windows, gaps filled, no move
that uncovers a block or lowers the bottleneck, and rebalancing that settles."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import pytest
from hypothesis import given, settings, strategies as st

from petals_core._errors import ConfigError
from petals_core.dht import PeerTableSnapshot, ServerState
from petals_core.routing import (
    ServerSpan,
    block_throughputs,
    choose_best_blocks,
    choose_best_start,
    should_choose_other_blocks,
    spans_from_snapshot,
)

from ._servers import JOINING, OFFLINE, ONLINE, server


def span(
    peer_id: str, start: int, end: int, throughput: float = 1.0, state: ServerState = ONLINE
) -> ServerSpan:
    return ServerSpan(peer_id=peer_id, start=start, end=end, throughput=throughput, state=state)


def swarm(*spans: ServerSpan) -> dict[str, ServerSpan]:
    return {s.peer_id: s for s in spans}


# --- spans and throughputs ---------------------------------------------------------------------


def test_span_length_and_validation() -> None:
    s = span("a", 2, 5, throughput=3)
    assert s.length == 3
    assert s.throughput == 3.0
    assert isinstance(s.throughput, float)
    assert s.moved_to(0) == span("a", 0, 3, throughput=3)
    with pytest.raises(ConfigError, match="end is an integer > start=2"):
        span("a", 2, 2)
    with pytest.raises(ConfigError, match="start is an integer >= 0"):
        span("a", -1, 2)
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="throughput is a finite number >= 0"):
            span("a", 0, 1, throughput=bad)
    with pytest.raises(ConfigError, match="peer_id"):
        span("", 0, 1)
    with pytest.raises(ConfigError, match="state is a ServerState"):
        ServerSpan(peer_id="a", start=0, end=1, throughput=1.0, state="online")  # type: ignore[arg-type]


def test_block_throughputs_sum_live_spans_and_ignore_offline() -> None:
    spans = [
        span("a", 0, 2, 1.0),
        span("b", 1, 4, 2.5, JOINING),
        span("c", 0, 4, 100.0, OFFLINE),
    ]
    assert block_throughputs(spans, 5) == [1.0, 3.5, 2.5, 2.5, 0.0]
    assert block_throughputs([], 3) == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match=r"outside the model's 3 blocks"):
        block_throughputs([span("a", 1, 4)], 3)
    with pytest.raises(ConfigError, match="num_blocks"):
        block_throughputs([], 0)


def test_block_throughputs_do_not_depend_on_order() -> None:
    # Sums are correctly rounded, so the same servers give the same value however they come.
    rng = random.Random(7)
    spans = [span(f"p{i}", 0, 3, rng.uniform(0, 1e-3) * 10 ** rng.randint(0, 8)) for i in range(9)]
    expected = block_throughputs(spans, 3)
    assert expected[0] == expected[1] == expected[2]
    for _ in range(20):
        rng.shuffle(spans)
        assert block_throughputs(spans, 3) == expected


def test_spans_from_snapshot() -> None:
    a, a_stale = server(0, 3, throughput=2.0), server(0, 3, throughput=9.0)
    b = server(2, 6, throughput=1.0, state=JOINING)  # reaches past a 4-block model
    gone = server(0, 4, throughput=5.0, state=OFFLINE)
    outside = server(4, 6, throughput=1.0)  # only blocks the model lacks
    blocks = {
        0: {"a": a, "gone": gone},
        1: {"a": a},
        2: {"a": a_stale, "b": b},
        3: {"b": b},
        4: {"b": b, "outside": outside},
    }
    snapshot = PeerTableSnapshot(prefix="model", now=0.0, version=1, blocks=blocks)
    assert spans_from_snapshot(snapshot, 4) == {
        "a": span("a", 0, 3, 2.0),  # the announcement under its lowest block wins
        "b": span("b", 2, 4, 1.0, JOINING),
    }
    empty = PeerTableSnapshot(prefix="model", now=0.0, version=0, blocks={})
    assert spans_from_snapshot(empty, 4) == {}
    with pytest.raises(ConfigError, match="num_blocks"):
        spans_from_snapshot(empty, 0)


# --- choosing blocks ---------------------------------------------------------------------------


def test_empty_swarm_starts_at_zero() -> None:
    assert choose_best_start([0.0] * 10, 4) == 0
    assert choose_best_blocks(4, [], 10) == range(0, 4)
    assert choose_best_blocks(10, [], 10) == range(0, 10)


def test_a_gap_is_filled() -> None:
    spans = [span("a", 0, 3, 5.0), span("b", 5, 8, 5.0)]
    assert choose_best_blocks(2, spans, 8) == range(3, 5)
    # Wider than the gap: the window holds the whole gap.
    assert choose_best_blocks(4, spans, 8) == range(1, 5)  # [0, 0, 5, 5] three ways: first
    # Offline servers leave their blocks empty.
    assert choose_best_blocks(2, [*spans, span("c", 3, 5, 9.0, OFFLINE)], 8) == range(3, 5)


def test_a_weakly_covered_region_is_chosen() -> None:
    # Blocks 0-1 at 10, 2-3 at 1, 4-5 at 3.
    spans = [span("a", 0, 2, 10.0), span("b", 2, 4, 1.0), span("c", 4, 6, 3.0)]
    assert choose_best_blocks(2, spans, 6) == range(2, 4)
    # Three blocks: both windows with the two weakest blocks; the weaker third (3 < 10) wins.
    assert choose_best_blocks(3, spans, 6) == range(2, 5)


def test_ties_go_to_the_smallest_start() -> None:
    assert choose_best_start([1.0, 2.0, 1.0, 2.0], 2) == 0
    assert choose_best_start([3.0, 1.0, 2.0, 2.0, 1.0], 2) == 1  # [1, 2] twice: first
    assert choose_best_start([5.0, 5.0, 5.0], 1) == 0


def test_the_second_weakest_block_decides_between_equal_minima() -> None:
    # Both [1, 3] and [1, 2] hold the weakest block; the window with the weaker second wins.
    assert choose_best_start([3.0, 1.0, 2.0], 2) == 1


def test_choose_validates() -> None:
    with pytest.raises(ConfigError, match=r"num_blocks_to_serve is an integer in \[1, 3\]"):
        choose_best_start([1.0, 1.0, 1.0], 4)
    with pytest.raises(ConfigError, match="num_blocks_to_serve"):
        choose_best_start([1.0], 0)
    with pytest.raises(ConfigError, match="empty"):
        choose_best_start([], 1)
    with pytest.raises(ConfigError, match="block 1"):
        choose_best_start([1.0, math.nan], 1)
    with pytest.raises(ConfigError, match="num_blocks_to_serve"):
        choose_best_blocks(5, [], 4)
    with pytest.raises(ConfigError, match="outside"):
        choose_best_blocks(1, [span("a", 0, 5)], 4)


# --- rebalancing -------------------------------------------------------------------------------


def test_a_crowded_server_moves_to_the_bottleneck() -> None:
    # Three servers on block 0, one on block 1: the bottleneck is 1, and 2 after a move.
    spans = swarm(span("a", 0, 1), span("b", 0, 1), span("c", 0, 1), span("d", 1, 2))
    assert should_choose_other_blocks("a", spans, 2, 1.0)
    assert not should_choose_other_blocks("d", spans, 2, 1.0)  # moving it would open a gap
    # The gain is 2x: a quality of 1/2 or less tolerates it, 0 never moves.
    assert should_choose_other_blocks("a", spans, 2, 0.6)
    assert not should_choose_other_blocks("a", spans, 2, 0.4)
    assert not should_choose_other_blocks("a", spans, 2, 0.0)


def test_a_balanced_swarm_stays() -> None:
    spans = swarm(span("a", 0, 2), span("b", 2, 4), span("c", 0, 2), span("d", 2, 4))
    assert not any(should_choose_other_blocks(p, spans, 4, 1.0) for p in spans)


def test_a_move_that_helps_only_marginally_needs_quality_one() -> None:
    # b's move lifts the bottleneck from 1.0 to 1.2 (block 1 gets b's 0.2 more than it loses
    # from block 0); 1.0 / 1.2 = 0.83.
    spans = swarm(span("a", 0, 1, 1.4), span("b", 0, 1, 0.2), span("c", 1, 2, 1.0))
    assert should_choose_other_blocks("b", spans, 2, 1.0)
    assert should_choose_other_blocks("b", spans, 2, 0.9)
    assert not should_choose_other_blocks("b", spans, 2, 0.8)


def test_a_move_never_uncovers_a_block_even_to_fill_a_gap() -> None:
    # a alone holds block 0; blocks 2-3 are a gap that a 2-block server would rather fill.
    spans = swarm(span("a", 0, 2, 1.0), span("b", 1, 2, 5.0))
    assert block_throughputs(spans.values(), 4) == [1.0, 6.0, 0.0, 0.0]
    assert choose_best_blocks(2, [spans["b"]], 4) == range(2, 4)
    assert not should_choose_other_blocks("a", spans, 4, 1.0)


def test_rebalancing_validates() -> None:
    spans = swarm(span("a", 0, 2), span("b", 2, 4))
    with pytest.raises(ConfigError, match="not among"):
        should_choose_other_blocks("z", spans, 4, 1.0)
    for bad in (-0.1, 1.5, math.nan):
        with pytest.raises(ConfigError, match=r"balance_quality is a number in \[0, 1\]"):
            should_choose_other_blocks("a", spans, 4, bad)
    with pytest.raises(ConfigError, match="outside"):
        should_choose_other_blocks("a", spans, 3, 1.0)
    with pytest.raises(ConfigError, match="offline"):
        should_choose_other_blocks("a", {**spans, "a": span("a", 0, 2, state=OFFLINE)}, 4, 1.0)
    with pytest.raises(ConfigError, match="another PeerID"):
        should_choose_other_blocks("a", {**spans, "c": span("d", 0, 1)}, 4, 1.0)


def test_a_server_without_throughput_never_moves() -> None:
    spans = swarm(span("a", 0, 1, 0.0), span("b", 0, 1), span("c", 1, 2, 0.0))
    assert not should_choose_other_blocks("a", spans, 2, 1.0)


# --- properties on random swarms ---------------------------------------------------------------

THROUGHPUTS = st.one_of(
    st.sampled_from([0.0, 1.0, 2.0, 3.0]),
    st.floats(min_value=0.0, max_value=100.0, allow_nan=False, allow_infinity=False),
)
STATES = st.sampled_from([ONLINE, ONLINE, ONLINE, JOINING, OFFLINE])


@st.composite
def swarms(
    draw: st.DrawFn, *, states: st.SearchStrategy[ServerState] = STATES
) -> tuple[int, dict[str, ServerSpan]]:
    total = draw(st.integers(1, 40))
    spans: dict[str, ServerSpan] = {}
    for index in range(draw(st.integers(0, 12))):
        length = draw(st.integers(1, total))
        start = draw(st.integers(0, total - length))
        peer_id = f"peer{index:02d}"
        spans[peer_id] = span(peer_id, start, start + length, draw(THROUGHPUTS), draw(states))
    return total, spans


def windows(throughputs: list[float], length: int) -> list[tuple[list[float], int]]:
    return [
        (sorted(throughputs[start : start + length]), start)
        for start in range(len(throughputs) - length + 1)
    ]


def move(spans: Mapping[str, ServerSpan], peer_id: str, total: int) -> dict[str, ServerSpan]:
    """The swarm once ``peer_id`` left and rejoined at the best start for the others."""
    others = [s for p, s in spans.items() if p != peer_id]
    start = choose_best_start(block_throughputs(others, total), spans[peer_id].length)
    return {**spans, peer_id: spans[peer_id].moved_to(start)}


#: A swarm's spans, its block throughputs, a window length, the start chosen for it.
Window = tuple[dict[str, ServerSpan], list[float], int, int]


@st.composite
def chosen_windows(draw: st.DrawFn) -> Window:
    """A swarm's spans and block throughputs, a window length drawn for it, and the start
    chosen for a new server of that length."""
    total, spans = draw(swarms())
    length = draw(st.integers(1, total))
    throughputs = block_throughputs(spans.values(), total)
    return spans, throughputs, length, choose_best_start(throughputs, length)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(chosen_windows())
def test_the_chosen_window_is_the_best_by_brute_force(window: Window) -> None:
    spans, throughputs, length, start = window
    total = len(throughputs)
    assert choose_best_blocks(length, spans.values(), total) == range(start, start + length)
    chosen = sorted(throughputs[start : start + length])
    for key, other in windows(throughputs, length):
        assert chosen <= key
        if key == chosen:
            assert start <= other


@settings(max_examples=300, deadline=None, derandomize=True)
@given(chosen_windows())
def test_a_new_server_fills_as_much_of_the_gaps_as_any_window(window: Window) -> None:
    # Every block lies in some window, so a gap anywhere means the chosen window holds one; and
    # more zeros sort first, so it holds as many as any window of its length does.
    _, throughputs, length, start = window
    total = len(throughputs)
    gaps_covered = throughputs[start : start + length].count(0.0)
    most = max(throughputs[s : s + length].count(0.0) for s in range(total - length + 1))
    assert gaps_covered == most
    if 0.0 in throughputs:
        assert gaps_covered >= 1
    # More generally, the window holds a weakest block of the swarm.
    assert min(throughputs[start : start + length]) == min(throughputs)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(swarms(), st.sampled_from([1.0, 0.9, 0.5]))
def test_no_move_opens_a_gap_or_lowers_the_bottleneck(
    swarm_: tuple[int, dict[str, ServerSpan]], balance_quality: float
) -> None:
    total, spans = swarm_
    before = block_throughputs(spans.values(), total)
    for peer_id in spans:
        if spans[peer_id].state is OFFLINE:
            continue
        if not should_choose_other_blocks(peer_id, spans, total, balance_quality):
            continue
        assert should_choose_other_blocks(peer_id, spans, total, 1.0)  # monotone in the quality
        moved = move(spans, peer_id, total)
        assert moved[peer_id].start != spans[peer_id].start
        after = block_throughputs(moved.values(), total)
        assert all(a > 0.0 for a, b in zip(after, before, strict=True) if b > 0.0)
        assert min(after) >= min(before)
        assert not should_choose_other_blocks(peer_id, spans, total, 0.0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(swarms(states=st.sampled_from([ONLINE, ONLINE, JOINING, OFFLINE])))
def test_rebalancing_settles_without_ever_weakening_the_swarm(
    swarm_: tuple[int, dict[str, ServerSpan]],
) -> None:
    # Servers check one at a time in PeerID order and move when told to, until a whole round
    # passes without a move.  Each move keeps every covered block covered and never lowers the
    # bottleneck; and the process stops (the bound is generous: a few moves per server).
    total, spans = swarm_
    live = [p for p in sorted(spans) if spans[p].state is not OFFLINE]
    covered = [t > 0.0 for t in block_throughputs(spans.values(), total)]
    bottleneck = min(block_throughputs(spans.values(), total))
    moves = 0
    settled = False
    while moves <= 10 * len(spans) and not settled:
        settled = True
        for peer_id in live:
            if should_choose_other_blocks(peer_id, spans, total, 1.0):
                spans = move(spans, peer_id, total)
                moves += 1
                settled = False
                throughputs = block_throughputs(spans.values(), total)
                assert min(throughputs) >= bottleneck
                assert all(t > 0.0 for t, was in zip(throughputs, covered, strict=True) if was)
                bottleneck = min(throughputs)
                covered = [t > 0.0 for t in throughputs]
    assert settled, f"still moving after {moves} moves"
    assert not any(should_choose_other_blocks(p, spans, total, 1.0) for p in live)
