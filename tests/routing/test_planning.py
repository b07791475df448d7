"""Client route planners: which servers are usable, routes that cover exactly the blocks asked
for through usable servers only, the least-latency route checked against brute force on small
random swarms (estimated and measured hops, cache penalties, slow servers) and against a plain
cubic dynamic program on swarms of dozens of servers, max-throughput
sampling in proportion to throughput, the fewest spans for the greedy planner, and missing
blocks named."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from petals_core._errors import ConfigError, PetalsError
from petals_core.dht import ServerInfo
from petals_core.routing import (
    MissingBlocksError,
    RouteSpan,
    make_route_greedy,
    make_route_impartial,
    make_route_max_throughput,
    make_route_min_latency,
    route_cost,
    usable_servers,
)
from petals_core.transport import PeerID

from ._servers import JOINING, OFFLINE, ONLINE, server

# Valid PeerIDs (next_pings keys must be), in sorted order so that "p0" < "p1" < ... holds too.
PEERS = sorted(str(PeerID.from_public_key(bytes([k + 1]) * 32)) for k in range(12))
P = PEERS
Swarm = dict[str, ServerInfo]


def spans(route: list[RouteSpan]) -> list[tuple[str, int, int]]:
    return [(span.peer_id, span.start, span.end) for span in route]


def check_route(route: list[RouteSpan], servers: Swarm, start: int, end: int) -> None:
    """Contiguous, exactly [start, end), each span within its (online) server's announced span,
    no two neighbours on one server."""
    assert route, "empty route"
    assert route[0].start == start
    assert route[-1].end == end
    for before, after in itertools.pairwise(route):
        assert before.end == after.start
        assert before.peer_id != after.peer_id
    for span in route:
        info = servers[span.peer_id]
        assert info.state is ONLINE
        assert info.start_block <= span.start < span.end <= info.end_block


def all_routes(servers: Swarm, start: int, end: int) -> Iterator[list[RouteSpan]]:
    """Every route: any online server holding the next block, for any length, then the rest."""
    online = {p: i for p, i in servers.items() if i.state is ONLINE}

    def rest(block: int, previous: str | None) -> Iterator[list[RouteSpan]]:
        if block == end:
            yield []
            return
        for peer_id, info in online.items():
            if peer_id == previous or not info.start_block <= block < info.end_block:
                continue
            for stop in range(block + 1, min(info.end_block, end) + 1):
                head = RouteSpan(peer_id=peer_id, start=block, end=stop)
                for tail in rest(stop, peer_id):
                    yield [head, *tail]

    return rest(start, None)


def uncovered(servers: Swarm, start: int, end: int) -> list[int]:
    return [
        block
        for block in range(start, end)
        if not any(
            i.state is ONLINE and i.start_block <= block < i.end_block for i in servers.values()
        )
    ]


# --- random swarms ------------------------------------------------------------------------------


def random_swarm(
    rng: random.Random, servers: tuple[int, int] = (1, 12), blocks: tuple[int, int] = (1, 10)
) -> tuple[Swarm, int]:
    """A swarm drawn from ``rng`` (uniform choices, so that small swarms are rich): random spans,
    states (mostly online), throughputs, inference RPS (some unknown, a few 0), caches, adapters
    and measured pings to other servers."""
    num_blocks = rng.randint(*blocks)
    peers = P[: rng.randint(*servers)]

    def seconds() -> float:
        return rng.choice([0.0, 0.01, 0.05, 0.1, rng.uniform(0.0, 0.3)])

    swarm: Swarm = {}
    for peer_id in peers:
        length = rng.randint(1, num_blocks if rng.random() < 0.3 else min(3, num_blocks))
        start = rng.randint(0, num_blocks - length)
        end = start + length
        others = [p for p in peers if p != peer_id]
        swarm[peer_id] = server(
            start,
            end,
            throughput=rng.choice([0.0, 1.0, 10.0, rng.uniform(0.0, 1e3)]),
            state=rng.choice([ONLINE] * 8 + [JOINING, OFFLINE]),
            inference_rps=rng.choice([None, None, 0.0, 10.0, 100.0, rng.uniform(1.0, 1e3)]),
            cache_tokens_left=rng.choice([None, rng.randint(0, 40)]),
            adapters=tuple(a for a in ("a", "b") if rng.random() < 0.7),
            next_pings={p: seconds() / 2 for p in rng.sample(others, rng.randint(0, len(others)))},
            reachability=rng.choice([None, None, "public", "cone", "symmetric"]),
        )
    return swarm, num_blocks


def random_case(
    rng: random.Random, servers: tuple[int, int] = (1, 12), blocks: tuple[int, int] = (1, 10)
) -> tuple[Swarm, int, int, dict[str, Any]]:
    """A swarm, a block range in it, and the latency model's parameters."""
    swarm, num_blocks = random_swarm(rng, servers, blocks)
    start = rng.randrange(num_blocks) if rng.random() < 0.5 else 0
    end = rng.randint(start + 1, num_blocks) if rng.random() < 0.5 else num_blocks
    pinged = [p for p in sorted(swarm) if rng.random() < 0.7]
    model: dict[str, Any] = {
        "client_pings": {p: rng.choice([0.0, 0.02, 0.1, rng.uniform(0.0, 0.3)]) for p in pinged},
        "cache_tokens_needed": rng.choice([0, 0, 1, 3, 10]),
        "default_ping_s": rng.choice([0.0, 0.05, 0.1, 0.25]),
        "default_inference_rps": rng.choice([50.0, 300.0]),
        "cache_penalty_s": rng.choice([0.0, 0.03, 1000.0]),
    }
    return swarm, start, end, model


