"""Routing over the swarm's servers: who holds which blocks, where a new server should go, and
when a running one should move.

Pure functions over :class:`ServerSpan` (built from the DHT's ``PeerTableSnapshot``), with no
I/O and no torch: the server's rebalancing loop and the client's route planning drive them.
"""

from ._block_selection import (
    BALANCE_EPS as BALANCE_EPS,
    choose_best_blocks as choose_best_blocks,
    choose_best_start as choose_best_start,
    should_choose_other_blocks as should_choose_other_blocks,
)
from ._spans import (
    ServerSpan as ServerSpan,
    block_throughputs as block_throughputs,
    spans_from_snapshot as spans_from_snapshot,
)
