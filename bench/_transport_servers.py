"""The transport benchmark's servers, each in a child process: QUIC (raw streams and RPC), TCP
and plain UDP.  ``python -m bench._transport_servers KIND [DATAGRAM offload|no-offload]`` runs one
and prints ``ready ADDRESS`` once it listens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from petals_core.transport import (
    Handlers,
    Node,
    ServerCall,
    Stream,
    TransportConfig,
    TransportError,
    open_node,
    serve_rpc,
)

from ._transport_probes import TALLY, IoWaits, process_tally, serve_udp

READY = "ready "


async def _drain_and_count(receive: Callable[[], Awaitable[bytes]]) -> int:
    total = 0
    while data := await receive():
        total += len(data)
    return total


def _quic_tally(nodes: dict[str, Node], io_waits: IoWaits) -> dict[str, Any]:
    return process_tally(io_waits) | {
        name: attrs.asdict(node.statistics()) for name, node in nodes.items()
    }


async def _answer(stream: Stream | trio.SocketStream, tally: Callable[[], dict[str, Any]]) -> None:
    """The first byte says what the stream is for: b"e" echo until EOF, b"s" count and reply,
    b"t" reply with this process's tally (JSON)."""
    kind = await stream.receive_some(1)
    if kind == b"e":
        while data := await stream.receive_some():
            await stream.send_all(data)
    elif kind == b"s":
        total = await _drain_and_count(stream.receive_some)
        await stream.send_all(total.to_bytes(8, "big"))
    elif kind == TALLY:
        await stream.send_all(json.dumps(tally()).encode())


async def _quic_stream(stream: Stream, tally: Callable[[], dict[str, Any]]) -> None:
    async with stream:
        await _answer(stream, tally)
        await stream.send_eof()


async def _quic_stream_guarded(stream: Stream, tally: Callable[[], dict[str, Any]]) -> None:
    try:
        await _quic_stream(stream, tally)
    except TransportError:
        pass  # the client may let go of a stream before reading our end of it


def node_config(datagram: int, *, offload: bool) -> TransportConfig:
    return TransportConfig(
        loopback_datagram_bytes=datagram, max_datagram_bytes=datagram, udp_offload=offload
    )


async def _serve_quic(datagram: int, offload: bool) -> None:
    io_waits = IoWaits()
    trio.lowlevel.add_instrument(io_waits)
    config = node_config(datagram, offload=offload)
    handlers = Handlers()

    @handlers.unary("ping")
    async def ping(request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        return request

    # One node answers raw streams (byte-level rows), another RPC calls (the unary row).
    async with (
        open_node(config=config) as raw,
        open_node(config=config) as rpc,
        trio.open_nursery() as nursery,
    ):

        def tally() -> dict[str, Any]:
            return _quic_tally({"raw": raw, "rpc": rpc}, io_waits)

        raw.set_stream_handler(
            lambda stream: nursery.start_soon(_quic_stream_guarded, stream, tally)
        )
        await nursery.start(serve_rpc, rpc, handlers)
        print(READY + f"{raw.listen_multiaddr} {rpc.listen_multiaddr}", flush=True)
        await trio.sleep_forever()


async def _serve_tcp() -> None:
    io_waits = IoWaits()
    trio.lowlevel.add_instrument(io_waits)

    async def handle(stream: trio.SocketStream) -> None:
        stream.setsockopt(6, 1, 1)  # TCP_NODELAY
        await _answer(stream, lambda: process_tally(io_waits))
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        print(READY + f"127.0.0.1:{port}", flush=True)
        await trio.sleep_forever()


def serve(kind: str, rest: list[str]) -> None:
    if kind == "tcp":
        trio.run(_serve_tcp)
    elif kind == "udp":
        trio.run(serve_udp, lambda address: print(READY + address, flush=True))
    else:
        trio.run(_serve_quic, int(rest[0]), rest[1] == "offload")


class Server:
    """A benchmark server in a child process (one Python interpreter, its own core if free)."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench._transport_servers", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.startswith(READY):
            self.close()
            raise SystemExit(f"benchmark server did not start: {line!r}")
        self.address = line[len(READY) :].strip()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
