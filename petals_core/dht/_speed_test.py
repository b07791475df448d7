"""How fast bytes move between us and peers: ``dht.speed_test``, served by every DHT node.

A speed test is a streaming call in one direction:

- ``{"upload": n}``: the callee answers ``{"ready": true}``, then reads ``n`` bytes in
  ``{"data": bytes}`` messages, and after every :data:`_PROGRESS_BYTES` (and at the end) says
  ``{"received": count, "sha256": digest of the bytes so far}``.  The caller sends random bytes
  and checks the digest: a callee cannot claim bytes it never got, so an upload rate is never
  higher than what the path carried.
- ``{"download": n}``: the callee answers ``{"ready": true}`` and sends ``n`` bytes in
  ``{"data": bytes}`` messages.  The caller counts what arrives.

The callee guards itself: at most :data:`MAX_SPEED_TEST_BYTES` per call, chunks of at most
:data:`_MAX_CHUNK_BYTES`, :data:`_SPEED_TESTS_AT_ONCE` calls at a time (more are refused at
once, not queued), each within its request timeout, and only over direct connections (a test
through a relay would load the relay and measure its link).  A malformed or oversized request
is refused with the reason; the node goes on serving.

:func:`measure_bandwidth` tests a few peers in turn within one deadline: each peer gets an
equal share of what is left, half for each direction.  A direction cut short by its deadline
still counts what moved by then (with at least :data:`_MIN_MEASURED_BYTES`), so a slow link is
measured slowly rather than not at all.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Iterable, Sequence
from typing import Final

import attrs
import trio

from .._errors import CallEnded, CodecError, ConfigError, ServerError, TransportError
from ..transport import Call, Connection, Multiaddr, Node, ServerCall, open_call
from ._reachability import direct_peers

__all__ = [
    "MAX_SPEED_TEST_BYTES",
    "SPEED_TEST",
    "BandwidthReport",
    "SpeedTest",
    "SpeedTestResult",
    "measure_bandwidth",
]

logger = logging.getLogger(__name__)

#: The RPC a DHT node serves for others' speed tests.
SPEED_TEST = "dht.speed_test"
#: The most bytes one speed test call moves (either way).
MAX_SPEED_TEST_BYTES: Final = 4 << 20
#: Speed tests a node serves at once; more are refused.
_SPEED_TESTS_AT_ONCE: Final = 2
#: The bytes of one ``data`` message we send, and the most we accept in one.
_CHUNK_BYTES: Final = 64 << 10
_MAX_CHUNK_BYTES: Final = 256 << 10
#: How often a callee reports what it received of an upload.
_PROGRESS_BYTES: Final = 256 << 10
#: Fewer bytes than this say nothing about a rate (one congestion window moves them at once).
_MIN_MEASURED_BYTES: Final = 256 << 10
#: Peers :func:`measure_bandwidth` tests.
_SPEED_TEST_PEERS: Final = 3
_ZEROS: Final = bytes(_CHUNK_BYTES)


def _request_untrusted(message: object) -> tuple[str, int]:
    """``("upload" | "download", bytes)`` from a speed test's first message."""
    if not isinstance(message, dict):
        raise CodecError("a speed test request is a map")
    directions = [key for key in ("upload", "download") if key in message]
    if len(directions) != 1 or len(message) != 1:
        raise CodecError(
            "a speed test request carries exactly one of 'upload' and 'download' (a byte count)"
        )
    direction = directions[0]
    nbytes = message[direction]
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise CodecError(f"a speed test's {direction!r} is a byte count, not {nbytes!r}")
    if not 1 <= nbytes <= MAX_SPEED_TEST_BYTES:
        raise CodecError(
            f"a speed test moves 1 to {MAX_SPEED_TEST_BYTES} bytes, not {nbytes} "
            f"(asked to {direction})"
        )
    return direction, nbytes


def _data_untrusted(message: object) -> bytes:
    data = message.get("data") if isinstance(message, dict) else None
    if not isinstance(data, bytes) or not 1 <= len(data) <= _MAX_CHUNK_BYTES:
        raise CodecError(
            f"an upload is sent in {{'data': bytes}} messages of 1 to {_MAX_CHUNK_BYTES} bytes"
        )
    return data


