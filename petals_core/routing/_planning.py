"""Client route planning: which servers a request passes through, for blocks ``[start, end)``.

A route is a list of :class:`RouteSpan`: consecutive spans, each on a server that announced a span
containing it, together covering ``[start, end)`` exactly, and no two neighbours on the same
server (a server that runs two consecutive spans runs one).  Three planners, after Petals'
``RemoteSequenceManager`` (``petals/client/routing/sequence_manager.py``):

- :func:`make_route_min_latency`, for inference: the route of least :func:`route_cost` (below),
  exactly (not Petals' heuristic of staying on a server to the end of its span).
- :func:`make_route_max_throughput`, for forward and backward passes: a random walk that picks
  servers in proportion to their throughput, so load spreads over the swarm as it can take it.
- :func:`make_route_greedy`: the fewest spans (hops), deterministically.

**The latency model** (:func:`route_cost`), in seconds, for one inference step:

- the client's ping to the first server, and the last server's ping back to the client:
  ``client_pings[peer]`` where known, else ``default_ping_s``;
- per span, its blocks over the server's ``inference_rps`` (``default_inference_rps`` where the
  server announced none; a server announcing 0 takes forever);
- per hop between consecutive servers ``a -> b``: ``a.next_pings[b]`` where ``a`` measured it,
  else ``client_pings[a] / 2 + client_pings[b] / 2`` where the client knows both (going through
  the client is the estimate), else ``default_ping_s``;
- ``cache_penalty_s`` per span whose server announced ``cache_tokens_left`` below
  ``cache_tokens_needed`` times the span's blocks: that server would make the session wait for
  (or refuse) its attention cache.  Each span is judged on its own, so a route that visits a
  server twice (rarely worth it) is judged per visit.

:func:`make_route_min_latency` minimises it exactly, by dynamic programming over block
boundaries in order.  At each boundary it holds, per server, the cheapest partial route whose last
span is on that server and ends there (``arrive``) and the cheapest one that enters that server
there (``enter``); switching servers is allowed at every boundary, since a switch away from span
boundaries can pay (a fast server far from the client running the middle blocks, a tight cache
split over two visits).  What keeps it cheap:

- A span costs the same per block, so ``arrive`` carries over from one boundary to the next in
  O(1); a cache penalty depends on the span's length only through a threshold, which a sliding
  window minimum over entry points handles (amortised O(1)), only for servers where the
  threshold falls inside their span.
- An estimated hop splits into a part per end (``client_pings[a] / 2 + client_pings[b] / 2``),
  so one minimum over all servers at a boundary gives every target its best source by estimate.
  A target that must not use that source (it is the source, or the source measured a ping to
  it) looks further down a ranking of sources.
- A measured ping can only beat the estimate-based entry if it is shorter than its own estimate,
  so only those are relaxed, at each boundary where the two servers meet.

Work is about linear in the (server, block) pairs plus (measured ping, boundary) pairs, with
the per-pair work done by list comprehensions; ``python -m bench routing`` times it (about
12 ms for 1,000 servers over 80 blocks with estimated hops on the reference machine, twice that
with 5 measured pings per server).

All functions are pure: no I/O, no clock, randomness only from the ``rng`` passed in.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from itertools import repeat

import attrs

from .._errors import ConfigError, PetalsError
from ..dht._records import ServerInfo, ServerState

__all__ = [
    "MissingBlocksError",
    "RouteSpan",
    "make_route_greedy",
    "make_route_max_throughput",
    "make_route_min_latency",
    "route_cost",
    "usable_servers",
]

_INF = math.inf
# Sources kept per boundary for entering a server by estimated hop; a target that excludes all of
# them (it is one of them, or has measured pings from them) falls back to a full scan.
_TOP_SOURCES = 8


class MissingBlocksError(PetalsError):
    """No usable server holds some of the blocks a route needs; ``blocks`` lists them."""

    def __init__(self, blocks: Sequence[int], start: int, end: int) -> None:
        self.blocks: tuple[int, ...] = tuple(blocks)
        self.start = start
        self.end = end
        noun = "block" if len(self.blocks) == 1 else "blocks"
        listed = ", ".join(str(block) for block in self.blocks)
        super().__init__(f"no server holds {noun} {listed} (of [{start}, {end}))")


def _check_int(instance: RouteSpan, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"a route span's {attribute.name} is an integer >= 0, not {value!r}")


def _check_end(instance: RouteSpan, attribute: attrs.Attribute[int], value: int) -> None:
    _check_int(instance, attribute, value)
    if value <= instance.start:
        raise ConfigError(f"a route span's end is > start={instance.start}, not {value!r}")


def _check_peer_id(instance: RouteSpan, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"a route span's peer_id is a non-empty str, not {value!r}")


@attrs.frozen(kw_only=True)
class RouteSpan:
    """Server ``peer_id`` runs blocks ``[start, end)`` of the request."""

    peer_id: str = attrs.field(validator=_check_peer_id)
    start: int = attrs.field(validator=_check_int)
    end: int = attrs.field(validator=_check_end)

    @property
    def length(self) -> int:
        """How many blocks the span runs."""
        return self.end - self.start


def usable_servers(
    servers: Mapping[str, ServerInfo],
    *,
    banned: Collection[str] = frozenset(),
    allowed: Collection[str] | None = None,
    blocked: Collection[str] = frozenset(),
    adapter: str | None = None,
) -> dict[str, ServerInfo]:
    """The servers a client may route through: online, not banned (for now, after failing us),
    in ``allowed`` when given, not ``blocked``, and holding ``adapter`` when one is asked for.

    PeerID order, so that planners see the same swarm the same way whatever the input order.
    """
    allowed_set = None if allowed is None else frozenset(allowed)
    banned_set, blocked_set = frozenset(banned), frozenset(blocked)
    return {
        peer_id: info
        for peer_id, info in sorted(servers.items())
        if info.state is ServerState.ONLINE
        and peer_id not in banned_set
        and peer_id not in blocked_set
        and (allowed_set is None or peer_id in allowed_set)
        and (adapter is None or adapter in info.adapters)
    }


def _check_range(start: int, end: int) -> None:
    for name, value in (("start", start), ("end", end)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{name} is an integer, not {value!r}")
    if not 0 <= start < end:
        raise ConfigError(f"a route needs 0 <= start < end, not start={start}, end={end}")


def _candidates(
    servers: Mapping[str, ServerInfo], start: int, end: int
) -> list[tuple[str, ServerInfo]]:
    """Online servers holding some block of ``[start, end)``, in PeerID order; raises
    :class:`MissingBlocksError` if together they leave a block out."""
    candidates = sorted(
        (peer_id, info)
        for peer_id, info in servers.items()
        if info.state is ServerState.ONLINE and info.start_block < end and info.end_block > start
    )
    # Coverage by a difference array: +1 where a span starts, -1 where it ends.
    delta = [0] * (end - start + 1)
    for _, info in candidates:
        delta[max(info.start_block, start) - start] += 1
        delta[min(info.end_block, end) - start] -= 1
    missing, depth = [], 0
    for offset in range(end - start):
        depth += delta[offset]
        if depth == 0:
            missing.append(start + offset)
    if missing:
        raise MissingBlocksError(missing, start, end)
    return candidates


def _check_seconds(name: str, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < _INF:
        raise ConfigError(f"{name} is a finite number of seconds >= 0, not {value!r}")


def _check_latency_model(
    client_pings: Mapping[str, float],
    cache_tokens_needed: int,
    default_ping_s: float,
    default_inference_rps: float,
    cache_penalty_s: float,
) -> None:
    if (
        not isinstance(cache_tokens_needed, int)
        or isinstance(cache_tokens_needed, bool)
        or cache_tokens_needed < 0
    ):
        raise ConfigError(f"cache_tokens_needed is an integer >= 0, not {cache_tokens_needed!r}")
    _check_seconds("default_ping_s", default_ping_s)
    _check_seconds("cache_penalty_s", cache_penalty_s)
    if (
        not isinstance(default_inference_rps, int | float)
        or isinstance(default_inference_rps, bool)
        or not 0 < default_inference_rps < _INF
    ):
        raise ConfigError(
            f"default_inference_rps is a finite number > 0, not {default_inference_rps!r}"
        )
    for peer_id, rtt in client_pings.items():
        _check_seconds(f"the client's ping to {peer_id}", rtt)


def _block_cost(info: ServerInfo, default_inference_rps: float) -> float:
    rps = default_inference_rps if info.inference_rps is None else info.inference_rps
    return 1.0 / rps if rps > 0 else _INF


def _free_blocks(info: ServerInfo, cache_tokens_needed: int) -> float:
    """The longest span ``info``'s server runs without a cache penalty (inf: any)."""
    if cache_tokens_needed == 0 or info.cache_tokens_left is None:
        return _INF
    return info.cache_tokens_left // cache_tokens_needed


