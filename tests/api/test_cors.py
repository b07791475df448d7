"""Browsers may call the endpoint from the web origins it allows (CORS), and from no other."""

from __future__ import annotations

import http.client
import urllib.parse
from typing import Any

import trio

from petals_core._http import serve_http
from petals_core.api import create_app

ORIGIN = "http://localhost:3000"


def _request(url: str, method: str, path: str, headers: dict[str, str]) -> Any:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, path, headers=headers)
        reply = connection.getresponse()
        reply.read()
        return reply
    finally:
        connection.close()


def test_allowed_origins_get_cors_headers(endpoint: Any) -> None:
    async def ask() -> tuple[Any, Any, Any]:
        app = create_app(endpoint.api.engine, allow_origins=[ORIGIN])
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_http(
                    app, host="127.0.0.1", port=0, task_status=task_status
                )
            )
            preflight = await trio.to_thread.run_sync(
                _request,
                urls[0],
                "OPTIONS",
                "/v1/chat/completions",
                {
                    "Origin": ORIGIN,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )
            allowed = await trio.to_thread.run_sync(
                _request, urls[0], "GET", "/v1/models", {"Origin": ORIGIN}
            )
            other = await trio.to_thread.run_sync(
                _request, urls[0], "GET", "/v1/models", {"Origin": "http://evil.example"}
            )
            nursery.cancel_scope.cancel()
        return preflight, allowed, other

    preflight, allowed, other = endpoint.run(ask)
    assert preflight.status == 200
    assert preflight.getheader("access-control-allow-origin") == ORIGIN
    assert "POST" in preflight.getheader("access-control-allow-methods")
    assert allowed.status == 200
    assert allowed.getheader("access-control-allow-origin") == ORIGIN
    assert other.getheader("access-control-allow-origin") is None


def test_no_origin_is_allowed_by_default(endpoint: Any) -> None:
    reply = _request(endpoint.url, "GET", "/v1/models", {"Origin": ORIGIN})
    assert reply.status == 200
    assert reply.getheader("access-control-allow-origin") is None