@attrs.define(eq=False)
class SpeedTest:
    """The ``dht.speed_test`` handler of a node: each call within ``timeout_s``."""

    timeout_s: float
    _limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(_SPEED_TESTS_AT_ONCE)
    )

    async def __call__(self, call: ServerCall) -> None:
        if call.connection.relay is not None:
            raise CodecError("a speed test runs over a direct connection, not through a relay")
        with trio.move_on_after(self.timeout_s):
            try:
                request = await call.receive()
            except CallEnded:
                raise CodecError("a speed test starts with its request") from None
            direction, nbytes = _request_untrusted(request)
            if self._limiter.borrowed_tokens >= self._limiter.total_tokens:
                raise ServerError(
                    f"busy with {_SPEED_TESTS_AT_ONCE} other speed tests; ask again later"
                )
            async with self._limiter:
                await call.send({"ready": True})
                if direction == "upload":
                    await self._receive(call, nbytes)
                else:
                    await _send_bytes(call, nbytes)
                return
        raise ServerError(f"the speed test did not finish within {self.timeout_s:g} s")

    @staticmethod
    async def _receive(call: ServerCall, nbytes: int) -> None:
        digest = hashlib.sha256()
        received = 0
        reported = 0
        while received < nbytes:
            try:
                data = _data_untrusted(await call.receive())
            except CallEnded:
                raise CodecError(
                    f"the upload ended after {received} of the {nbytes} bytes announced"
                ) from None
            if received + len(data) > nbytes:
                raise CodecError(f"the upload sent more than the {nbytes} bytes announced")
            digest.update(data)
            received += len(data)
            if received - reported >= _PROGRESS_BYTES or received == nbytes:
                reported = received
                await call.send({"received": received, "sha256": digest.copy().digest()})


async def _send_bytes(call: ServerCall, nbytes: int) -> None:
    sent = 0
    while sent < nbytes:
        size = min(_CHUNK_BYTES, nbytes - sent)
        await call.send({"data": _ZEROS[:size]})
        sent += size


@attrs.frozen(kw_only=True)
class SpeedTestResult:
    """One peer's test: the rates in bits per second (None: not measured) and what failed."""

    peer: str
    upload_bits_per_s: float | None = None
    download_bits_per_s: float | None = None
    error: str | None = None


@attrs.frozen
class BandwidthReport:
    """What :func:`measure_bandwidth` found, one result per peer tested."""

    results: tuple[SpeedTestResult, ...] = ()

    @property
    def upload_bits_per_s(self) -> float | None:
        """The best upload rate any peer measured (None: none did)."""
        return _best(r.upload_bits_per_s for r in self.results)

    @property
    def download_bits_per_s(self) -> float | None:
        """The best download rate any peer measured (None: none did)."""
        return _best(r.download_bits_per_s for r in self.results)

    @property
    def bits_per_s(self) -> float | None:
        """Our bandwidth: the lesser of the best upload and the best download rates (None
        unless both were measured).

        The best, not the median: every rate is a lower bound of our link's (a peer's own
        link, a busy path or a short test only slow it down, and neither direction can be
        faked faster: uploads are proven by digest, downloads counted here), so the best is the
        closest.  The lesser direction: a server receives a hidden state and sends one of the
        same size for every token, so the slower way bounds it."""
        up, down = self.upload_bits_per_s, self.download_bits_per_s
        return None if up is None or down is None else min(up, down)

    @property
    def peers_measured(self) -> int:
        """Peers that gave a rate, either way."""
        return sum(
            r.upload_bits_per_s is not None or r.download_bits_per_s is not None
            for r in self.results
        )


def _best(rates: Iterable[float | None]) -> float | None:
    measured = [rate for rate in rates if rate is not None]
    return max(measured) if measured else None


async def measure_bandwidth(
    node: Node,
    via: Sequence[str],
    *,
    timeout_s: float,
    nbytes: int = MAX_SPEED_TEST_BYTES,
    peers: int = _SPEED_TEST_PEERS,
) -> BandwidthReport:
    """Speed-test the first ``peers`` of ``via`` (multiaddrs; relayed ones, our own and
    unparsable ones skipped) in turn, ``nbytes`` each way, all within ``timeout_s``: see the
    module.  Never raises for a peer's failure: its result says what went wrong."""
    if not 1 <= nbytes <= MAX_SPEED_TEST_BYTES:
        raise ConfigError(f"a speed test moves 1 to {MAX_SPEED_TEST_BYTES} bytes, not {nbytes}")
    chosen: list[Multiaddr] = []
    for peer in direct_peers(via):
        if peer.peer_id is None or not (
            peer.peer_id == node.peer_id or any(peer.peer_id == c.peer_id for c in chosen)
        ):
            chosen.append(peer)
    chosen = chosen[:peers]
    deadline = trio.current_time() + timeout_s
    results = []
    for index, peer in enumerate(chosen):
        share = (deadline - trio.current_time()) / (len(chosen) - index)
        if share <= 0:
            break
        results.append(await _test_peer(node, peer, nbytes=nbytes, timeout_s=share))
    report = BandwidthReport(tuple(results))
    logger.debug("speed tests: %s", report)
    return report