seeds = st.integers(0, 2**64 - 1)


PROPERTIES = settings(max_examples=1000, derandomize=True, deadline=None)


@PROPERTIES
@given(
    seeds,
    st.sets(st.sampled_from(P[:12]), max_size=3),
    st.none() | st.sets(st.sampled_from(P[:12]), min_size=4),
    st.sets(st.sampled_from(P[:12]), max_size=2),
    st.none() | st.sampled_from(["a", "b"]),
    st.integers(0, 2**32),
)
def test_routes_cover_the_blocks_through_usable_servers_only(
    case_seed: int,
    banned: set[str],
    allowed: set[str] | None,
    blocked: set[str],
    adapter: str | None,
    seed: int,
) -> None:
    swarm, start, end, model = random_case(random.Random(case_seed))
    usable = usable_servers(swarm, banned=banned, allowed=allowed, blocked=blocked, adapter=adapter)
    for peer_id, info in usable.items():
        assert info.state is ONLINE
        assert peer_id not in banned and peer_id not in blocked
        assert allowed is None or peer_id in allowed
        assert adapter is None or adapter in info.adapters
    assert sorted(usable) == [
        p
        for p in sorted(swarm)
        if swarm[p].state is ONLINE
        and p not in banned | blocked
        and (allowed is None or p in allowed)
        and (adapter is None or adapter in swarm[p].adapters)
    ]
    missing = uncovered(usable, start, end)
    planners = {
        "min_latency": lambda: make_route_min_latency(usable, start, end, **model),
        "max_throughput": lambda: make_route_max_throughput(
            usable, start, end, rng=random.Random(seed)
        ),
        "greedy": lambda: make_route_greedy(usable, start, end),
        "impartial": lambda: make_route_impartial(
            usable, start, end, rank=lambda peer: hashlib.sha256(f"{seed}{peer}".encode()).digest()
        ),
    }
    for name, plan in planners.items():
        if missing:
            with pytest.raises(MissingBlocksError) as caught:
                plan()
            assert caught.value.blocks == tuple(missing), name
        else:
            check_route(plan(), usable, start, end)


@settings(max_examples=2000, derandomize=True, deadline=None)
@given(seeds)
def test_min_latency_matches_brute_force(seed: int) -> None:
    swarm, start, end, model = random_case(random.Random(seed), servers=(3, 6), blocks=(3, 6))
    if uncovered(swarm, start, end):
        with pytest.raises(MissingBlocksError):
            make_route_min_latency(swarm, start, end, **model)
        return
    route = make_route_min_latency(swarm, start, end, **model)
    check_route(route, swarm, start, end)
    cost = route_cost(route, swarm, **model)
    best = min(route_cost(r, swarm, **model) for r in all_routes(swarm, start, end))
    assert math.isclose(cost, best, rel_tol=1e-9, abs_tol=1e-12), (spans(route), cost, best)


@PROPERTIES
@given(seeds)
def test_greedy_takes_the_fewest_spans(seed: int) -> None:
    swarm, start, end, _ = random_case(random.Random(seed), servers=(3, 6), blocks=(3, 6))
    if uncovered(swarm, start, end):
        return
    route = make_route_greedy(swarm, start, end)
    check_route(route, swarm, start, end)
    assert len(route) == min(len(r) for r in all_routes(swarm, start, end))
    assert make_route_greedy(dict(reversed(swarm.items())), start, end) == route


