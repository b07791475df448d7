"""The HTTP stack the project's web faces share: Hypercorn's trio worker serving an ASGI app.

The OpenAI-compatible endpoint (``petals_core.api``) and the swarm monitor
(``petals_core.monitor``) are Starlette apps (server-sent events through sse-starlette) served
by :func:`serve_http` inside the caller's trio program, next to the swarm client they use.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio

from ._extras import require

__all__ = ["KEEP_ALIVE_S", "http_bind", "serve_http", "shutdown_on_signals"]

logger = logging.getLogger(__name__)

#: How long an idle HTTP connection stays open.
KEEP_ALIVE_S: Final = 75.0


def http_bind(host: str, port: int) -> str:
    """Hypercorn's form of an address to listen on (IPv6 hosts in brackets)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False  # a host name
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


async def serve_http(
    app: Any,
    *,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    graceful_timeout_s: float = 5.0,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``host``:``port`` (0: any free port) until cancelled or until
    ``shutdown_trigger`` returns; ``task_status.started`` gets the URLs it listens on.

    Open connections get ``graceful_timeout_s`` to finish after a shutdown."""
    require("http", "serving HTTP")
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [http_bind(host, port)]
    config.graceful_timeout = graceful_timeout_s
    # Longer than clients keep an idle connection (httpx, and so the openai client: 5 s): a
    # client never sends its next request on a connection the server is closing at that moment.
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.accesslog = None
    config.errorlog = logger
    # The server's own lines ("Running on ...") are left to the caller, which prints its URL.
    config.loglevel = "WARNING"
    await serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)


async def shutdown_on_signals() -> None:
    """Return at the first SIGINT or SIGTERM: a ``shutdown_trigger`` for command-line servers."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            logger.info("%s: shutting down", signal.Signals(signum).name)
            return
