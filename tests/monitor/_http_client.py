"""A small HTTP/1.1 client on trio (h11, which the server side uses too) for the monitor's
tests: JSON replies and server-sent event streams, cancellable like any trio code."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import attrs
import h11
import trio


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.frozen
class Event:
    """One server-sent event: its type, id and data (the data lines joined)."""

    event: str
    id: str | None
    data: str

    def json(self) -> Any:
        return json.loads(self.data)


@asynccontextmanager
async def _request(url: str) -> AsyncIterator[tuple[h11.Response, AsyncIterator[bytes]]]:
    """GET ``url``: the response head and an iterator over the body's chunks."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    connection = h11.Connection(h11.CLIENT)
    async with await trio.open_tcp_stream(parts.hostname, parts.port) as stream:
        request = h11.Request(
            method="GET", target=parts.path or "/", headers=[("Host", parts.netloc)]
        )
        await stream.send_all(connection.send(request) + connection.send(h11.EndOfMessage()))

        async def next_event() -> Any:
            while (event := connection.next_event()) is h11.NEED_DATA:
                connection.receive_data(await stream.receive_some(65536))
            return event

        response = await next_event()
        assert isinstance(response, h11.Response), response

        async def body() -> AsyncIterator[bytes]:
            while isinstance(event := await next_event(), h11.Data):
                yield bytes(event.data)
            assert isinstance(event, h11.EndOfMessage), event

        yield response, body()


async def get(url: str) -> Reply:
    async with _request(url) as (response, body):
        data = b"".join([chunk async for chunk in body])
    headers = {name.decode().lower(): value.decode() for name, value in response.headers}
    return Reply(response.status_code, headers, data)


async def get_json(url: str) -> Any:
    reply = await get(url)
    assert reply.status == 200, reply
    return reply.json()


@asynccontextmanager
async def open_events(url: str) -> AsyncIterator[AsyncIterator[Event]]:
    """The server-sent events at ``url``, as they come (keep-alive comments left out)."""
    async with _request(url) as (response, body):
        assert response.status_code == 200, response
        headers = dict(response.headers)
        assert headers[b"content-type"].startswith(b"text/event-stream")

        async def events() -> AsyncIterator[Event]:
            buffer = ""
            async for chunk in body:
                buffer += chunk.decode().replace("\r\n", "\n")
                *blocks, buffer = buffer.split("\n\n")
                for block in blocks:
                    fields: dict[str, list[str]] = {}
                    for line in block.split("\n"):
                        if line and not line.startswith(":"):
                            name, _, value = line.partition(":")
                            fields.setdefault(name, []).append(value.removeprefix(" "))
                    if "data" in fields:
                        yield Event(
                            event=fields.get("event", ["message"])[-1],
                            id=fields.get("id", [None])[-1],
                            data="\n".join(fields["data"]),
                        )

        yield events()
