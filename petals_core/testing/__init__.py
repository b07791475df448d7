"""Public test kit: an in-memory datagram network for sans-IO endpoints (links with latency,
loss and reordering; virtual time), and a swarm of real processes on loopback
(:func:`open_local_swarm`).
"""

from ._network import MemoryNetwork as MemoryNetwork, Pipe as Pipe
from ._swarm import (
    LocalSwarm as LocalSwarm,
    SwarmProcess as SwarmProcess,
    fixed_server_args as fixed_server_args,
    open_local_swarm as open_local_swarm,
)
