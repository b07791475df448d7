"""The shared HTTP stack: an ASGI app served in the caller's trio program."""

from __future__ import annotations

import json
import urllib.request

import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from petals_core._http import KEEP_ALIVE_S, http_bind, serve_http


async def _echo(request: Request) -> JSONResponse:
    return JSONResponse({"path": request.url.path})


APP = Starlette(routes=[Route("/{rest:path}", _echo)])


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=20) as reply:
        return bytes(reply.read())


def test_bind_forms() -> None:
    assert http_bind("127.0.0.1", 8000) == "127.0.0.1:8000"
    assert http_bind("::1", 8000) == "[::1]:8000"
    assert http_bind("localhost", 0) == "localhost:0"
    with pytest.raises(ValueError, match="port must be"):
        http_bind("127.0.0.1", 70000)


async def test_serves_on_a_free_port_until_the_shutdown_trigger() -> None:
    stop = trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_http(
                    APP,
                    host="127.0.0.1",
                    port=0,
                    shutdown_trigger=stop.wait,
                    task_status=task_status,
                )
            )
            assert len(urls) == 1
            assert urls[0].startswith("http://127.0.0.1:")
            assert not urls[0].endswith(":0")
            reply = await trio.to_thread.run_sync(_get, f"{urls[0]}/a/b")
            assert json.loads(reply) == {"path": "/a/b"}
            stop.set()  # the nursery ends only once the server returned


async def test_an_idle_connection_outlives_the_clients_keep_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A connection idle for longer than clients keep one (5 s for httpx and the openai client)
    still takes the next request: the server does not close it under a client reusing it."""
    request = b"GET /again HTTP/1.1\r\nHost: test\r\n\r\n"
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(
            lambda task_status: serve_http(APP, host="127.0.0.1", port=0, task_status=task_status)
        )
        port = int(urls[0].rsplit(":", 1)[1])
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            for idle_s in (0.0, KEEP_ALIVE_S - 5):
                await trio.sleep(idle_s)
                await stream.send_all(request)
                reply = b""
                while not reply.endswith(b'{"path":"/again"}'):
                    data = await stream.receive_some()
                    assert data, reply
                    reply += data
                assert reply.startswith(b"HTTP/1.1 200")
        nursery.cancel_scope.cancel()
