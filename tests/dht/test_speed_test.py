"""``dht.speed_test``: how fast bytes move between peers, and what a node refuses to serve."""

from __future__ import annotations

import math

import pytest
import trio

from petals_core import RemoteError
from petals_core.dht import MAX_SPEED_TEST_BYTES, SPEED_TEST, BandwidthReport, measure_bandwidth
from petals_core.dht._node import open_dht_node
from petals_core.dht._speed_test import _MIN_MEASURED_BYTES
from petals_core.transport import (
    Connection,
    Handlers,
    Multiaddr,
    ServerCall,
    call_unary,
    open_call,
    open_node,
    serve_rpc,
)

from ._swarm import holding_speed_tests

DEADLINE_S = 60


async def test_a_speed_test_measures_both_ways_on_loopback() -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1") as helper,
            open_dht_node(host="127.0.0.1", initial_peers=[str(helper.listen_multiaddr)]) as us,
        ):
            # Ourselves and unparsable or relayed addresses are skipped.
            via = [
                str(us.listen_multiaddr),
                "not a multiaddr",
                str(helper.listen_multiaddr.relayed(us.peer_id)),
                str(helper.listen_multiaddr),
            ]
            report = await measure_bandwidth(us.node, via, timeout_s=DEADLINE_S / 2)
            (result,) = report.results
            assert result.peer == str(helper.listen_multiaddr) and result.error is None
            up, down = report.upload_bits_per_s, report.download_bits_per_s
            assert up is not None and down is not None
            for rate in (up, down):
                assert math.isfinite(rate) and rate > 0
            assert report.bits_per_s == min(up, down)
            assert report.peers_measured == 1


async def _refusal(connection: Connection, *messages: object) -> str:
    """Why the node refuses a speed test call of ``messages`` (then end of stream)."""
    replies: list[dict] = []
    async with open_call(connection, SPEED_TEST) as call:
        for message in messages:
            await call.send(message)  # type: ignore[arg-type]
        await call.send_eof()
        try:
            async for reply in call:
                replies.append(reply)
        except RemoteError as refused:
            # At most its start, and receipts, came before the refusal.
            assert all(r == {"ready": True} or "received" in r for r in replies)
            return str(refused)
    raise AssertionError(f"not refused: {replies}")


async def test_hostile_speed_tests_are_refused_and_the_node_keeps_serving() -> None:
    too_many = MAX_SPEED_TEST_BYTES + 1
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1") as helper,
            open_dht_node(host="127.0.0.1", client_mode=True) as caller,
        ):
            connection = await caller.node.connect(helper.listen_multiaddr)
            for request, reason in [
                (
                    {"download": too_many},
                    f"moves 1 to {MAX_SPEED_TEST_BYTES} bytes, not {too_many}",
                ),
                ({"upload": 1 << 30}, f"moves 1 to {MAX_SPEED_TEST_BYTES} bytes"),
                ({"upload": 0}, "moves 1 to"),
                ({"download": "lots"}, "is a byte count, not 'lots'"),
                ({"download": True}, "is a byte count"),
                ({}, "exactly one of 'upload' and 'download'"),
                ({"upload": 10, "download": 10}, "exactly one of"),
                ({"download": 10, "also": 1}, "exactly one of"),
            ]:
                assert reason in await _refusal(connection, request)
            assert "starts with its request" in await _refusal(connection)
            # An upload must send what it announced, in byte chunks of bounded size, no more.
            big = bytes(256 << 10 | 1)
            for messages, reason in [
                ([{"upload": 10}, {"data": "text"}], "in {'data': bytes} messages of 1 to"),
                ([{"upload": 10}, {"data": b""}], "messages of 1 to"),
                ([{"upload": len(big)}, {"data": big}], "messages of 1 to 262144 bytes"),
                ([{"upload": 10}, {"data": bytes(11)}], "more than the 10 bytes announced"),
                ([{"upload": 10}, {"data": bytes(4)}], "ended after 4 of the 10 bytes"),
            ]:
                assert reason in await _refusal(connection, *messages)
            # Only so many at once: the next is refused at once, not queued.
            async with holding_speed_tests(helper.listen_multiaddr):
                assert "busy with 2 other speed tests" in await _refusal(
                    connection, {"download": 10}
                )
            # The node still answers, speed tests included.
            assert "peer_id" in await call_unary(connection, "dht.ping", {"client": True})
            report = await measure_bandwidth(
                caller.node, [str(helper.listen_multiaddr)], timeout_s=DEADLINE_S / 2
            )
            assert report.bits_per_s is not None and report.bits_per_s > 0


async def test_a_speed_test_that_stalls_is_ended_by_the_node() -> None:
    with trio.fail_after(DEADLINE_S):
        async with (
            open_dht_node(host="127.0.0.1", request_timeout_s=0.5) as helper,
            open_dht_node(host="127.0.0.1", client_mode=True) as caller,
        ):
            connection = await caller.node.connect(helper.listen_multiaddr)
            async with open_call(connection, SPEED_TEST) as call:
                await call.send({"upload": 10})
                assert await call.receive() == {"ready": True}
                with pytest.raises(RemoteError, match=r"did not finish within 0.5 s"):
                    await call.receive()


async def test_peers_that_cannot_tell_a_rate_give_none(silent_port: int) -> None:
    """A silent peer, one without the method, one forging upload receipts, and a test too
    small to tell: no rate, each with why, within the deadline."""
    forger = Handlers()

    @forger.stream(SPEED_TEST)
    async def forged(call: ServerCall) -> None:
        request = await call.receive()
        await call.send({"ready": True})
        if "upload" in request:
            # Receipt for all of it before anything arrived, then reading on.
            await call.send({"received": request["upload"], "sha256": bytes(32)})
            async for _ in call:
                pass

    without = Handlers()

    @without.unary("dht.ping")
    async def ping(request: dict, call: ServerCall) -> dict:
        return {"peer_id": str(call.peer_id)}

    with trio.fail_after(DEADLINE_S):
        async with (
            open_node() as forging,
            open_node() as lacking,
            open_dht_node(host="127.0.0.1") as helper,
            open_dht_node(host="127.0.0.1", client_mode=True) as us,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_rpc, forging, forger)
            await nursery.start(serve_rpc, lacking, without)
            silent = Multiaddr("127.0.0.1", silent_port).with_peer_id(helper.peer_id)
            via = [str(silent), str(lacking.listen_multiaddr), str(forging.listen_multiaddr)]
            began = trio.current_time()
            report = await measure_bandwidth(us.node, via, timeout_s=3)
            assert trio.current_time() - began < 3 + 1  # the deadline, and a margin
            assert report.bits_per_s is None and report.peers_measured == 0
            quiet, missing, forging_result = report.results
            assert quiet.error is not None and missing.error is not None
            assert "UnknownMethod: no method 'dht.speed_test'" in missing.error
            assert forging_result.error == (
                "CodecError: a speed test receipt names bytes we did not send"
            )
            assert forging_result.upload_bits_per_s is None
            small = await measure_bandwidth(
                us.node, [str(helper.listen_multiaddr)], timeout_s=DEADLINE_S / 2, nbytes=1000
            )
            (result,) = small.results
            assert result.error == (
                f"upload and download: fewer than {_MIN_MEASURED_BYTES} bytes moved in time"
            )
            assert small == BandwidthReport(small.results) and small.bits_per_s is None
            nursery.cancel_scope.cancel()