def _hop_s(
    source: str,
    target: str,
    servers: Mapping[str, ServerInfo],
    client_pings: Mapping[str, float],
    default_ping_s: float,
) -> float:
    measured = servers[source].next_pings.get(target)
    if measured is not None:
        return measured
    if source in client_pings and target in client_pings:
        return client_pings[source] / 2 + client_pings[target] / 2
    return default_ping_s


def route_cost(
    route: Sequence[RouteSpan],
    servers: Mapping[str, ServerInfo],
    *,
    client_pings: Mapping[str, float],
    cache_tokens_needed: int = 0,
    default_ping_s: float = 0.1,
    default_inference_rps: float = 300.0,
    cache_penalty_s: float = 1000.0,
) -> float:
    """Seconds one inference step takes along ``route``, by the latency model in the module
    docstring (what :func:`make_route_min_latency` minimises).  Every span's server must be in
    ``servers``; the route's shape is not checked."""
    _check_latency_model(
        client_pings, cache_tokens_needed, default_ping_s, default_inference_rps, cache_penalty_s
    )
    if not route:
        raise ConfigError("a route has at least one span")
    missing = [span.peer_id for span in route if span.peer_id not in servers]
    if missing:
        raise ConfigError(f"route goes through servers not in the swarm: {', '.join(missing)}")
    costs = [client_pings.get(route[0].peer_id, default_ping_s)]
    for index, span in enumerate(route):
        info = servers[span.peer_id]
        costs.append(span.length * _block_cost(info, default_inference_rps))
        if span.length > _free_blocks(info, cache_tokens_needed):
            costs.append(cache_penalty_s)
        if index > 0:
            previous = route[index - 1].peer_id
            costs.append(_hop_s(previous, span.peer_id, servers, client_pings, default_ping_s))
    costs.append(client_pings.get(route[-1].peer_id, default_ping_s))
    return math.fsum(costs)