async def _test_peer(
    node: Node, peer: Multiaddr, *, nbytes: int, timeout_s: float
) -> SpeedTestResult:
    """Upload then download ``nbytes`` to ``peer`` within ``timeout_s``, half for each way."""
    began = trio.current_time()
    upload, download = _Progress(), _Progress()
    error: str | None = None
    try:
        with trio.fail_after(timeout_s):
            connection = await node.connect(peer)
        with trio.move_on_at(began + timeout_s / 2):
            await _upload(connection, nbytes, upload)
        with trio.move_on_at(began + timeout_s):
            await _download(connection, nbytes, download)
    except trio.TooSlowError:
        error = f"no connection within {timeout_s:.1f} s"
    except TransportError as exc:
        error = f"{type(exc).__name__}: {exc}"
        logger.debug("speed test with %s failed: %s", peer, error)
    else:
        slow = [way for way, p in (("upload", upload), ("download", download)) if p.rate is None]
        if slow:
            error = f"{' and '.join(slow)}: fewer than {_MIN_MEASURED_BYTES} bytes moved in time"
    return SpeedTestResult(
        peer=str(peer),
        upload_bits_per_s=upload.rate,
        download_bits_per_s=download.rate,
        error=error,
    )


@attrs.define
class _Progress:
    """How far one way of a test got: bytes known to have arrived, and when."""

    #: When the bytes began to move, and the round trip the first byte and the last receipt
    #: add to the time taken (an upload's; 0 for a download, counted where it arrives).
    began: float = math.nan
    round_trip: float = 0.0
    at: float = math.nan
    nbytes: int = 0

    def count(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.at = trio.current_time()

    @property
    def rate(self) -> float | None:
        """Bits per second (None: too few bytes to tell)."""
        elapsed = self.at - self.began
        if self.nbytes < _MIN_MEASURED_BYTES or not elapsed > 0:
            return None
        # The round trip measured (with the call's opening) may exceed the true one: never
        # more than half the elapsed time is taken off (a rate at most twice the raw one).
        rate = self.nbytes * 8 / max(elapsed - self.round_trip, elapsed / 2)
        return rate if math.isfinite(rate) else None


async def _ready(call: Call) -> None:
    reply = await call.receive()
    if reply != {"ready": True}:
        raise CodecError(f"a speed test starts with {{'ready': true}}, not {reply!r}")


async def _upload(connection: Connection, nbytes: int, progress: _Progress) -> None:
    """Upload ``nbytes`` random bytes, counting what the callee's receipts prove it received
    (when the caller's deadline cuts it short too)."""
    data = os.urandom(nbytes)
    proven = hashlib.sha256()
    asked = trio.current_time()
    async with open_call(connection, SPEED_TEST) as call:
        await call.send({"upload": nbytes})
        await _ready(call)
        progress.began = trio.current_time()
        progress.round_trip = progress.began - asked

        # Queued at once (the send buffer holds more than a test moves), so that receipts are
        # read, and timed, as they come.
        for offset in range(0, nbytes, _CHUNK_BYTES):
            await call.send({"data": data[offset : offset + _CHUNK_BYTES]})
        while progress.nbytes < nbytes:
            reply = await call.receive()
            received, digest = reply.get("received"), reply.get("sha256")
            if not (isinstance(received, int) and progress.nbytes < received <= nbytes):
                raise CodecError(f"a speed test receipt counts no new bytes: {reply!r}")
            proven.update(data[progress.nbytes : received])
            if digest != proven.copy().digest():
                raise CodecError("a speed test receipt names bytes we did not send")
            progress.count(received)


async def _download(connection: Connection, nbytes: int, progress: _Progress) -> None:
    """Download ``nbytes``, counting what arrives (when the caller's deadline cuts it short
    too)."""
    async with open_call(connection, SPEED_TEST) as call:
        await call.send({"download": nbytes}, eof=True)
        await _ready(call)
        progress.began = trio.current_time()
        received = 0
        async for message in call:
            received += len(_data_untrusted(message))
            if received > nbytes:
                raise CodecError(f"the speed test sent more than the {nbytes} bytes asked")
            progress.count(received)
