"""Unary and bidirectional-streaming calls, one QUIC stream per call.

On the wire a call is a stream of length-prefixed CBOR frames (see ``_codec``):

* caller -> callee: ``{"call": method}``, then ``{"msg": {...}}`` frames, then end of stream;
* callee -> caller: ``{"msg": {...}}`` frames, then end of stream; or, when the handler raised,
  ``{"err": {"type", "message"}}`` and end of stream.

Deadlines are trio cancel scopes around the call.  When the caller's scope is cancelled (or the call
block exits early) the stream is reset, and the callee's handler is cancelled in turn.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import trio

from .._errors import (
    CallEnded,
    CodecError,
    LocalProtocolError,
    RemoteError,
    RemoteProtocolError,
    TransportError,
)
from ._codec import FrameDecoder, decode_message_untrusted, encode_frame
from ._codec_format import CodecLimits
from ._connection import Connection, Stream
from ._endpoint_conn import APP_CANCELLED, APP_PROTOCOL
from ._identity import PeerID

if TYPE_CHECKING:
    from ._node import Node

__all__ = ["Call", "Handlers", "ServerCall", "call_unary", "open_call", "serve_rpc"]

logger = logging.getLogger(__name__)

_READ_BYTES = 1 << 20

Message = dict[str, Any]
UnaryHandler = Callable[[Message, "ServerCall"], Awaitable[Mapping[str, Any]]]
StreamHandler = Callable[["ServerCall"], Awaitable[None]]


class _Framed:
    """Messages over one stream: frames out, frames in (decoded as untrusted)."""

    def __init__(self, stream: Stream, limits: CodecLimits) -> None:
        self.stream = stream
        self._limits = limits
        self._decoder = FrameDecoder(limits)
        self._large_frames = stream.connection._large_frames
        self._large_frame_bytes = stream.connection._node.config.large_frame_bytes
        self._assembling_large = False
        #: Set when the peer broke the protocol on this stream.
        self.protocol_error: RemoteProtocolError | None = None

    def fail(self, problem: str) -> RemoteProtocolError:
        self.protocol_error = RemoteProtocolError(problem)
        return self.protocol_error

    def broken(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this stream failing (as opposed to code that merely used it)."""
        return exc is self.protocol_error or self.stream.failure is exc

    async def send(self, *envelopes: Mapping[str, Any], eof: bool = False) -> None:
        """Send the envelopes in one write (and then end our side if ``eof``)."""
        try:
            frames = b"".join(encode_frame(envelope) for envelope in envelopes)
        except CodecError as exc:
            raise LocalProtocolError(f"cannot encode message: {exc}") from exc
        await self.stream.send_all(frames, eof=eof)

    async def receive(self) -> Message | None:
        """The next envelope, or None when the peer finished its side cleanly."""
        while True:
            try:
                frame = self._decoder.next_frame()
                if frame is not None:
                    self._check_large()
                    return decode_message_untrusted(frame, limits=self._limits)
            except CodecError as exc:
                raise self.fail(f"peer sent a malformed frame: {exc}") from exc
            if not self._check_large():
                # Frames larger than large_frame_bytes are assembled one at a time per
                # connection; while we wait, unread bytes hold the peer's window shut.  This
                # is what bounds a connection's memory whatever frame sizes a peer declares.
                self.stream.hold_back(True)
                try:
                    await self._large_frames.acquire()
                finally:
                    self.stream.hold_back(False)
                self._assembling_large = True
            data = await self.stream.receive_some(_READ_BYTES)
            if not data:
                if self._decoder.buffered_bytes:
                    raise self.fail("the peer ended the stream inside a frame")
                return None
            try:
                self._decoder.feed(data)
            except CodecError as exc:
                raise self.fail(f"peer sent a malformed frame: {exc}") from exc

    def _check_large(self) -> bool:
        """Whether this stream may buffer more; lets go of the large-frame turn when done."""
        small = self._decoder.buffered_bytes < self._large_frame_bytes
        if small and self._assembling_large:
            self.release()
        return small or self._assembling_large

    def release(self) -> None:
        """Give up the large-frame turn, if held (when the call ends, however it ends)."""
        if self._assembling_large:
            self._assembling_large = False
            self._large_frames.release()


def _unwrap(envelope: Message, method: str) -> Message:
    """Turn a callee's envelope into the message, or raise what the callee reported."""
    if "msg" in envelope and isinstance(envelope["msg"], dict):
        return envelope["msg"]
    error = envelope.get("err")
    if isinstance(error, dict):
        raise RemoteError(
            str(error.get("type", "Error"))[:200], str(error.get("message", ""))[:4000]
        )
    raise RemoteProtocolError(f"unexpected reply to {method!r}: neither a message nor an error")


