"""Client route planning: which servers a request passes through, for blocks ``[start, end)``.

A route is a list of :class:`RouteSpan`: consecutive spans, each on a server that announced a span
containing it, together covering ``[start, end)`` exactly, and no two neighbours on the same
server (a server that runs two consecutive spans runs one).  Three planners after Petals'
``RemoteSequenceManager`` (``petals/client/routing/sequence_manager.py``), and one for checks:

- :func:`make_route_min_latency`, for inference: the route of least :func:`route_cost` (below),
  exactly (not Petals' heuristic of staying on a server to the end of its span).
- :func:`make_route_max_throughput`, for forward and backward passes: a random walk that picks
  servers in proportion to their throughput, so load spreads over the swarm as it can take it.
- :func:`make_route_greedy`: the fewest spans (hops), deterministically.
- :func:`make_route_impartial`, for servers that check others' answers: each block's server is
  the first in the caller's rank, whatever servers announce.

**The latency model** (:func:`route_cost`), in seconds, for one inference step:

- the client's ping to the first server, and the last server's ping back to the client:
  ``client_pings[peer]`` where known, else ``default_ping_s`` (twice that for a server behind a
  symmetric NAT, reached only through a relay: an extra leg);
- per span, its blocks over the server's ``inference_rps`` (``default_inference_rps`` where the
  server announced none; a server announcing 0 takes forever);
- per hop between consecutive servers ``a -> b``: ``a.next_pings[b]`` where ``a`` measured it,
  else ``client_pings[a] / 2 + client_pings[b] / 2`` where the client knows both (going through
  the client is the estimate), else ``default_ping_s``, twice that when ``b`` is behind a
  symmetric NAT (measured pings already include the relay's leg; a server behind a cone NAT is
  expected to be reached through a punched hole, directly);
- ``cache_penalty_s`` per span whose server announced ``cache_tokens_left`` below
  ``cache_tokens_needed`` times the span's blocks: that server would make the session wait for
  (or refuse) its attention cache.  Each span is judged on its own, so a route that visits a
  server twice (rarely worth it) is judged per visit.

:func:`make_route_min_latency` minimises it exactly, by dynamic programming over block
boundaries in order.  At each boundary it holds, per server, the cheapest partial route whose last
span is on that server and ends there (``arrive``) and the cheapest one that enters that server
there (``enter``); switching servers is allowed at every boundary, since a switch away from span
boundaries can pay (a fast server far from the client running the middle blocks, a tight cache
split over two visits).  Each boundary is a few numpy operations over all servers at once:

- A span costs the same per block, so ``arrive`` is a running minimum of the entries so far
  (each shifted by its blocks' cost); for a server whose spans are penalised past ``limit``
  blocks, a sliding-window minimum over its last ``limit`` entries (a sparse table of minima)
  beside a running minimum of the older ones plus the penalty.
- An estimated hop splits into a part per end (``client_pings[a] / 2 + client_pings[b] / 2``),
  so one minimum over all servers at a boundary gives every target its best source by estimate.
  A target that must not use that source (it is the source, or the source measured a ping to it
  longer than the estimate) looks further down a ranking of sources.
- Measured pings enter as they are, every one at every boundary where its two servers can meet
  (precomputed as one array per boundary), the least offer per target.

The route is traced back afterwards from the kept rows.  ``python -m bench routing`` times it
(bench/README.md holds the figures).

All functions are pure: no I/O, no clock, randomness only from the ``rng`` passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import repeat

import attrs
import numpy as np

from .._errors import ConfigError, MissingBlocksError
from ..dht import ServerInfo, ServerState

__all__ = [
    "MissingBlocksError",
    "RouteSpan",
    "make_route_greedy",
    "make_route_impartial",
    "make_route_max_throughput",
    "make_route_min_latency",
    "route_cost",
    "usable_servers",
]

_INF = math.inf
# Sources ranked at a boundary for targets that leave the best one out (more: a full scan).
_RANKED = 8


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


@attrs.frozen
class _LatencyModel:
    """The parameters of the latency model in the module docstring, checked."""

    client_pings: Mapping[str, float]
    cache_tokens_needed: int
    default_ping_s: float
    default_inference_rps: float
    cache_penalty_s: float

    def __attrs_post_init__(self) -> None:
        tokens = self.cache_tokens_needed
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ConfigError(f"cache_tokens_needed is an integer >= 0, not {tokens!r}")
        _check_seconds("default_ping_s", self.default_ping_s)
        _check_seconds("cache_penalty_s", self.cache_penalty_s)
        rps = self.default_inference_rps
        if not isinstance(rps, int | float) or isinstance(rps, bool) or not 0 < rps < _INF:
            raise ConfigError(f"default_inference_rps is a finite number > 0, not {rps!r}")
        for peer_id, rtt in self.client_pings.items():
            _check_seconds(f"the client's ping to {peer_id}", rtt)

    def block_cost(self, info: ServerInfo) -> float:
        rps = self.default_inference_rps if info.inference_rps is None else info.inference_rps
        return 1.0 / rps if rps > 0 else _INF

    def free_blocks(self, info: ServerInfo) -> float:
        """The longest span ``info``'s server runs without a cache penalty (inf: any)."""
        if self.cache_tokens_needed == 0 or info.cache_tokens_left is None:
            return _INF
        return info.cache_tokens_left // self.cache_tokens_needed

    def extra_leg_s(self, info: ServerInfo) -> float:
        """What reaching a server adds where no ping was measured: a relay's leg for one
        behind a symmetric NAT."""
        return self.default_ping_s if info.reachability == "symmetric" else 0.0

    def client_leg_s(self, peer_id: str, info: ServerInfo) -> float:
        measured = self.client_pings.get(peer_id)
        if measured is not None:
            return measured
        return self.default_ping_s + self.extra_leg_s(info)

    def hop_s(self, source: str, target: str, servers: Mapping[str, ServerInfo]) -> float:
        measured = servers[source].next_pings.get(target)
        if measured is not None:
            return measured
        pings = self.client_pings
        if source in pings and target in pings:
            return pings[source] / 2 + pings[target] / 2
        return self.default_ping_s + self.extra_leg_s(servers[target])


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
    model = _LatencyModel(
        client_pings, cache_tokens_needed, default_ping_s, default_inference_rps, cache_penalty_s
    )
    if not route:
        raise ConfigError("a route has at least one span")
    missing = [span.peer_id for span in route if span.peer_id not in servers]
    if missing:
        raise ConfigError(f"route goes through servers not in the swarm: {', '.join(missing)}")
    first, last = route[0].peer_id, route[-1].peer_id
    costs = [model.client_leg_s(first, servers[first])]
    for index, span in enumerate(route):
        info = servers[span.peer_id]
        costs.append(span.length * model.block_cost(info))
        if span.length > model.free_blocks(info):
            costs.append(cache_penalty_s)
        if index > 0:
            costs.append(model.hop_s(route[index - 1].peer_id, span.peer_id, servers))
    costs.append(model.client_leg_s(last, servers[last]))
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
    model = _LatencyModel(
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
    return _LatencyPlanner(usable, start, end, model).plan()


class _LatencyPlanner:
    """One run of the dynamic program of :func:`make_route_min_latency`, boundary by boundary,
    each step a few numpy operations over all candidate servers at once.

    Servers are numbered in PeerID order.  Boundaries are relative to ``start`` (0 .. B).  Per
    boundary ``e`` it keeps ``arrive[e]`` (per server: the cheapest route over ``[0, e)`` whose
    last span is on it and ends at ``e``; inf for servers not holding block ``e - 1``) and
    ``enter[e]`` (per server: the cheapest route over ``[0, e)`` that goes on to it at ``e``; inf
    for servers not holding block ``e``).  A span entered at ``b`` and left at ``e`` costs
    ``(e - b) * cost``, so ``arrive[e] = e * cost + min over b of key[b]`` with
    ``key[b] = enter[b] - b * cost``: a running minimum, or, for a server whose spans are
    penalised past ``limit`` blocks, a sliding-window minimum over the last ``limit`` entries
    (a sparse table of minima) beside a running minimum of the older ones plus the penalty.
    The route is traced back afterwards from the kept rows (a few vector operations per span).
    """

    def __init__(
        self, candidates: list[tuple[str, ServerInfo]], start: int, end: int, model: _LatencyModel
    ) -> None:
        client_pings, default_ping_s = model.client_pings, model.default_ping_s
        self.start = start
        self.blocks = blocks = end - start
        self.default_ping_s = default_ping_s
        self.penalty_s = model.cache_penalty_s
        self.peers = peers = [peer_id for peer_id, _ in candidates]
        n = len(peers)
        number = {peer_id: i for i, peer_id in enumerate(peers)}
        infos = [info for _, info in candidates]
        self.lo = np.array([max(info.start_block, start) - start for info in infos], np.int64)
        self.hi = np.array([min(info.end_block, end) - start for info in infos], np.int64)
        self.cost = np.array([model.block_cost(info) for info in infos])
        self.known = np.array([p in client_pings for p in peers], bool)
        self.half = np.array([client_pings.get(p, 0.0) / 2 for p in peers])
        #: What reaching each server adds to an estimated leg (see ``extra_leg_s``).
        self.extra = np.array([model.extra_leg_s(info) for info in infos])
        self.extra_list = self.extra.tolist()
        self.edge = np.array([model.client_leg_s(p, info) for p, info in candidates])
        # Halves as keys: inf stands for an unknown ping in ``known_half``, for a known one in
        # ``unknown_zero``.
        self.known_list, self.half_list = self.known.tolist(), self.half.tolist()
        self.lo_list, self.hi_list = self.lo.tolist(), self.hi.tolist()
        self.known_half = np.where(self.known, self.half, _INF)
        self.unknown_zero = np.where(self.known, _INF, 0.0)
        # Measured pings where a hop can happen: the source holds the block before a boundary
        # and the target the one after it, at boundaries first .. last.
        sources: list[int] = []
        names: list[str] = []
        rtts: list[float] = []
        for i, info in enumerate(infos):
            pings = info.next_pings
            if pings:
                sources += repeat(i, len(pings))
                names += pings.keys()
                rtts += pings.values()
        source = np.array(sources, np.int64)
        target = np.array([number.get(name, -1) for name in names], np.int64)
        first = np.maximum(self.lo[source] + 1, self.lo[target])
        last = np.minimum(self.hi[source], self.hi[target] - 1)
        useful = (target >= 0) & (target != source) & (first <= last)
        source, target, first, last = source[useful], target[useful], first[useful], last[useful]
        rtt = np.array(rtts)[useful] if rtts else np.zeros(0)
        # A measured hop no longer than its estimate leaves the estimate harmless (the measured
        # offer is the better one); a longer one must keep its source out of the target's
        # estimated-hop minimum ("shut").
        estimate = np.where(
            self.known[source] & self.known[target],
            self.half[source] + self.half[target],
            default_ping_s + self.extra[target],
        )
        longer = rtt > estimate
        shut_source, shut_target = source[longer], target[longer]
        servers = np.arange(n + 1)
        order = np.argsort(shut_source, kind="stable")
        self.shuts_by_source = (shut_target[order], np.searchsorted(shut_source[order], servers))
        order = np.argsort(shut_target, kind="stable")
        self.shut_by_target = (shut_source[order], np.searchsorted(shut_target[order], servers))
        # Every (boundary, edge) where the hop can happen, by boundary: rows first .. last.
        lengths = last - first + 1
        total = int(lengths.sum())
        offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
        boundary = np.repeat(first, lengths) + (np.arange(total) - offsets)
        # Small integers sort by radix (linear) where they fit 16 bits.
        narrow = boundary.astype(np.int16) if blocks < 2**15 else boundary
        order = np.argsort(narrow, kind="stable")
        edge = np.repeat(np.arange(len(source)), lengths)[order]
        self.hop_source, self.hop_target, self.hop_rtt = source[edge], target[edge], rtt[edge]
        self.hop_bounds = np.searchsorted(boundary[order], np.arange(blocks + 2))
        self.edge_source, self.edge_target, self.edge_rtt = source, target, rtt
        order = np.argsort(target, kind="stable")
        self.in_order = order
        self.in_bounds = np.searchsorted(target[order], servers)
        # Cache penalties: ``limit`` blocks run free.  0: every span pays on entry; at least the
        # server's whole range: none ever does; in between: a window.
        limits = np.array([model.free_blocks(info) for info in infos])
        self.entry_penalty = np.where(limits == 0, self.penalty_s, 0.0)
        windowed = (limits > 0) & (limits < self.hi - self.lo)
        self.window = np.flatnonzero(windowed)
        self.window_limit = limits[windowed].astype(np.int64)
        self.windowed = windowed
        self.arrive = np.full((blocks + 1, n), _INF)
        self.enter = np.full((blocks + 1, n), _INF)
        self.key = np.full((blocks + 1, n), _INF)

    def _shuts(self, s: int) -> list[int]:
        """The targets whose estimated-hop minimum must leave ``s`` out (its measured ping to
        them is longer than the estimate)."""
        targets, bounds = self.shuts_by_source
        return targets[bounds[s] : bounds[s + 1]].tolist()

    def _shut(self, t: int) -> set[int]:
        """The sources left out of ``t``'s estimated-hop minimum (``t`` itself among them)."""
        sources, bounds = self.shut_by_target
        shut = set(sources[bounds[t] : bounds[t + 1]].tolist())
        shut.add(t)
        return shut

    def _measured_into(self, t: int) -> dict[int, float]:
        """Source -> measured ping, for the servers that measured one to ``t``."""
        edges = self.in_order[self.in_bounds[t] : self.in_bounds[t + 1]]
        return dict(
            zip(self.edge_source[edges].tolist(), self.edge_rtt[edges].tolist(), strict=True)
        )

    def plan(self) -> list[RouteSpan]:
        blocks, lo, hi, cost = self.blocks, self.lo, self.hi, self.cost
        arrive, enter, key = self.arrive, self.enter, self.key
        n = len(self.peers)
        enter[0] = np.where(lo == 0, self.edge, _INF)
        running = np.full(n, _INF)
        window, limit = self.window, self.window_limit
        nw = len(window)
        levels = int(limit.max()).bit_length() if nw else 0
        # table[k][b]: the least key of the window's servers over entries b .. b + 2^k - 1.
        table = np.full((max(levels, 1), blocks + 1, nw), _INF)
        old = np.full(nw, _INF)  # least key of entries past the window
        columns = np.arange(nw)
        log2 = np.zeros(blocks + 2, np.int64)
        for length in range(2, blocks + 2):
            log2[length] = log2[length // 2] + 1
        not_windowed = ~self.windowed
        for e in range(1, blocks + 1):
            key[e - 1] = enter[e - 1] + self.entry_penalty - (e - 1) * cost
            np.minimum(running, key[e - 1], out=running)
            row = np.where(not_windowed, running, _INF)
            if nw:
                table[0, e - 1] = key[e - 1, window]
                for k in range(1, levels):
                    b = e - (1 << k)
                    if b < 0:
                        break
                    np.minimum(table[k - 1, b], table[k - 1, b + (1 << (k - 1))], out=table[k, b])
                gone = e - limit - 1  # the entry that leaves the window now
                has_gone = gone >= 0
                if has_gone.any():
                    leaving = key[np.maximum(gone, 0), window]
                    old = np.minimum(old, np.where(has_gone, leaving, _INF))
                first = np.maximum(e - limit, 0)
                k = log2[e - first]
                recent = np.minimum(table[k, first, columns], table[k, e - (1 << k), columns])
                row[window] = np.minimum(recent, old + self.penalty_s)
            holding = (lo < e) & (e <= hi)
            arrive[e] = np.where(holding, row + e * cost, _INF)
            if e < blocks:
                self._enter(e)
        last = int(np.argmin(arrive[blocks] + self.edge))
        route: list[RouteSpan] = []
        server, boundary = last, blocks
        while True:
            began = self._began(server, boundary)
            route.append(
                RouteSpan(
                    peer_id=self.peers[server],
                    start=self.start + began,
                    end=self.start + boundary,
                )
            )
            if began == 0:
                break
            server, boundary = self._source(server, began), began
        route.reverse()
        return route

    def _enter(self, e: int) -> None:
        arrive = self.arrive[e]
        lo, hi = self.lo, self.hi
        default = self.default_ping_s
        # Estimated hops split into the source's part (half its client ping, if known) and the
        # target's: the best source by each key serves every target that does not exclude it.
        keys = (arrive + self.known_half, arrive + self.unknown_zero, arrive)
        bests = [int(np.argmin(values)) for values in keys]
        best_values = [float(values[b]) for values, b in zip(keys, bests, strict=True)]
        known_value, unknown_value, either_value = best_values
        unknown_value += default
        either_value += default
        row = np.where(
            self.known,
            np.minimum(known_value + self.half, unknown_value + self.extra),
            either_value + self.extra,
        )
        # Targets that must leave out one of those best sources (a best source itself, or one
        # whose measured ping to them is longer than the estimate) look further down.
        slow: set[int] = set()
        for s in bests:
            if arrive[s] < _INF:
                slow.add(s)
                slow.update(self._shuts(s))
        # Only the servers entered here (holding block e) matter.
        lo_list, hi_list = self.lo_list, self.hi_list
        slow = {t for t in slow if lo_list[t] <= e < hi_list[t]}
        rankings: list[list[int] | None] = [None, None, None]

        def best(index: int, shut: set[int]) -> float:
            if bests[index] not in shut:
                return best_values[index]
            ranking = rankings[index]
            if ranking is None:
                ranking = rankings[index] = _ranked(keys[index], _RANKED)
            for s in ranking:
                if s not in shut:
                    return float(keys[index][s])
            # All the leaders left out: the full ranking.
            return min(
                (v for s, v in enumerate(keys[index].tolist()) if s not in shut), default=_INF
            )

        known, half, extra = self.known_list, self.half_list, self.extra_list
        for t in slow:
            shut = self._shut(t)
            if known[t]:
                row[t] = min(best(0, shut) + half[t], best(1, shut) + default + extra[t])
            else:
                row[t] = best(2, shut) + default + extra[t]
        # Measured hops: every one that can happen here, the least offer per target.
        a, b = self.hop_bounds[e], self.hop_bounds[e + 1]
        if a < b:
            offers = arrive[self.hop_source[a:b]] + self.hop_rtt[a:b]
            np.minimum.at(row, self.hop_target[a:b], offers)
        self.enter[e] = np.where((lo <= e) & (e < hi), row, _INF)

    def _began(self, i: int, e: int) -> int:
        """Where the span on ``i`` that ``arrive[e][i]`` ends began."""
        entries = self.key[self.lo[i] : e, i].copy()
        if self.windowed[i]:
            limit = int(self.window_limit[np.searchsorted(self.window, i)])
            offsets = e - np.arange(self.lo[i], e)
            entries[offsets > limit] += self.penalty_s
        return int(self.lo[i]) + int(np.argmin(entries))

    def _source(self, t: int, e: int) -> int:
        """A server ``enter[e][t]`` can come from at least cost."""
        arrive = self.arrive[e]
        hops = np.where(
            self.known & self.known[t],
            self.half + self.half[t],
            self.default_ping_s + self.extra[t],
        )
        for s, rtt in self._measured_into(t).items():
            hops[s] = rtt
        offers = arrive + hops
        offers[t] = _INF
        return int(np.argmin(offers))


def _ranked(values: np.ndarray, count: int) -> list[int]:
    """The indices of the ``count`` least ``values`` (all of them if fewer), least first."""
    if count < len(values):
        leaders = np.argpartition(values, count)[:count]
    else:
        leaders = np.arange(len(values))
    return leaders[np.argsort(values[leaders], kind="stable")].tolist()


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

    def pick(holding: list[tuple[str, ServerInfo]]) -> tuple[str, ServerInfo]:
        total = math.fsum(info.throughput for _, info in holding)
        if total <= 0:
            return holding[rng.randrange(len(holding))]
        point = rng.random() * total
        for peer_id, info in holding:
            if info.throughput > 0 and (point := point - info.throughput) < 0:
                return peer_id, info
        # Rounding left ``point`` a hair above 0: the last one it is.
        return [pair for pair in holding if pair[1].throughput > 0][-1]

    return _route_by(servers, start, end, pick)


def make_route_impartial(
    servers: Mapping[str, ServerInfo], start: int, end: int, *, rank: Callable[[str], bytes]
) -> list[RouteSpan]:
    """A route through online ``servers`` for blocks ``[start, end)`` that nothing a server
    announces can draw to itself (for checking other servers' answers, where a route chosen by
    announced throughput would let servers that claim a lot be the checkers).

    At each block, of the servers holding it, the one that comes first in the caller's ``rank``
    (a PeerID's key: a random draw, or a keyed hash that others cannot predict), run to the end
    of its span (or ``end``).  Raises :class:`MissingBlocksError` if no online server holds some
    block.
    """
    return _route_by(
        servers, start, end, lambda holding: min(holding, key=lambda pair: rank(pair[0]))
    )


def make_route_greedy(servers: Mapping[str, ServerInfo], start: int, end: int) -> list[RouteSpan]:
    """The route through online ``servers`` for blocks ``[start, end)`` with the fewest spans.

    At each block, the server holding it that reaches furthest; ties go to the higher
    throughput, then to the first PeerID.  (Reaching furthest at every step gives the fewest
    steps: any route's k-th span ends no later than the greedy one's.)  Raises
    :class:`MissingBlocksError` if no online server holds some block.
    """

    def pick(holding: list[tuple[str, ServerInfo]]) -> tuple[str, ServerInfo]:
        return min(
            holding,
            key=lambda pair: (-min(pair[1].end_block, end), -pair[1].throughput, pair[0]),
        )

    return _route_by(servers, start, end, pick)


def _route_by(
    servers: Mapping[str, ServerInfo],
    start: int,
    end: int,
    pick: Callable[[list[tuple[str, ServerInfo]]], tuple[str, ServerInfo]],
) -> list[RouteSpan]:
    """From ``start``, the server ``pick`` chooses of those holding the current block, run to
    the end of its span (or ``end``), and on from there; :class:`MissingBlocksError` if no
    online server holds some block."""
    _check_range(start, end)
    candidates = _candidates(servers, start, end)
    route: list[RouteSpan] = []
    block = start
    while block < end:
        peer_id, info = pick(
            [
                (peer_id, info)
                for peer_id, info in candidates
                if info.start_block <= block < info.end_block
            ]
        )
        stop = min(info.end_block, end)
        route.append(RouteSpan(peer_id=peer_id, start=block, end=stop))
        block = stop
    return route
