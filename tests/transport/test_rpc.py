"""RPC over real UDP sockets on loopback: the trio node, streams and calls end to end."""

from __future__ import annotations

import hashlib
import random
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from petals_core.transport import (
    ClosedResourceError,
    Connection,
    ConnectTimeout,
    Handlers,
    Identity,
    IdentityMismatch,
    LocalProtocolError,
    Multiaddr,
    Node,
    PeerUnreachable,
    RemoteError,
    ServerCall,
    Stream,
    StreamReset,
    TransportConfig,
    call_unary,
    open_call,
    open_node,
    serve_rpc,
)

DEADLINE_S = 60


def _handlers(events: dict[str, trio.Event]) -> Handlers:
    handlers = Handlers()

    @handlers.unary("echo")
    async def echo(request: dict, call: ServerCall) -> dict:
        return {"echo": request, "caller": str(call.peer_id)}

    @handlers.unary("boom")
    async def boom(request: dict, call: ServerCall) -> dict:
        raise ValueError(f"bad value {request.get('x')}")

    @handlers.unary("hang")
    async def hang(request: dict, call: ServerCall) -> dict:
        events["hang_started"].set()
        try:
            await trio.sleep_forever()
        finally:
            events["hang_cancelled"].set()

    @handlers.stream("sha256")
    async def sha256(call: ServerCall) -> None:
        digest = hashlib.sha256()
        total = 0
        async for message in call:
            digest.update(message["chunk"])
            total += len(message["chunk"])
        await call.send({"sha256": digest.hexdigest(), "bytes": total})

    @handlers.stream("counter")
    async def counter(call: ServerCall) -> None:
        async for message in call:
            await call.send({"n": message["n"] + 1})

    return handlers


@asynccontextmanager
async def server_and_client(
    config: TransportConfig | None = None,
) -> AsyncIterator[tuple[Node, Node, dict[str, trio.Event]]]:
    events = {"hang_started": trio.Event(), "hang_cancelled": trio.Event()}
    async with (
        open_node(config=config) as server,
        open_node(config=config) as client,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_rpc, server, _handlers(events))
        yield server, client, events
        nursery.cancel_scope.cancel()


async def test_unary_calls_and_caller_identity() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            assert connection.peer_id == server.peer_id
            reply = await call_unary(connection, "echo", {"x": [1, 2, "three"]})
            assert reply == {"echo": {"x": [1, 2, "three"]}, "caller": str(client.peer_id)}


async def test_100_concurrent_unary_calls_share_one_connection() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            results: dict[int, dict] = {}

            async def one(index: int) -> None:
                connection = await client.connect(server.listen_multiaddr)
                results[index] = await call_unary(connection, "echo", {"i": index})

            async with trio.open_nursery() as nursery:
                for index in range(100):
                    nursery.start_soon(one, index)
            assert all(results[i]["echo"] == {"i": i} for i in range(100))
            assert client.statistics().connections == 1


async def test_eight_concurrent_4mib_streams_verified_by_hash() -> None:
    chunk_bytes = 256 << 10
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            outcome: dict[int, tuple[str, dict]] = {}

            async def upload(index: int) -> None:
                rng = random.Random(index)
                digest = hashlib.sha256()
                async with open_call(connection, "sha256") as call:
                    for _ in range((4 << 20) // chunk_bytes):
                        chunk = rng.randbytes(chunk_bytes)
                        digest.update(chunk)
                        await call.send({"chunk": chunk})
                    await call.send_eof()
                    outcome[index] = (digest.hexdigest(), await call.receive())

            async with trio.open_nursery() as nursery:
                for index in range(8):
                    nursery.start_soon(upload, index)
            for expected, reply in outcome.values():
                assert reply == {"sha256": expected, "bytes": 4 << 20}


async def test_bidirectional_stream_ping_pong() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            async with open_call(connection, "counter") as call:
                n = 0
                for _ in range(50):
                    await call.send({"n": n})
                    n = (await call.receive())["n"]
                await call.send_eof()
                assert [m async for m in call] == []
            assert n == 50


async def test_handler_exception_reaches_caller_and_server_keeps_serving() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            with pytest.raises(RemoteError) as info:
                await call_unary(connection, "boom", {"x": 7})
            assert info.value.remote_type == "ValueError"
            assert info.value.remote_message == "bad value 7"
            with pytest.raises(RemoteError) as info:
                await call_unary(connection, "no_such_method", {})
            assert info.value.remote_type == "UnknownMethod"
            assert (await call_unary(connection, "echo", {"ok": True}))["echo"] == {"ok": True}


async def test_cancelling_a_call_cancels_the_remote_handler() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, events):
            connection = await client.connect(server.listen_multiaddr)
            async with trio.open_nursery() as nursery:

                async def caller() -> None:
                    await call_unary(connection, "hang", {})

                nursery.start_soon(caller)
                await events["hang_started"].wait()
                nursery.cancel_scope.cancel()
            await events["hang_cancelled"].wait()
            # The connection still works afterwards.
            assert (await call_unary(connection, "echo", {}))["echo"] == {}


