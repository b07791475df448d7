# The names petals_core.server exports, each loaded on first access (see petals_core._lazy).

from ._backend import BlockBackend as BlockBackend
from ._config import ServerConfig as ServerConfig
from ._defaults import BlockBudget as BlockBudget, ServingDefaults as ServingDefaults
from ._handler import (
    BlockServer as BlockServer,
    BlockServerStatistics as BlockServerStatistics,
    ServingLimits as ServingLimits,
)
from ._memory_cache import (
    CacheGrant as CacheGrant,
    MemoryCache as MemoryCache,
    MemoryCacheStatistics as MemoryCacheStatistics,
)
from ._server import Server as Server, open_server as open_server
from ._task_pool import (
    Priority as Priority,
    TaskPool as TaskPool,
    TaskPoolStatistics as TaskPoolStatistics,
    open_task_pool as open_task_pool,
)
from ._throughput import (
    DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S as DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S,
    ComputeMeasure as ComputeMeasure,
    ThroughputInfo as ThroughputInfo,
    get_server_throughput as get_server_throughput,
    measure_compute_rps as measure_compute_rps,
    throughput_cache_key as throughput_cache_key,
)