def make_route_min_latency(
    servers: Mapping[str, ServerInfo],
    start: int,
    end: int,
    *,
    client_pings: Mapping[str, float],
    cache_tokens_needed: int = 0,
    default_ping_s: float = 0.1,
    default_inference_rps: float = 300.0,
    cache_penalty_s: float = 1000.0,
) -> list[RouteSpan]:
    """The route through online ``servers`` for blocks ``[start, end)`` of least
    :func:`route_cost` (see the module docstring for the model and the algorithm).

    Raises :class:`MissingBlocksError` if no online server holds some block, and
    :class:`ConfigError` for a bad range or parameter.  Deterministic: of equally good routes,
    which one comes back depends only on the arguments.
    """
    _check_range(start, end)
    _check_latency_model(
        client_pings, cache_tokens_needed, default_ping_s, default_inference_rps, cache_penalty_s
    )
    candidates = _candidates(servers, start, end)
    # A server announcing 0 inference RPS takes forever: if a block has only such servers,
    # every route takes forever, and the fewest hops will do.
    usable = [(p, i) for p, i in candidates if i.inference_rps != 0.0]
    if len(usable) < len(candidates):
        try:
            usable = _candidates(dict(usable), start, end)
        except MissingBlocksError:
            return make_route_greedy(servers, start, end)
    planner = _LatencyPlanner(
        usable,
        start,
        end,
        client_pings=client_pings,
        cache_tokens_needed=cache_tokens_needed,
        default_ping_s=default_ping_s,
        default_inference_rps=default_inference_rps,
        cache_penalty_s=cache_penalty_s,
    )
    return planner.plan()