async def test_wrong_peer_id_fails_with_identity_mismatch() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            impostor = server.listen_multiaddr.with_peer_id(Identity.generate().peer_id)
            with pytest.raises(IdentityMismatch):
                await client.connect(impostor)
            # The right PeerID still works.
            await client.connect(server.listen_multiaddr)


async def test_unreachable_address_fails_within_its_timeout() -> None:
    # A bound socket that never answers: the handshake cannot complete.
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    try:
        config = TransportConfig(connect_timeout_s=1.0)
        address = Multiaddr.from_socket_address(*silent.getsockname(), Identity.generate().peer_id)
        with trio.fail_after(DEADLINE_S):
            async with open_node(config=config) as client:
                start = trio.current_time()
                with pytest.raises(ConnectTimeout):
                    await client.connect(address)
                assert 1.0 <= trio.current_time() - start < 10
    finally:
        silent.close()


async def test_ipv6_loopback() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with trio.fail_after(DEADLINE_S):
        async with (
            open_node(host="::1") as server,
            open_node(host="::1") as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, server, _handlers({}))
            assert str(server.listen_multiaddr).startswith("/ip6/::1/udp/")
            connection = await client.connect(str(server.listen_multiaddr))
            assert (await call_unary(connection, "echo", {"v": 6}))["echo"] == {"v": 6}
            nursery.cancel_scope.cancel()


async def test_closed_connection_is_reported_as_closed_by_you() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            await connection.aclose()
            with pytest.raises(ClosedResourceError):
                await call_unary(connection, "echo", {})
            # A new connect gives a fresh connection.
            fresh = await client.connect(server.listen_multiaddr)
            assert fresh is not connection
            assert (await call_unary(fresh, "echo", {}))["echo"] == {}


async def test_sender_waits_when_the_peer_does_not_read() -> None:
    config = TransportConfig(
        stream_window_bytes=256 << 10, connection_window_bytes=1 << 20, send_buffer_bytes=1 << 20
    )
    with trio.fail_after(DEADLINE_S):
        async with open_node(config=config) as server, open_node(config=config) as client:
            accepted: list = []
            server.set_stream_handler(accepted.append)
            connection = await client.connect(server.listen_multiaddr)
            stream = await connection.open_stream()
            sent = 0
            with trio.move_on_after(2):
                while True:
                    await stream.send_all(bytes(64 << 10))
                    sent += 64 << 10
            # Memory stays bounded: what we queued is at most our bound plus the peer's window.
            assert sent <= config.send_buffer_bytes + config.stream_window_bytes + (64 << 10)
            (incoming,) = accepted
            received = 0
            while received < sent:
                received += len(await incoming.receive_some())
            assert received == sent
            stream.reset()


def test_config_is_frozen_and_validated() -> None:
    config = TransportConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.idle_timeout_s = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_datagram_bytes"):
        TransportConfig(max_datagram_bytes=100)


async def test_send_buffer_bound_covers_streams_already_let_go() -> None:
    """Unacknowledged bytes of streams we finished and closed still count: a peer that never
    reads cannot make us queue one buffer per call."""
    config = TransportConfig(
        stream_window_bytes=256 << 10, connection_window_bytes=1 << 20, send_buffer_bytes=1 << 20
    )
    with trio.fail_after(DEADLINE_S):
        async with open_node(config=config) as server, open_node(config=config) as client:
            held: list = []
            server.set_stream_handler(held.append)  # accepts streams, never reads them
            connection = await client.connect(server.listen_multiaddr)
            finished = 0
            with trio.move_on_after(2):
                while True:
                    stream = await connection.open_stream()
                    await stream.send_all(bytes(256 << 10), eof=True)
                    await stream.aclose()
                    finished += 1
            queued = client._endpoint.send_buffered(connection._handle)
            assert queued <= config.send_buffer_bytes
            # What went out is bounded by our buffer plus what the peer's windows let through.
            assert finished * (256 << 10) <= config.send_buffer_bytes + (
                config.connection_window_bytes
            ) + (256 << 10)


