"""Routing over the swarm's servers: who holds which blocks, where a new server should go, and
when a running one should move.

Pure functions over :class:`ServerSpan` (built from the DHT's ``PeerTableSnapshot``), with no
I/O and no torch: the server's rebalancing loop and the client's sequence manager
(:class:`petals_core.client.RemoteSequenceManager`) drive them.
"""

from ._block_selection import (
    BALANCE_EPS as BALANCE_EPS,
    choose_best_blocks as choose_best_blocks,
    choose_best_start as choose_best_start,
    should_choose_other_blocks as should_choose_other_blocks,
)
from ._planning import (
    MissingBlocksError as MissingBlocksError,
    RouteSpan as RouteSpan,
    make_route_greedy as make_route_greedy,
    make_route_impartial as make_route_impartial,
    make_route_max_throughput as make_route_max_throughput,
    make_route_min_latency as make_route_min_latency,
    route_cost as route_cost,
    usable_servers as usable_servers,
)
from ._spans import (
    ServerSpan as ServerSpan,
    block_throughputs as block_throughputs,
    spans_from_snapshot as spans_from_snapshot,
)