class _Window:
    """Entry points into one server whose spans are penalised past ``limit`` blocks: a sliding
    window minimum over the recent ones (no penalty yet), and the best of the older ones.

    Entries are keyed ``enter - (entry - lo) * cost``: every open span on the server grows by the
    same cost per block, so keys compare as the spans' costs do at any later boundary.
    """

    __slots__ = ("free", "limit", "old_entry", "old_key")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.free: deque[tuple[float, int]] = deque()  # (key, entry), keys rising
        self.old_key = _INF
        self.old_entry = -1


class _LatencyPlanner:
    """One run of the dynamic program of :func:`make_route_min_latency`.

    Servers are numbered in PeerID order; per-server lists are indexed by that number.  For each
    boundary ``e`` the run keeps ``arrive[e]`` (server holding block ``e - 1`` -> the cheapest
    route whose last span is on it and ends at ``e``) and ``enter[e]`` (server holding block
    ``e`` -> the cheapest route that enters it at ``e``), and enough to tell afterwards which
    choice made each value, so that the route is traced back without per-state back-pointers.
    The per-state work is a few list comprehensions per boundary, the cheapest loops Python has.
    """

    def __init__(
        self,
        candidates: list[tuple[str, ServerInfo]],
        start: int,
        end: int,
        *,
        client_pings: Mapping[str, float],
        cache_tokens_needed: int,
        default_ping_s: float,
        default_inference_rps: float,
        cache_penalty_s: float,
    ) -> None:
        self.start, self.end = start, end
        self.default_ping_s = default_ping_s
        self.penalty_s = cache_penalty_s
        n = len(candidates)
        self.peers = peers = [peer_id for peer_id, _ in candidates]
        number = {peer_id: i for i, peer_id in enumerate(peers)}
        self.lo = lo = [
            start if info.start_block < start else info.start_block for _, info in candidates
        ]
        self.hi = hi = [end if info.end_block > end else info.end_block for _, info in candidates]
        self.cost = [_block_cost(info, default_inference_rps) for _, info in candidates]
        # Half the client's ping where known (None: unknown); as keys, inf stands for unknown in
        # ``known_half`` and for known in ``unknown_zero``.  ``edge``: the first and last hop.
        self.half: list[float | None] = [
            client_pings[p] / 2 if p in client_pings else None for p in peers
        ]
        self.known_half = [_INF if h is None else h for h in self.half]
        self.unknown_zero = [0.0 if h is None else _INF for h in self.half]
        self.edge = [client_pings.get(p, default_ping_s) for p in peers]
        # Measured pings between candidates, as (first boundary, last boundary, other server,
        # rtt): only where a hop can happen, i.e. the source holds the block before a boundary
        # and the target the block after it.  A target leaves its measured sources (and itself)
        # out of the estimated-hop minimum.  A measured ping no shorter than the estimate can
        # only matter when its source is the best one (then the target takes the slow path), so
        # only shorter ones are kept for the fast path (``useful``).
        self.out_targets: list[list[int]] = [[] for _ in range(n)]
        self.inn: list[list[tuple[int, int, int, float]]] = [[] for _ in range(n)]
        # The useful ones, by the boundary where they start and after which they end to count.
        # Each has a number; ``live_*`` hold those that can happen at the current boundary.
        self.useful_from: list[list[tuple[int, int, int, float]]] = [
            [] for _ in range(end - start + 1)
        ]
        self.useful_until: list[list[int]] = [[] for _ in range(end - start + 1)]
        self.live_sources: dict[int, int] = {}
        self.live_targets: dict[int, int] = {}
        self.live_rtts: dict[int, float] = {}
        self.excluded: list[set[int]] = [{i} for i in range(n)]
        half, out_targets, inn, excluded = self.half, self.out_targets, self.inn, self.excluded
        useful_from, useful_until = self.useful_from, self.useful_until
        edge_id = 0
        for i, (_, info) in enumerate(candidates):
            if not info.next_pings:
                continue
            lo_i, hi_i, half_i = lo[i] + 1, hi[i], half[i]
            for peer_id, rtt in info.next_pings.items():
                j = number.get(peer_id)
                if j is None or j == i:
                    continue
                lo_j, hi_j = lo[j], hi[j] - 1
                first = lo_i if lo_i > lo_j else lo_j
                last = hi_i if hi_i < hi_j else hi_j
                if first > last:
                    continue
                out_targets[i].append(j)
                inn[j].append((first, last, i, rtt))
                excluded[j].add(i)
                half_j = half[j]
                if rtt < (default_ping_s if half_i is None or half_j is None else half_i + half_j):
                    edge_id += 1
                    useful_from[first - start].append((edge_id, i, j, rtt))
                    useful_until[last - start].append(edge_id)
        # Cache penalties: a window for a server whose spans are penalised past some length; none
        # for one whose spans never are, or always are (then it is paid on entry).
        self.windows: dict[int, _Window] = {}
        self.entry_penalty = [0.0] * n
        for i, (_, info) in enumerate(candidates):
            limit = _free_blocks(info, cache_tokens_needed)
            if limit == 0:
                self.entry_penalty[i] = cache_penalty_s
            elif limit < hi[i] - lo[i]:
                self.windows[i] = _Window(int(limit))
        self.starting: list[list[int]] = [[] for _ in range(end - start)]
        for i in range(n):
            self.starting[lo[i] - start].append(i)
        self.arrive: list[dict[int, float]] = [{}]  # by e - start (nothing arrives at start)
        self.enter: list[dict[int, float]] = []
        # How ``enter`` was made, per boundary: the best sources by estimated hop (value and
        # server, for targets whose client ping is known, by unknown ones, for unknown targets),
        # and the sources of the targets that took another (slow path, measured hops).
        self.rule: list[tuple[float, int, float, int, int]] = []
        self.chosen: list[dict[int, int]] = []
        self.window_entry: dict[tuple[int, int], int] = {}

    def plan(self) -> list[RouteSpan]:
        start, end, hi = self.start, self.end, self.hi
        holding: list[int] = []  # the servers holding block e - 1
        for e in range(start, end + 1):
            if e > start:
                self._advance(holding, e)
            if e == end:
                break
            targets = [i for i in holding if hi[i] > e]
            targets.extend(self.starting[e - start])
            if e == start:
                self.enter.append({t: self.edge[t] for t in targets})
                self.rule.append((_INF, -1, _INF, -1, -1))
                self.chosen.append(dict.fromkeys(targets, -1))
            else:
                self._enter(targets, e)
            holding = targets
        arrive = self.arrive[-1]
        last = min(arrive, key=lambda i: (arrive[i] + self.edge[i], i))
        route: list[RouteSpan] = []
        server, boundary = last, end
        while True:
            began = self._began(server, boundary)
            route.append(RouteSpan(peer_id=self.peers[server], start=began, end=boundary))
            source = self._source(server, began)
            if source < 0:
                break
            server, boundary = source, began
        route.reverse()
        return route

    def _advance(self, holding: list[int], e: int) -> None:
        """``arrive`` at ``e`` for the servers holding block ``e - 1``: the better of going on
        from ``arrive`` at ``e - 1`` and entering at ``e - 1`` (plus any entry penalty), plus the
        block's cost.  Staying wins ties."""
        before = self.arrive[-1].get
        entering = self.enter[-1]
        values = [
            (stay if stay <= fresh + penalty else fresh + penalty) + cost
            for stay, fresh, penalty, cost in zip(
                map(before, holding, repeat(_INF)),
                map(entering.__getitem__, holding),
                map(self.entry_penalty.__getitem__, holding),
                map(self.cost.__getitem__, holding),
                strict=True,
            )
        ]
        arrive = dict(zip(holding, values, strict=True))
        if self.windows:
            windows = self.windows
            for i in [i for i in holding if i in windows]:
                arrive[i] = self._slide(windows[i], i, e, entering[i])
        self.arrive.append(arrive)

    def _slide(self, window: _Window, i: int, e: int, entering: float) -> float:
        free, cost, lo = window.free, self.cost[i], self.lo[i]
        if entering < _INF:
            key = entering - (e - 1 - lo) * cost
            while free and free[-1][0] >= key:
                free.pop()
            free.append((key, e - 1))
        # Entries more than ``limit`` blocks back are penalised from here on.
        while free and free[0][1] < e - window.limit:
            key, entry = free.popleft()
            if key < window.old_key:
                window.old_key, window.old_entry = key, entry
        best, entry = free[0] if free else (_INF, -1)
        if window.old_key + self.penalty_s < best:
            best, entry = window.old_key + self.penalty_s, window.old_entry
        self.window_entry[i, e] = entry
        return best + (e - lo) * cost

    def _enter(self, targets: list[int], e: int) -> None:
        """``enter`` at ``e`` for the servers holding block ``e``, from ``arrive`` at ``e``."""
        arrive = self.arrive[-1]
        sources, values = list(arrive), list(arrive.values())
        default = self.default_ping_s
        # Estimated hops split into the source's part (half its client ping, if known) and the
        # target's: one minimum over the sources serves every target.
        known = _Ranking(
            [
                value + h
                for value, h in zip(values, map(self.known_half.__getitem__, sources), strict=True)
            ],
            sources,
        )
        unknown = _Ranking(
            [
                value + z
                for value, z in zip(
                    values, map(self.unknown_zero.__getitem__, sources), strict=True
                )
            ],
            sources,
        )
        either = _Ranking(values.copy(), sources)
        known_value, known_source = known.nth(0)
        unknown_value, unknown_source = unknown.nth(0)
        either_value, either_source = either.nth(0)
        unknown_value += default
        either_value += default
        # Known targets: the better of known + half and unknown + default; unknown ones: either +
        # default.  As ``_source`` reads it back.
        entering = dict(
            zip(
                targets,
                [
                    either_value
                    if h is None
                    else (known_value + h if known_value + h <= unknown_value else unknown_value)
                    for h in map(self.half.__getitem__, targets)
                ],
                strict=True,
            )
        )
        self.rule.append((known_value, known_source, unknown_value, unknown_source, either_source))
        chosen: dict[int, int] = {}
        # Targets that exclude one of those best sources (a best source itself, or one it
        # measured a ping to) take the slow path.
        slow: set[int] = set()
        for s in (known_source, unknown_source, either_source):
            if s >= 0:
                slow.add(s)
                slow.update(self.out_targets[s])
        for t in slow.intersection(entering):
            value, source = self._enter_slow(t, known, unknown, either)
            for first, last, s, rtt in self.inn[t]:
                if first <= e <= last and arrive[s] + rtt < value:
                    value, source = arrive[s] + rtt, s
            entering[t] = value
            chosen[t] = source
        # Measured hops shorter than their estimate: all candidates at once, then the few that
        # improve on what the target has.
        live_sources, live_targets, live_rtts = self.live_sources, self.live_targets, self.live_rtts
        for k, s, t, rtt in self.useful_from[e - self.start]:
            live_sources[k], live_targets[k], live_rtts[k] = s, t, rtt
        if live_sources:
            edge_sources, edge_targets = list(live_sources.values()), list(live_targets.values())
            rtts = list(live_rtts.values())
            # The edges whose offer beats what the target has now (a superset of the winners).
            hits = [
                k
                for k, a, rtt, current in zip(
                    range(len(rtts)),
                    map(arrive.__getitem__, edge_sources),
                    rtts,
                    map(entering.__getitem__, edge_targets),
                    strict=True,
                )
                if a + rtt < current
            ]
            for k in hits:
                t, s = edge_targets[k], edge_sources[k]
                offer = arrive[s] + rtts[k]
                if offer < entering[t]:
                    entering[t] = offer
                    chosen[t] = s
        for k in self.useful_until[e - self.start]:
            del live_sources[k], live_targets[k], live_rtts[k]
        self.enter.append(entering)
        self.chosen.append(chosen)

    def _enter_slow(
        self, t: int, known: _Ranking, unknown: _Ranking, either: _Ranking
    ) -> tuple[float, int]:
        """Entering ``t`` by an estimated hop, from the best source ``t`` does not exclude."""
        shut = self.excluded[t]
        h = self.half[t]
        if h is None:
            value, source = either.best(shut)
            return value + self.default_ping_s, source
        value, source = known.best(shut)
        value += h
        other, other_source = unknown.best(shut)
        other += self.default_ping_s
        if other < value:
            value, source = other, other_source
        return value, source

    def _began(self, i: int, e: int) -> int:
        """Where the span on ``i`` that ``arrive[e][i]`` ends began."""
        if i in self.windows:
            return self.window_entry[i, e]
        offset, lo, penalty = self.start, self.lo[i], self.entry_penalty[i]
        b = e - 1
        while b > lo and not (
            self.enter[b - offset][i] + penalty < self.arrive[b - offset].get(i, _INF)
        ):
            b -= 1
        return b

    def _source(self, t: int, e: int) -> int:
        """Which server ``enter[e][t]`` came from (-1: the client)."""
        chosen = self.chosen[e - self.start]
        if t in chosen:
            return chosen[t]
        known_value, known_source, unknown_value, unknown_source, either_source = self.rule[
            e - self.start
        ]
        h = self.half[t]
        if h is None:
            return either_source
        return known_source if known_value + h <= unknown_value else unknown_source