MANY = sorted(str(PeerID.from_public_key(bytes([k + 1, 7]) * 16)) for k in range(40))


def reference_min_latency(
    servers: Swarm,
    start: int,
    end: int,
    *,
    client_pings: Mapping[str, float],
    cache_tokens_needed: int,
    default_ping_s: float,
    default_inference_rps: float,
    cache_penalty_s: float,
) -> float:
    """The least route cost by the plainest dynamic program: for every boundary and server, try
    every entry point and every source (cubic, fine for a few dozen servers and blocks)."""
    online = {p: i for p, i in servers.items() if i.state is ONLINE and i.inference_rps != 0.0}

    def block_s(info: ServerInfo) -> float:
        rps = default_inference_rps if info.inference_rps is None else info.inference_rps
        return 1.0 / rps

    def penalised(info: ServerInfo, length: int) -> bool:
        if cache_tokens_needed == 0 or info.cache_tokens_left is None:
            return False
        return length > info.cache_tokens_left // cache_tokens_needed

    def extra(p: str) -> float:
        # Reached only through a relay: one more leg where nothing was measured.
        return default_ping_s if online[p].reachability == "symmetric" else 0.0

    def client_leg(p: str) -> float:
        return client_pings.get(p, default_ping_s + extra(p))

    def hop(a: str, b: str) -> float:
        measured = online[a].next_pings.get(b)
        if measured is not None:
            return measured
        if a in client_pings and b in client_pings:
            return client_pings[a] / 2 + client_pings[b] / 2
        return default_ping_s + extra(b)

    holds = {p: range(max(i.start_block, start), min(i.end_block, end)) for p, i in online.items()}
    enter: dict[int, dict[str, float]] = {
        start: {p: client_leg(p) for p in online if start in holds[p]}
    }
    arrive: dict[int, dict[str, float]] = {}
    for e in range(start + 1, end + 1):
        arrive[e] = {}
        for p, info in online.items():
            if e - 1 not in holds[p]:
                continue
            best = math.inf
            for b in range(holds[p].start, e):
                if p in enter.get(b, {}):
                    cost = enter[b][p] + (e - b) * block_s(info)
                    if penalised(info, e - b):
                        cost += cache_penalty_s
                    best = min(best, cost)
            arrive[e][p] = best
        if e < end:
            enter[e] = {
                t: min(
                    (a + hop(s, t) for s, a in arrive[e].items() if s != t),
                    default=math.inf,
                )
                for t in online
                if e in holds[t]
            }
    return min(a + client_leg(p) for p, a in arrive[end].items())


@settings(max_examples=150, derandomize=True, deadline=None)
@given(seeds)
def test_min_latency_matches_a_plain_dynamic_program_on_larger_swarms(seed: int) -> None:
    """Dozens of servers with long, overlapping spans, measured pings shorter and longer than
    their estimates, and cache limits inside the spans: what brute force cannot enumerate."""
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 24)
    peers = MANY[: rng.randint(8, len(MANY))]
    swarm: Swarm = {}
    for index, peer_id in enumerate(peers):
        length = rng.randint(1, num_blocks)
        first = rng.randint(0, num_blocks - length)
        if index * 4 < num_blocks:  # the first few tile the model
            first, length = index * 4, min(4, num_blocks - index * 4)
        swarm[peer_id] = server(
            first,
            first + length,
            inference_rps=rng.choice([None, rng.uniform(50.0, 1000.0), 20.0]),
            cache_tokens_left=rng.choice([None, rng.randint(0, 60)]),
            state=rng.choice([ONLINE] * 9 + [OFFLINE]),
            reachability=rng.choice([None, "public", "cone", "symmetric"]),
        )
    for peer_id, info in list(swarm.items()):
        others = [p for p in peers if p != peer_id]
        pinged = rng.sample(others, rng.randint(0, min(6, len(others))))
        swarm[peer_id] = attrs.evolve(
            info, next_pings={p: rng.choice([0.0, rng.uniform(0.0, 0.4)]) for p in pinged}
        )
    model: dict[str, Any] = {
        "client_pings": {
            p: rng.choice([0.0, rng.uniform(0.0, 0.3)]) for p in peers if rng.random() < 0.7
        },
        "cache_tokens_needed": rng.choice([0, 1, 4, 10]),
        "default_ping_s": rng.choice([0.0, 0.1, 0.25]),
        "default_inference_rps": rng.choice([50.0, 300.0]),
        "cache_penalty_s": rng.choice([0.0, 0.05, 1000.0]),
    }
    start = rng.randrange(num_blocks) if rng.random() < 0.3 else 0
    end = num_blocks if rng.random() < 0.7 else rng.randint(start + 1, num_blocks)
    if uncovered({p: i for p, i in swarm.items() if i.inference_rps != 0.0}, start, end):
        return
    route = make_route_min_latency(swarm, start, end, **model)
    check_route(route, swarm, start, end)
    best = reference_min_latency(swarm, start, end, **model)
    assert math.isclose(route_cost(route, swarm, **model), best, rel_tol=1e-9, abs_tol=1e-12)