class Call:
    """The caller's side of a streaming call (from :func:`open_call`)."""

    def __init__(self, framed: _Framed, method: str) -> None:
        self._framed = framed
        self.method = method
        self._finished = False

    @property
    def peer_id(self) -> PeerID:
        return self._framed.stream.peer_id

    async def send(self, message: Mapping[str, Any], *, eof: bool = False) -> None:
        """Send ``message``; with ``eof``, end our side in the same write (a callee that
        answers as soon as it has the message then finds nothing left to wait for)."""
        await self._framed.send({"msg": message}, eof=eof)

    async def send_eof(self) -> None:
        """Tell the callee no more messages will come."""
        await self._framed.stream.send_eof()

    def reset(self) -> None:
        """Abandon the call both ways at once: the callee sees the stream reset, and never
        takes part of a message (one whose sending was cut short) for a whole one."""
        self._framed.stream.reset(APP_CANCELLED)

    async def receive(self) -> Message:
        """The callee's next message; raises ``CallEnded`` once the callee finished."""
        if self._finished:
            raise CallEnded(f"{self.method!r}: the callee sent all it had")
        envelope = await self._framed.receive()
        if envelope is None:
            self._finished = True
            raise CallEnded(f"{self.method!r}: the callee sent all it had")
        return _unwrap(envelope, self.method)

    def __aiter__(self) -> AsyncIterator[Message]:
        return _until_ended(self.receive)


@asynccontextmanager
async def open_call(
    connection: Connection, method: str, *, limits: CodecLimits | None = None
) -> AsyncIterator[Call]:
    """Open a bidirectional streaming call; leaving the block early cancels it on both sides."""
    async with _opened_call(connection, method, limits) as framed:
        yield Call(framed, method)


@asynccontextmanager
async def _opened_call(
    connection: Connection,
    method: str,
    limits: CodecLimits | None,
    *first: Mapping[str, Any],
    eof: bool = False,
) -> AsyncIterator[_Framed]:
    """A call's stream, its header (and any ``first`` envelopes) sent; reset if left early."""
    stream = await connection.open_stream()
    framed = _Framed(stream, limits or connection._node.config.codec_limits)
    completed = False
    try:
        await framed.send({"call": method}, *first, eof=eof)
        yield framed
        completed = True
    finally:
        framed.release()
        if completed:
            await stream.aclose()
        else:
            stream.reset(APP_CANCELLED)


async def call_unary(
    connection: Connection,
    method: str,
    request: Mapping[str, Any],
    *,
    limits: CodecLimits | None = None,
) -> Message:
    """One request, one reply.  Put it in a ``trio.fail_after`` scope for a deadline."""
    # Header, request and end of stream leave in one packet when they fit.
    async with _opened_call(connection, method, limits, {"msg": request}, eof=True) as framed:
        try:
            return await Call(framed, method).receive()
        except CallEnded:
            raise RemoteProtocolError(f"{method!r} ended without a reply") from None


class ServerCall:
    """The callee's side of a call, passed to handlers."""

    def __init__(self, framed: _Framed, method: str) -> None:
        self._framed = framed
        self.method = method

    @property
    def peer_id(self) -> PeerID:
        """Who called: the PeerID whose key the caller proved in the handshake."""
        return self._framed.stream.peer_id

    @property
    def remote_address(self) -> tuple[str, int]:
        """The caller's (host, port) as this node sees it (a virtual address when it came
        through a relay: see ``Connection.relay``)."""
        return self._framed.stream.connection.address

    @property
    def connection(self) -> Connection:
        """The connection the call came on."""
        return self._framed.stream.connection

    @contextmanager
    def held_back(self) -> Iterator[None]:
        """While in the block, what the caller sends waits on this call's stream (within the
        stream's window) without counting against the connection's: a handler that waits its
        turn before it reads must not starve the caller's other calls."""
        self._framed.stream.hold_back(True)
        try:
            yield
        finally:
            self._framed.stream.hold_back(False)

    async def send(self, message: Mapping[str, Any]) -> None:
        await self._framed.send({"msg": message})

    async def receive(self) -> Message:
        """The caller's next message; raises ``CallEnded`` once the caller finished."""
        envelope = await self._framed.receive()
        if envelope is None:
            raise CallEnded(f"{self.method!r}: the caller sent all it had")
        message = envelope.get("msg")
        if not isinstance(message, dict):
            raise RemoteProtocolError(f"call {self.method!r}: expected a message frame")
        return message

    def __aiter__(self) -> AsyncIterator[Message]:
        return _until_ended(self.receive)


async def _until_ended(receive: Callable[[], Awaitable[Message]]) -> AsyncIterator[Message]:
    """The messages ``receive`` returns until it raises :class:`CallEnded`."""
    while True:
        try:
            yield await receive()
        except CallEnded:
            return


