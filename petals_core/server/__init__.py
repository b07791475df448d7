"""The server: hosts a span of transformer blocks and serves them over QUIC.

Run it as ``python -m petals_core.server MODEL [options]``.  Its parts:

- :class:`MemoryCache`: the attention-cache byte budget that sessions allocate from, waiting up
  to their timeout;
- :func:`open_task_pool`: compute off the event loop, inference steps first, then by arrival
  (never by the points a client claims), with single-token steps of concurrent sessions batched
  together;
- :class:`BlockBackend` / :class:`BlockServer`: the blocks and the RPCs over them (sessions,
  forward, backward, info; the messages are :mod:`petals_core.protocol`'s);
- :func:`open_server`: the whole life of a server in the swarm (:class:`ServerConfig`);
- :class:`ServingDefaults`: the device, dtype, quantisation and number of blocks a server
  chooses when not told, Petals' defaults (on CUDA: nf4, and as many blocks as fit, see
  :class:`BlockBudget`);
- :func:`get_server_throughput`: the throughput a server announces, measured once per device,
  dtype and quantisation and cached on disk.

Each name is imported on first use: the sans-IO state of a session (``_session_state``) imports
without trio.

Its modules: ``_config`` (``ServerConfig`` and its checks), ``_server`` (the life in the swarm:
announce, serve, rebalance, leave), ``__main__`` and ``_cli_args`` (the command line),
``_defaults``, ``_throughput``, ``_bandwidth``, ``_reach`` (whether peers can dial us; relays
held when they cannot), ``_backend`` (blocks, blocking compute), ``_handler`` (the RPCs wired),
``_inference`` (sessions and pushes; their state in the I/O-free ``_session_state``),
``_training`` (forward / backward), ``_serving`` (what they share), ``_task_pool``,
``_memory_cache``.
"""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__)