# --- min latency, by hand -----------------------------------------------------------------------


def test_min_latency_picks_fast_servers_and_short_hops() -> None:
    swarm = {
        P[0]: server(0, 4, inference_rps=10.0),  # 0.1 s per block
        P[1]: server(0, 2, inference_rps=100.0),
        P[2]: server(2, 4, inference_rps=100.0),
    }
    pings = {P[0]: 0.01, P[1]: 0.01, P[2]: 0.01}
    # Two fast servers: 0.01 + 0.02 + 0.01 (estimated hop) + 0.02 + 0.01 beats 0.42 on P0.
    route = make_route_min_latency(swarm, 0, 4, client_pings=pings)
    assert spans(route) == [(P[1], 0, 2), (P[2], 2, 4)]
    assert route_cost(route, swarm, client_pings=pings) == pytest.approx(0.07)
    # Unless the hop between them is slow (measured): then a detour through P0 for one block
    # (0.01 + 0.01 + 0.01 + 0.1 + 0.01 + 0.02 + 0.01) beats it, and P0 alone (0.42).
    swarm[P[1]] = server(0, 2, inference_rps=100.0, next_pings={P[2]: 1.0})
    route = make_route_min_latency(swarm, 0, 4, client_pings=pings)
    assert spans(route) == [(P[1], 0, 1), (P[0], 1, 2), (P[2], 2, 4)]
    assert route_cost(route, swarm, client_pings=pings) == pytest.approx(0.17)
    # The default ping stands in for an unknown one; the default RPS for an unknown one.
    assert route_cost(
        [RouteSpan(peer_id=P[0], start=0, end=4)], swarm, client_pings={}, default_ping_s=0.5
    ) == pytest.approx(1.4)
    assert route_cost(
        [RouteSpan(peer_id=P[1], start=0, end=2), RouteSpan(peer_id=P[2], start=2, end=4)],
        {**swarm, P[2]: server(2, 4)},
        client_pings={},
        default_ping_s=0.5,
        default_inference_rps=20.0,
    ) == pytest.approx(0.5 + 0.02 + 1.0 + 0.1 + 0.5)


def test_min_latency_may_switch_away_from_span_boundaries() -> None:
    # Both servers hold all 4 blocks; B is fast but far from the client, A slow but near, and
    # they measured a fast link: A runs the first and last block, B the middle two.
    a, b = P[0], P[1]
    swarm = {
        a: server(0, 4, inference_rps=1.0, next_pings={b: 0.0}),
        b: server(0, 4, inference_rps=100.0, next_pings={a: 0.0}),
    }
    pings = {a: 0.0, b: 10.0}
    route = make_route_min_latency(swarm, 0, 4, client_pings=pings)
    assert spans(route) == [(a, 0, 1), (b, 1, 3), (a, 3, 4)]
    assert route_cost(route, swarm, client_pings=pings) == pytest.approx(2.02)