async def test_large_frames_are_assembled_one_at_a_time_per_connection() -> None:
    config = TransportConfig(
        stream_window_bytes=256 << 10,
        connection_window_bytes=4 << 20,
        send_buffer_bytes=1 << 20,
        large_frame_bytes=64 << 10,
    )
    declared = 8 << 20
    with trio.fail_after(DEADLINE_S):
        async with (
            open_node(config=config) as server,
            open_node(config=config) as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, server, Handlers())
            connection = await client.connect(server.listen_multiaddr)
            streams = [await connection.open_stream() for _ in range(3)]
            for stream in streams:
                # Each announces an 8 MiB frame and sends only part of it, slowly.
                await stream.send_all(declared.to_bytes(4, "big"))
            sent = [0, 0, 0]

            async def push(index: int) -> None:
                while sent[index] < 2 << 20:
                    await streams[index].send_all(bytes(64 << 10))
                    sent[index] += 64 << 10

            with trio.move_on_after(3):
                async with trio.open_nursery() as pushers:
                    for index in range(3):
                        pushers.start_soon(push, index)
            received = server.statistics().bytes_received
            # One stream may assemble its large frame; the others stop at about the threshold
            # plus their windows, whatever they declared.
            per_blocked = config.large_frame_bytes + 2 * config.stream_window_bytes
            assert received <= (2 << 20) + 2 * per_blocked + (512 << 10)
            for stream in streams:
                stream.reset()
            nursery.cancel_scope.cancel()


async def test_exceptions_from_the_block_are_not_wrapped() -> None:
    silent = Multiaddr.from_socket_address("127.0.0.1", 9, Identity.generate().peer_id)

    async def dial_nobody() -> None:
        async with open_node(config=TransportConfig(connect_timeout_s=0.5)) as client:
            with trio.fail_after(DEADLINE_S):
                await client.connect(silent)

    with pytest.raises(ConnectTimeout):
        await dial_nobody()


async def test_calls_beyond_the_peers_stream_limit_wait_and_can_be_cancelled() -> None:
    config = TransportConfig(max_incoming_streams=8)
    with trio.fail_after(DEADLINE_S):
        async with server_and_client(config) as (server, client, events):
            connection = await client.connect(server.listen_multiaddr)
            async with trio.open_nursery() as nursery:
                for _ in range(40):
                    nursery.start_soon(call_unary, connection, "hang", {})
                await events["hang_started"].wait()
                # 8 calls are being served; 32 wait for the peer to allow more streams.
                nursery.cancel_scope.cancel()
            # Cancelling calls that never got a stream broke nothing: the connection still works,
            # and all 40 handlers' slots are free again.
            replies = []

            async def echo(index: int) -> None:
                replies.append(await call_unary(connection, "echo", {"i": index}))

            async with trio.open_nursery() as nursery:
                for index in range(20):
                    nursery.start_soon(echo, index)
            assert sorted(r["echo"]["i"] for r in replies) == list(range(20))
            assert not connection.is_closed


async def test_unencodable_request_is_a_local_protocol_error() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            with pytest.raises(LocalProtocolError, match="cannot encode"):
                await call_unary(connection, "echo", {"x": object()})
            assert (await call_unary(connection, "echo", {"x": 1}))["echo"] == {"x": 1}


async def test_address_of_another_family_is_unreachable() -> None:
    # An IPv4-only node cannot send to an IPv6 address: the dial fails at once, clearly.
    ipv6 = Multiaddr.from_socket_address("::1", 9, Identity.generate().peer_id)
    with trio.fail_after(DEADLINE_S):
        async with open_node(host="127.0.0.1") as client:
            with pytest.raises(PeerUnreachable, match="cannot send"):
                await client.connect(ipv6)


async def test_concurrent_large_replies_do_not_deadlock() -> None:
    """Frames over large_frame_bytes take turns; streams waiting for their turn must not starve
    the one assembling (shared connection window, shared send budget)."""
    config = TransportConfig(
        stream_window_bytes=256 << 10,
        connection_window_bytes=1 << 20,
        send_buffer_bytes=1 << 20,
        large_frame_bytes=64 << 10,
    )
    handlers = Handlers()

    @handlers.unary("blob")
    async def blob(request: dict, call: ServerCall) -> dict:
        return {"blob": bytes([request["i"]]) * (3 << 20)}

    with trio.fail_after(DEADLINE_S):
        async with (
            open_node(config=config) as server,
            open_node(config=config) as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, server, handlers)
            connection = await client.connect(server.listen_multiaddr)
            sizes: dict[int, int] = {}

            async def fetch(index: int) -> None:
                reply = await call_unary(connection, "blob", {"i": index})
                assert set(reply["blob"]) == {index}
                sizes[index] = len(reply["blob"])

            async with trio.open_nursery() as fetchers:
                for index in range(6):
                    fetchers.start_soon(fetch, index)
            assert sizes == {index: 3 << 20 for index in range(6)}
            nursery.cancel_scope.cancel()


