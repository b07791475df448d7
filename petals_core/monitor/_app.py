"""The monitor's HTTP face: a Starlette app over a :class:`SwarmMonitor`, and
:func:`serve_monitor`, which runs both in the caller's trio program.

Routes:

- ``GET /``: the page (:mod:`._page`);
- ``GET /api/v1/state``: the state as JSON (:meth:`SwarmState.to_json`);
- ``GET /api/v1/events``: server-sent events, one ``state`` event (id: the state's version)
  with the current state on connecting and one more each time it changes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import trio
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from .._http import serve_http
from ._monitor import MonitorConfig, SwarmMonitor, open_monitor
from ._page import CONTENT_SECURITY_POLICY, PAGE

__all__ = ["create_app", "serve_monitor"]

#: Seconds between keep-alive comments on an idle event stream (proxies close silent ones).
_KEEPALIVE_S: Final = 15.0

_NO_STORE: Final = {"Cache-Control": "no-store"}


def create_app(monitor: SwarmMonitor) -> Starlette:
    """The monitor's routes over ``monitor``'s state."""

    async def page(request: Request) -> Response:
        headers = {**_NO_STORE, "Content-Security-Policy": CONTENT_SECURITY_POLICY}
        return HTMLResponse(PAGE, headers=headers)

    async def state(request: Request) -> Response:
        return JSONResponse(monitor.state.to_json(), headers=_NO_STORE)

    async def events(request: Request) -> Response:
        return EventSourceResponse(_state_events(monitor), ping=_KEEPALIVE_S, headers=_NO_STORE)

    return Starlette(
        routes=[
            Route("/", page),
            Route("/api/v1/state", state),
            Route("/api/v1/events", events),
        ]
    )


async def _state_events(monitor: SwarmMonitor) -> AsyncIterator[dict[str, Any]]:
    """The current state, then each new one, until the monitor closes."""
    version = -1
    while (state := await monitor.wait_state(version)) is not None:
        version = state.version
        yield {"event": "state", "id": str(version), "data": json.dumps(state.to_json())}


async def serve_monitor(
    config: MonitorConfig,
    *,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Join the swarm, take a first look, and serve the page and the API on ``host``:``port``
    (0: a free port) until cancelled or until ``shutdown_trigger`` returns; ``task_status``
    gets the URLs it serves at.  Event streams end at shutdown, so it stops at once."""
    async with open_monitor(config) as monitor:

        async def shutdown() -> None:
            if shutdown_trigger is None:
                await trio.sleep_forever()
            else:
                await shutdown_trigger()
            monitor.close()

        await serve_http(
            create_app(monitor),
            host=host,
            port=port,
            shutdown_trigger=shutdown,
            task_status=task_status,
        )
