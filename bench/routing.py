"""Route planning benchmark: how long the client's planners take on a large swarm, CPU, one thread.

The swarm: N servers over a model of B blocks, each holding 8 to 32 consecutive blocks at a
random place (the first few tile the model, so that every block is held); inference 100-1000 RPS
(10% unknown), throughput 100-1000, cache room for 0 to 100,000 tokens.  The client knows its
ping to 90% of the servers (10-300 ms).  With measured pings, each server reports its RTT to up
to 5 servers holding its next block (5-200 ms), as :class:`~petals_core.server.Server` does;
without, every hop is estimated.  Cache: either no cache need, or 2,048 tokens per block
(servers with little room are penalised past some span length).  Each row plans a full route
``[0, B)`` on the same seeded swarm, timed over repeated runs (median and p90); the route's
length in spans and its cost are shown for reference.

Target: :func:`make_route_min_latency` plans 1,000 servers x 80 blocks in under 20 ms.

Run with ``nox -s bench -- routing``.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any

from petals_core.dht import ServerInfo, ServerState
from petals_core.routing import (
    RouteSpan,
    make_route_greedy,
    make_route_max_throughput,
    make_route_min_latency,
    route_cost,
)
from petals_core.transport import PeerID

from ._report import median, percentile, print_table, summarize, write_json

REPEATS = 15
TARGET_MS = 20.0


def make_swarm(
    num_servers: int, num_blocks: int, *, measured_pings: bool, seed: int = 0
) -> tuple[dict[str, ServerInfo], dict[str, float]]:
    """A seeded random swarm (see the module docstring) and the client's pings."""
    rng = random.Random(seed)
    peers = [str(PeerID.from_public_key(rng.randbytes(32))) for _ in range(num_servers)]
    spans = {}
    for index, peer_id in enumerate(peers):
        length = rng.randint(min(8, num_blocks), min(32, num_blocks))
        first = rng.randint(0, num_blocks - length)
        if index * 8 < num_blocks:  # the first few tile the model, so that every block is held
            first, length = index * 8, min(8, num_blocks - index * 8)
        spans[peer_id] = (first, first + length)
    holders: dict[int, list[str]] = {block: [] for block in range(num_blocks)}
    for peer_id, (first, stop) in spans.items():
        for block in range(first, stop):
            holders[block].append(peer_id)
    servers = {}
    for peer_id in peers:
        first, stop = spans[peer_id]
        pinged = []
        if measured_pings and stop < num_blocks:
            pinged = rng.sample(holders[stop], min(5, len(holders[stop])))
        servers[peer_id] = ServerInfo(
            state=ServerState.ONLINE,
            throughput=rng.uniform(100.0, 1000.0),
            start_block=first,
            end_block=stop,
            version="bench",
            torch_dtype="bfloat16",
            inference_rps=None if rng.random() < 0.1 else rng.uniform(100.0, 1000.0),
            cache_tokens_left=rng.randint(0, 100_000),
            next_pings={other: rng.uniform(0.005, 0.2) for other in pinged},
        )
    client_pings = {p: rng.uniform(0.01, 0.3) for p in peers if rng.random() < 0.9}
    return servers, client_pings


def _times_ms(plan: Callable[[], list[RouteSpan]]) -> tuple[list[float], list[RouteSpan]]:
    route = plan()  # warm-up
    samples = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        plan()
        samples.append((time.perf_counter() - began) * 1e3)
    return samples, route


def run() -> list[tuple[Any, ...]]:
    """Rows: planner, swarm, cache need, median ms, p90 ms, spans, cost s, target."""
    rows: list[tuple[Any, ...]] = []
    for num_servers, num_blocks in ((100, 80), (1000, 80)):
        for measured in (False, True):
            servers, pings = make_swarm(num_servers, num_blocks, measured_pings=measured)
            swarm = f"{num_servers} x {num_blocks}, {'5' if measured else 'no'} measured pings"
            for tokens in (0, 2048):

                def plan(
                    servers: dict[str, ServerInfo] = servers,
                    pings: dict[str, float] = pings,
                    num_blocks: int = num_blocks,
                    tokens: int = tokens,
                ) -> list[RouteSpan]:
                    return make_route_min_latency(
                        servers, 0, num_blocks, client_pings=pings, cache_tokens_needed=tokens
                    )

                samples, route = _times_ms(plan)
                cost = route_cost(route, servers, client_pings=pings, cache_tokens_needed=tokens)
                target = f"< {TARGET_MS:.0f} ms" if num_servers == 1000 else None
                rows.append(
                    (
                        "min_latency",
                        swarm,
                        tokens,
                        median(samples),
                        percentile(samples, 0.9),
                        len(route),
                        cost,
                        target,
                    )
                )
            others: dict[str, Callable[[], list[RouteSpan]]] = {
                "max_throughput": functools.partial(
                    make_route_max_throughput, servers, 0, num_blocks, rng=random.Random(0)
                ),
                "greedy": functools.partial(make_route_greedy, servers, 0, num_blocks),
            }
            for name, other in others.items():
                samples, route = _times_ms(other)
                rows.append(
                    (
                        name,
                        swarm,
                        None,
                        median(samples),
                        percentile(samples, 0.9),
                        len(route),
                        None,
                        None,
                    )
                )
    return rows


def main() -> None:
    rows = run()
    header = ["planner", "swarm", "cache tokens/block", "median ms", "p90 ms", "spans", "cost s"]
    print_table(
        "routing: plan a route over all blocks, CPU, 1 thread",
        [*header, "target"],
        rows,
    )
    for planner, swarm, tokens, median_ms, *_ in rows:
        if planner == "min_latency" and swarm == "1000 x 80, 5 measured pings":
            summarize(
                "routing",
                f"min_latency plan, {swarm}, cache {tokens} tokens/block (median)",
                median_ms,
                target=f"< {TARGET_MS:.0f} ms",
                met=median_ms < TARGET_MS,
            )
    write_json(
        "routing",
        {
            f"{row[0]} | {row[1]} | cache {row[2]}": dict(zip(header[3:], row[3:7], strict=True))
            for row in rows
        },
    )


if __name__ == "__main__":
    main()