def test_cache_penalty_steers_to_servers_with_room() -> None:
    roomy, tight = P[0], P[1]
    swarm = {
        roomy: server(0, 4, inference_rps=10.0, cache_tokens_left=4_000),
        tight: server(0, 4, inference_rps=1000.0, cache_tokens_left=1_000),
    }
    pings = {roomy: 0.01, tight: 0.01}
    # 4 blocks x 100 tokens fit in both.
    assert spans(
        make_route_min_latency(swarm, 0, 4, client_pings=pings, cache_tokens_needed=100)
    ) == [(tight, 0, 4)]
    # 4 x 1000 only fit in the roomy one; the tight one still takes one block per span (each
    # span is judged on its own), first and last, where the client's hops go anyway.
    route = make_route_min_latency(swarm, 0, 4, client_pings=pings, cache_tokens_needed=1000)
    assert spans(route) == [(tight, 0, 1), (roomy, 1, 3), (tight, 3, 4)]
    # Over the cache everywhere: the penalty is paid once, on the fast server.
    route = make_route_min_latency(swarm, 0, 4, client_pings=pings, cache_tokens_needed=5000)
    assert spans(route) == [(tight, 0, 4)]
    assert route_cost(
        route, swarm, client_pings=pings, cache_tokens_needed=5000, cache_penalty_s=7.0
    ) == pytest.approx(0.02 + 0.004 + 7.0)


def test_min_latency_ignores_servers_not_online_and_avoids_zero_rps() -> None:
    swarm = {
        P[0]: server(0, 2, inference_rps=1000.0, state=JOINING),
        P[1]: server(0, 2, inference_rps=1.0),
        P[2]: server(0, 2, inference_rps=0.0),
    }
    assert spans(make_route_min_latency(swarm, 0, 2, client_pings={})) == [(P[1], 0, 2)]
    # Only a server that announces no inference at all: it takes forever, but it is a route.
    only = {P[2]: swarm[P[2]]}
    route = make_route_min_latency(only, 0, 2, client_pings={})
    assert spans(route) == [(P[2], 0, 2)]
    assert route_cost(route, only, client_pings={}) == math.inf


# --- max throughput -----------------------------------------------------------------------------


def _first_choices(swarm: Swarm, samples: int, seed: int = 0) -> Counter[str]:
    rng = random.Random(seed)
    return Counter(
        make_route_max_throughput(swarm, 0, 1, rng=rng)[0].peer_id for _ in range(samples)
    )


