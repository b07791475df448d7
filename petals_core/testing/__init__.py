"""Public test kit: an in-memory datagram network for sans-IO endpoints (links with latency,
loss and reordering; virtual time), a swarm of real processes on loopback
(:func:`open_local_swarm`), a UDP relay that makes loopback as slow as a WAN
(:class:`DelayRelay`), hosts behind real NATs in network namespaces (:func:`open_topology`)
with clients and other programs run inside them (:func:`open_host_client`,
:func:`open_host_program`), a lying server for tests of the
client's checks (:func:`make_liar`), and model configs for tests and
benchmarks (tiny ones, and real models' shapes).
"""

from .._local_swarm import (
    LocalSwarm as LocalSwarm,
    SwarmProcess as SwarmProcess,
    fixed_server_args as fixed_server_args,
    open_local_swarm as open_local_swarm,
)
from ._configs import (
    bloom_560m_config as bloom_560m_config,
    falcon_7b_config as falcon_7b_config,
    mixtral_8x7b_config as mixtral_8x7b_config,
    smollm2_135m_config as smollm2_135m_config,
    tiny_bloom_config as tiny_bloom_config,
    tiny_falcon_config as tiny_falcon_config,
    tiny_llama_config as tiny_llama_config,
    tiny_mixtral_config as tiny_mixtral_config,
    tinyllama_1b_config as tinyllama_1b_config,
)
from ._host_client import (
    HostClient as HostClient,
    open_host_client as open_host_client,
    open_host_program as open_host_program,
)
from ._liar import make_liar as make_liar
from ._nat import (
    Host as Host,
    Router as Router,
    Topology as Topology,
    missing_nat_tools as missing_nat_tools,
    open_topology as open_topology,
)
from ._network import MemoryNetwork as MemoryNetwork, Pipe as Pipe
from ._relay import DelayRelay as DelayRelay, RelayStats as RelayStats