async def test_cancelled_open_stream_and_connect_leak_nothing() -> None:
    config = TransportConfig(max_incoming_streams=4)
    with trio.fail_after(DEADLINE_S):
        async with server_and_client(config) as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            for _ in range(10):
                with trio.move_on_after(0):
                    await connection.open_stream()
            assert connection._streams == {}
            replies = [await call_unary(connection, "echo", {"i": i}) for i in range(8)]
            assert [r["echo"]["i"] for r in replies] == list(range(8))
            for _ in range(5):
                with trio.CancelScope() as scope:
                    # Cancel the dial right after it started, before any handshake finished.
                    scope.deadline = trio.current_time()
                    await client.connect(str(server.listen_multiaddr).split("/p2p/")[0])
            assert client.statistics().connections == 1


async def test_stopping_serve_rpc_ends_calls_in_flight() -> None:
    events = {"hang_started": trio.Event(), "hang_cancelled": trio.Event()}
    failures: list[BaseException] = []

    async def caller(connection: Connection) -> None:
        try:
            await call_unary(connection, "hang", {})
        except StreamReset as exc:
            failures.append(exc)

    with trio.fail_after(DEADLINE_S):
        async with open_node() as server, open_node() as client:
            async with trio.open_nursery() as calling, trio.open_nursery() as serving:
                await serving.start(serve_rpc, server, _handlers(events))
                connection = await client.connect(server.listen_multiaddr)
                calling.start_soon(caller, connection)
                await events["hang_started"].wait()
                serving.cancel_scope.cancel()
                # serve_rpc is gone: the caller must learn it, not wait forever.
            assert len(failures) == 1
            assert events["hang_cancelled"].is_set()


async def test_a_raising_stream_handler_costs_one_stream_not_the_node() -> None:
    def broken(stream: Stream) -> None:
        raise KeyError("bug in the application's handler")

    with trio.fail_after(DEADLINE_S):
        async with open_node() as server, open_node() as client:
            server.set_stream_handler(broken)
            connection = await client.connect(server.listen_multiaddr)
            stream = await connection.open_stream()
            await stream.send_all(b"hello")
            with pytest.raises(StreamReset):
                await stream.receive_some()
            # The server node is still up.
            other = await client.connect(server.listen_multiaddr)
            assert other is connection and not connection.is_closed


async def test_block_error_survives_a_cancelled_scope() -> None:
    async def fail_inside_a_cancelled_scope() -> None:
        with trio.CancelScope() as scope:
            scope.cancel()
            async with open_node():
                raise ValueError("from the block")

    with pytest.raises(ValueError, match="from the block"):
        await fail_inside_a_cancelled_scope()


async def test_receive_some_refuses_a_zero_size() -> None:
    with trio.fail_after(DEADLINE_S):
        async with server_and_client() as (server, client, _):
            connection = await client.connect(server.listen_multiaddr)
            stream = await connection.open_stream()
            with pytest.raises(ValueError, match="max_bytes"):
                await stream.receive_some(0)
            stream.reset()


async def test_the_last_message_can_end_the_callers_side() -> None:
    """A callee that answers the first message and returns at once (the RPC layer then stops
    reading the stream): a caller that ended its side with that message gets the answer."""
    answered = trio.Event()
    handlers = Handlers()

    @handlers.stream("first")
    async def first(call: ServerCall) -> None:
        message = await call.receive()
        await call.send({"got": message["x"]})
        answered.set()

    with trio.fail_after(DEADLINE_S):
        async with (
            open_node() as server,
            open_node() as client,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, server, handlers)
            connection = await client.connect(server.listen_multiaddr)
            for x in range(3):
                async with open_call(connection, "first") as call:
                    await call.send({"x": x}, eof=True)
                    await answered.wait()
                    assert await call.receive() == {"got": x}
                    assert [m async for m in call] == []
                answered = trio.Event()
            nursery.cancel_scope.cancel()
