"""A live monitor of a swarm: a web page and a JSON API showing every model announced, which of
its blocks are served and how many times, and each server with what it announced and the
round-trip time to it.

``python -m petals_core.monitor --initial_peers MULTIADDR`` serves it; in a trio program::

    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            partial(serve_monitor, MonitorConfig(initial_peers=[...]), host="127.0.0.1", port=0)
        )

It finds the models in the swarm's registry (``petals_core.dht.MODELS_KEY``, which servers
fill), follows each one's servers as clients do (DHT reads plus gossip) and pings them.  It is
the top layer: nothing else in the package imports it, and importing it loads no torch.
"""

from .._extras import require

require("http", "the monitor (petals_core.monitor)")

from ._app import create_app as create_app, serve_monitor as serve_monitor
from ._monitor import (
    MonitorConfig as MonitorConfig,
    SwarmMonitor as SwarmMonitor,
    open_monitor as open_monitor,
)
from ._state import (
    BlockCoverage as BlockCoverage,
    ModelState as ModelState,
    ServerRow as ServerRow,
    SwarmState as SwarmState,
    build_state as build_state,
)