def _within_binomial(count: int, samples: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(count - samples * p) <= sigmas * math.sqrt(samples * p * (1 - p)) + 1


@pytest.mark.parametrize(
    "throughputs", [[5.0, 3.0, 2.0], [1000.0, 500.0, 1.0], [1.0, 1.0, 1.0, 1.0], [7.0, 0.0, 3.0]]
)
def test_max_throughput_picks_in_proportion_to_throughput(throughputs: list[float]) -> None:
    swarm = {P[k]: server(0, 1, throughput=t) for k, t in enumerate(throughputs)}
    samples = 10_000
    counts = _first_choices(swarm, samples)
    total = sum(throughputs)
    for k, throughput in enumerate(throughputs):
        share = throughput / total
        assert _within_binomial(counts[P[k]], samples, share), (k, counts[P[k]], share)
    if throughputs == [1000.0, 500.0, 1.0]:
        assert counts[P[2]] <= 20  # ~0.07%: about 7 of 10,000


def test_max_throughput_zero_throughputs_are_uniform_and_only_when_all_are_zero() -> None:
    swarm = {P[k]: server(0, 1, throughput=0.0) for k in range(4)}
    counts = _first_choices(swarm, 4_000)
    assert all(_within_binomial(counts[P[k]], 4_000, 0.25) for k in range(4))
    swarm[P[4]] = server(0, 1, throughput=1e-9)
    assert _first_choices(swarm, 1_000) == Counter({P[4]: 1_000})


def test_max_throughput_runs_each_server_to_the_end_of_its_span() -> None:
    swarm = {
        P[0]: server(0, 3, throughput=1.0),
        P[1]: server(2, 6, throughput=1.0),
        P[2]: server(3, 8, throughput=1.0),
    }
    seen = set()
    rng = random.Random(1)
    for _ in range(200):
        route = make_route_max_throughput(swarm, 1, 7, rng=rng)
        check_route(route, swarm, 1, 7)
        for span in route[:-1]:
            assert span.end == swarm[span.peer_id].end_block
        seen.add(tuple(spans(route)))
    assert seen == {((P[0], 1, 3), (P[2], 3, 7)), ((P[0], 1, 3), (P[1], 3, 6), (P[2], 6, 7))}
    # Reproducible from the seed.
    assert make_route_max_throughput(swarm, 0, 8, rng=random.Random(5)) == (
        make_route_max_throughput(swarm, 0, 8, rng=random.Random(5))
    )


# --- impartial ----------------------------------------------------------------------------------


@PROPERTIES
@given(seeds, st.lists(st.floats(0.0, 1e6), min_size=12, max_size=12))
def test_impartial_routes_follow_the_rank_whatever_servers_announce(
    seed: int, throughputs: list[float]
) -> None:
    """Checkers are drawn by the caller's rank alone: announcing more throughput (or anything
    else but the blocks held) draws no more checks."""
    swarm, start, end, _ = random_case(random.Random(seed), servers=(3, 12), blocks=(3, 12))
    if uncovered(swarm, start, end):
        return
    keys = {peer: random.Random(f"{seed}{peer}").randbytes(8) for peer in swarm}
    route = make_route_impartial(swarm, start, end, rank=keys.__getitem__)
    check_route(route, swarm, start, end)
    for span in route:
        holders = [
            peer
            for peer, info in swarm.items()
            if info.state is ONLINE and info.start_block <= span.start < info.end_block
        ]
        assert span.peer_id == min(holders, key=keys.__getitem__)
    claimed = {
        peer: attrs.evolve(info, throughput=throughput)
        for (peer, info), throughput in zip(swarm.items(), throughputs, strict=False)
    }
    assert make_route_impartial(claimed, start, end, rank=keys.__getitem__) == route


# --- greedy, errors -----------------------------------------------------------------------------


def test_greedy_reaches_furthest_then_prefers_throughput_then_peer_id() -> None:
    swarm = {
        P[0]: server(0, 3, throughput=1.0),
        P[1]: server(0, 5, throughput=1.0),
        P[2]: server(3, 8, throughput=1.0),
        P[3]: server(4, 9, throughput=5.0),
        P[4]: server(4, 9, throughput=5.0),
    }
    assert spans(make_route_greedy(swarm, 0, 9)) == [(P[1], 0, 5), (P[3], 5, 9)]
    # Capped at `end`, P2 and P3 reach as far: throughput decides.
    assert spans(make_route_greedy(swarm, 0, 7)) == [(P[1], 0, 5), (P[3], 5, 7)]


def test_missing_blocks_are_named() -> None:
    swarm = {
        P[0]: server(0, 3),
        P[1]: server(5, 6),
        P[2]: server(3, 5, state=OFFLINE),
    }
    for plan in (
        lambda: make_route_min_latency(swarm, 0, 6, client_pings={}),
        lambda: make_route_max_throughput(swarm, 0, 6, rng=random.Random(0)),
        lambda: make_route_greedy(swarm, 0, 6),
        lambda: make_route_impartial(swarm, 0, 6, rank=str.encode),
    ):
        with pytest.raises(
            MissingBlocksError, match=r"no server holds blocks 3, 4 \(of \[0, 6\)\)"
        ):
            plan()
    with pytest.raises(MissingBlocksError, match=r"no server holds block 7 \(of \[6, 8\)\)") as e:
        make_route_greedy({P[0]: server(6, 7)}, 6, 8)
    assert e.value.blocks == (7,)
    assert isinstance(e.value, PetalsError)
    with pytest.raises(MissingBlocksError) as e:
        make_route_greedy({}, 0, 2)
    assert e.value.blocks == (0, 1)


@pytest.mark.parametrize(("start", "end"), [(-1, 2), (2, 2), (3, 1), (0.0, 1), (True, 3)])
def test_bad_ranges_are_refused(start: int, end: int) -> None:
    swarm = {P[0]: server(0, 4)}
    for plan in (
        lambda: make_route_min_latency(swarm, start, end, client_pings={}),
        lambda: make_route_max_throughput(swarm, start, end, rng=random.Random(0)),
        lambda: make_route_greedy(swarm, start, end),
    ):
        with pytest.raises(ConfigError):
            plan()


def test_bad_latency_parameters_are_refused() -> None:
    swarm = {P[0]: server(0, 4)}
    for bad in (
        {"client_pings": {P[0]: -1.0}},
        {"client_pings": {P[0]: math.inf}},
        {"client_pings": {}, "default_ping_s": math.nan},
        {"client_pings": {}, "default_inference_rps": 0.0},
        {"client_pings": {}, "cache_tokens_needed": -1},
        {"client_pings": {}, "cache_penalty_s": -1.0},
    ):
        with pytest.raises(ConfigError):
            make_route_min_latency(swarm, 0, 4, **bad)
    with pytest.raises(ConfigError, match="end is > start"):
        RouteSpan(peer_id=P[0], start=2, end=2)