class _Ranking:
    """Sources ranked by a key, best first, found one at a time (each a C-level ``min``)."""

    __slots__ = ("keys", "ranked", "sources")

    def __init__(self, keys: list[float], sources: list[int]) -> None:
        self.keys, self.sources = keys, sources
        self.ranked: list[tuple[float, int]] = []

    def nth(self, k: int) -> tuple[float, int]:
        keys, ranked = self.keys, self.ranked
        while len(ranked) <= k:
            if ranked:
                keys[ranked[-1][1]] = _INF  # take the last one found out of the running
            best = min(keys, default=_INF)
            if best == _INF:
                return _INF, -1
            ranked.append((best, keys.index(best)))
        return ranked[k][0], self.sources[ranked[k][1]]

    def best(self, shut: set[int]) -> tuple[float, int]:
        """The best source not in ``shut``."""
        k = 0
        while True:
            value, source = self.nth(k)
            if source < 0 or source not in shut:
                return value, source
            k += 1


def make_route_max_throughput(
    servers: Mapping[str, ServerInfo], start: int, end: int, *, rng: random.Random
) -> list[RouteSpan]:
    """A random route through online ``servers`` for blocks ``[start, end)``, spreading load as
    the swarm can take it (for forward and backward passes, where throughput matters more than
    one request's latency).

    From ``start``, pick one of the servers holding the current block with probability
    proportional to its ``throughput`` (uniformly if all of them announce 0), run it to the end
    of its span (or ``end``), and go on from there.  Unlike Petals, which weighs by span length,
    a server that announces little throughput is seldom asked: with throughputs 1000, 500 and 1
    the last is picked once in 1501.  Raises :class:`MissingBlocksError` if no online server
    holds some block.
    """
    _check_range(start, end)
    candidates = _candidates(servers, start, end)
    route: list[RouteSpan] = []
    block = start
    while block < end:
        holding = [
            (peer_id, info)
            for peer_id, info in candidates
            if info.start_block <= block < info.end_block
        ]
        total = math.fsum(info.throughput for _, info in holding)
        if total > 0:
            point = rng.random() * total
            chosen = next(
                (
                    (peer_id, info)
                    for peer_id, info in holding
                    if info.throughput > 0 and (point := point - info.throughput) < 0
                ),
                None,
            )
            if chosen is None:  # rounding left ``point`` a hair above 0: the last one it is
                chosen = [pair for pair in holding if pair[1].throughput > 0][-1]
        else:
            chosen = holding[rng.randrange(len(holding))]
        peer_id, info = chosen
        stop = min(info.end_block, end)
        route.append(RouteSpan(peer_id=peer_id, start=block, end=stop))
        block = stop
    return route


def make_route_greedy(servers: Mapping[str, ServerInfo], start: int, end: int) -> list[RouteSpan]:
    """The route through online ``servers`` for blocks ``[start, end)`` with the fewest spans.

    At each block, the server holding it that reaches furthest; ties go to the higher
    throughput, then to the first PeerID.  (Reaching furthest at every step gives the fewest
    steps: any route's k-th span ends no later than the greedy one's.)  Raises
    :class:`MissingBlocksError` if no online server holds some block.
    """
    _check_range(start, end)
    candidates = _candidates(servers, start, end)
    route: list[RouteSpan] = []
    block = start
    while block < end:
        peer_id, info = min(
            (
                (peer_id, info)
                for peer_id, info in candidates
                if info.start_block <= block < info.end_block
            ),
            key=lambda pair: (-min(pair[1].end_block, end), -pair[1].throughput, pair[0]),
        )
        stop = min(info.end_block, end)
        route.append(RouteSpan(peer_id=peer_id, start=block, end=stop))
        block = stop
    return route