class Handlers:
    """A method table for :func:`serve_rpc`."""

    def __init__(self) -> None:
        self._table: dict[str, tuple[str, Callable[..., Awaitable[Any]]]] = {}

    def add_unary(self, method: str, handler: UnaryHandler) -> None:
        """``handler(request, call) -> reply``."""
        self._table[method] = ("unary", handler)

    def add_stream(self, method: str, handler: StreamHandler) -> None:
        """``handler(call)``: receives and sends any number of messages."""
        self._table[method] = ("stream", handler)

    def unary(self, method: str) -> Callable[[UnaryHandler], UnaryHandler]:
        def register(handler: UnaryHandler) -> UnaryHandler:
            self.add_unary(method, handler)
            return handler

        return register

    def stream(self, method: str) -> Callable[[StreamHandler], StreamHandler]:
        def register(handler: StreamHandler) -> StreamHandler:
            self.add_stream(method, handler)
            return handler

        return register

    def lookup(self, method: str) -> tuple[str, Callable[..., Awaitable[Any]]] | None:
        return self._table.get(method)

    @property
    def methods(self) -> frozenset[str]:
        return frozenset(self._table)

    def include(self, other: Handlers) -> None:
        """Add every method of ``other`` (several services on one node); a method both define
        raises ``ValueError``."""
        clash = self._table.keys() & other._table.keys()
        if clash:
            raise ValueError(f"methods defined twice: {sorted(clash)}")
        self._table.update(other._table)


async def serve_rpc(
    node: Node,
    handlers: Handlers,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer calls that peers open on ``node`` until cancelled; handlers run in our nursery."""
    async with trio.open_nursery() as nursery:
        node.set_stream_handler(lambda stream: nursery.start_soon(_serve_stream, stream, handlers))
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            node.set_stream_handler(None)
            nursery.cancel_scope.cancel()


async def _serve_stream(stream: Stream, handlers: Handlers) -> None:
    framed = _Framed(stream, stream.connection._node.config.codec_limits)
    try:
        await _serve_framed(framed, stream, handlers)
    finally:
        framed.release()
        # However we got here (serve_rpc itself cancelled, say), the caller must not be left
        # waiting on a stream nobody serves; a no-op if the call already ended cleanly.
        stream.reset(APP_CANCELLED)


async def _serve_framed(framed: _Framed, stream: Stream, handlers: Handlers) -> None:
    with trio.CancelScope() as scope:
        # A reset from the caller (its cancellation) cancels the handler.
        stream.cancel_on_reset(scope)
        try:
            await _answer(framed, handlers)
        except TransportError as exc:
            if framed.protocol_error is exc:
                # Say what was wrong, then stop reading: the peer's stream is beyond repair.
                await _report(framed, "ProtocolError", str(exc))
                await stream.aclose()
            else:
                stream.reset(APP_CANCELLED)
            return
        except Exception:
            # A bug here must cost one call, never the server.
            logger.exception("serving a call failed")
            stream.reset(APP_PROTOCOL)
            return
        await stream.aclose()
    if scope.cancelled_caught:
        stream.reset(APP_CANCELLED)


async def _answer(framed: _Framed, handlers: Handlers) -> None:
    header_timeout_s = framed.stream.connection._node.config.request_header_timeout_s
    with trio.move_on_after(header_timeout_s) as waited:
        header = await framed.receive()
    if waited.cancelled_caught:
        raise framed.fail(f"no call header within {header_timeout_s} s")
    method = None if header is None else header.get("call")
    if not isinstance(method, str):
        raise framed.fail("a call must start with a {'call': method} frame")
    entry = handlers.lookup(method)
    if entry is None:
        await _report(framed, "UnknownMethod", f"no method {method!r} here")
        return
    kind, handler = entry
    call = ServerCall(framed, method)
    try:
        if kind == "unary":
            with trio.move_on_after(header_timeout_s) as waited:
                request = await _one_request(framed, call)
            if waited.cancelled_caught:
                raise framed.fail(f"no request of {method!r} within {header_timeout_s} s")
            await framed.send({"msg": await handler(request, call)}, eof=True)
        else:
            await handler(call)
            await framed.stream.send_eof()
    except Exception as exc:
        if framed.broken(exc):
            raise
        # The handler failed (possibly on a call of its own to someone else): the caller gets
        # the type and message, and we go on serving.
        logger.debug("handler for %r raised", method, exc_info=True)
        await _report(framed, type(exc).__name__, str(exc))


async def _one_request(framed: _Framed, call: ServerCall) -> Message:
    """A unary call's request: exactly one message, then the caller's end of stream."""
    try:
        request = await call.receive()
    except CallEnded:
        raise framed.fail(f"{call.method!r} expects a request message") from None
    try:
        await call.receive()
    except CallEnded:
        return request
    raise framed.fail(f"{call.method!r} is unary: one request message, then end of stream")


async def _report(framed: _Framed, error_type: str, message: str) -> None:
    """Tell the caller why its call failed, and end our side."""
    try:
        await framed.send({"err": {"type": error_type, "message": message[:4000]}}, eof=True)
    except TransportError:
        pass
