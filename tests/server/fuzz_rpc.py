"""Hostile-input fuzzing of the block RPCs: hypothesis drives every RPC of a real server.

One in-process server (the tiny LLaMA of ``conftest.server_llama``, blocks 0:6, a small attention
cache) runs in a trio loop on a background thread, next to one raw client node.  Hypothesis runs
in the calling thread and sends each example into that loop with ``trio.from_thread.run``.  Each
example opens fresh calls and sends something hostile (raw bytes, malformed frames, refused
openings, bad steps, bad tensor transfers, duplicate sessions, abandoned streams...).

What must hold for every example (a failure is shrunk by hypothesis to a minimal input):

- every call ends within :data:`EXAMPLE_TIMEOUT_S` (never a hang);
- a refused call ends with an error frame (``RemoteError``) whose type is one of
  :data:`CLEAR_ERRORS` -- never a stray ``KeyError``/``IndexError``, never a bare reset -- and the
  server logs no error (a handler crash is logged by the transport);
- where the input is valid by the documented protocol the call succeeds and the reply has the
  right shape (NaN and infinite values are valid: they are computed, and only their own session
  sees them);
- afterwards the cache budget is back at its baseline and only the canary session is open; the
  canary, a session opened once at the start, returns exactly (bit for bit) its first result for
  the same step (rolled back with ``start_from_position`` so that its cached positions are read,
  not recomputed): no example touched another session's cache.  Steps of examples also run
  concurrently with a canary step (so that they may share a batch), checked within 1e-5.

:func:`run_fuzz` runs it at any size and returns a :class:`FuzzReport` (outcome counts and the
process RSS before and after).
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, Protocol

import attrs
import cbor2
import hypothesis
import torch
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from petals_core import RemoteError
from petals_core.protocol import BACKWARD, FORWARD, INFERENCE, INFO
from petals_core.server import Server, ServingLimits
from petals_core.transport import (
    CodecLimits,
    Connection,
    FrameDecoder,
    Stream,
    StreamReset,
    TransportError,
    decode_message_untrusted,
    encode_frame,
)

from ..models.conftest import TinyCheckpoint
from ._client import connect, serve

__all__ = ["CLEAR_ERRORS", "FuzzReport", "cases", "run_fuzz"]

HIDDEN: Final = 64
BLOCKS: Final = (0, 6)
#: Cache positions per block: small, so that large openings are refused at once.
ATTN_CACHE_TOKENS: Final = 4096
LIMITS: Final = ServingLimits(
    step_timeout_s=2.0,
    max_sessions_per_peer=8,
    # Small, so that steps of a few tokens already go in several chunks (and the largest
    # batch_size, 8, is cheap to allocate).
    max_batch_tokens=8,
    # A valid opening that does not fit now waits at most this long (keeps examples short).
    max_alloc_timeout_s=0.5,
    request_timeout_s=10.0,
)
#: Examples per hypothesis run (see :func:`run_fuzz`).
CHUNK_EXAMPLES: Final = 500
#: Generous for a slow shared machine; only turns a hang into a failure.
EXAMPLE_TIMEOUT_S: Final = 30.0
#: What a refusal may be reported as: each names the fault.
CLEAR_ERRORS: Final = frozenset(
    {
        "ServerError",
        "AllocationFailed",
        "AdapterError",
        "CodecError",
        "ProtocolError",
        "RemoteProtocolError",
        "UnknownMethod",
        "CallEnded",
    }
)
_TENSOR_TAG: Final = 42_000
_WIRE_LIMITS: Final = CodecLimits(max_frame_bytes=128 << 20)
_MAX_FRAME_BYTES: Final = _WIRE_LIMITS.max_frame_bytes
FLOAT_DTYPES: Final = ("float32", "float16", "bfloat16")
INT_DTYPES: Final = ("int64", "int32", "int8", "uint8")
WIRE_DTYPES: Final = (*FLOAT_DTYPES, *INT_DTYPES, "bool")
FLOAT_FILLS: Final = ("randn", "zeros", "nan", "inf", "ninf", "huge", "mixed")
INT_FILLS: Final = ("ints", "zeros", "neg", "max")
CANARY_ID: Final = "canary"
#: Cache positions x blocks the canary session holds (max_length 16 over blocks 0:6).
CANARY_TOKENS: Final = 16 * 6
_MISSING: Final = "<missing>"


# -- what an example is made of --------------------------------------------------------------------


@attrs.frozen
class TensorSpec:
    """A tensor described by dtype, shape and fill (built when sent; prints short when shrunk)."""

    dtype: str
    shape: tuple[int, ...]
    fill: str = "randn"

    def build(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1234)
        numel = math.prod(self.shape)
        dtype = getattr(torch, self.dtype)
        if dtype.is_floating_point:
            base = torch.randn(numel, generator=generator)
            special = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "zeros": 0.0}
            if self.fill in special:
                base.fill_(special[self.fill])
            elif self.fill == "huge":
                base.mul_(1e30)
            elif self.fill == "mixed":
                base[::3] = math.nan
                base[1::3] = math.inf
            tensor = base.to(dtype)
        elif dtype == torch.bool:
            tensor = (torch.arange(numel) % 2).bool()
        else:
            info = torch.iinfo(dtype)
            values = torch.arange(numel) % 3
            if self.fill == "zeros":
                values.zero_()
            elif self.fill == "neg":
                values = -values - 1
            elif self.fill == "max":
                values.fill_(info.max)
            tensor = values.clamp(info.min, info.max).to(dtype)
        return tensor.view(self.shape)


@attrs.frozen
class RawTag:
    """A tensor tag written by hand: any dtype name, any shape, any number of data bytes."""

    dtype: str
    shape: tuple[int, ...]
    data_bytes: int

    def cbor(self) -> cbor2.CBORTag:
        return cbor2.CBORTag(_TENSOR_TAG, [self.dtype, list(self.shape), bytes(self.data_bytes)])


def _value(value: Any) -> Any:
    """What goes on the wire for a field of an example."""
    if isinstance(value, TensorSpec):
        return value.build()
    if isinstance(value, RawTag):
        return value.cbor()
    if isinstance(value, dict):
        return {k: _value(v) for k, v in value.items() if v != _MISSING}
    if isinstance(value, list | tuple):
        return [_value(v) for v in value]
    return value


def _frame(envelope: Mapping[str, Any]) -> bytes:
    """One frame holding ``envelope``; raw tensor tags are written by hand (cbor2), the rest
    through the real codec."""
    plain = _value(envelope)
    if _has_raw_tag(plain):
        payload = cbor2.dumps(plain, default=_tensor_tag)
        return len(payload).to_bytes(4, "big") + payload
    return encode_frame(plain, limits=_WIRE_LIMITS)


def _tensor_tag(encoder: cbor2.CBOREncoder, value: Any) -> None:
    """A torch tensor next to hand-written tags, in the codec's layout."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"cannot encode {type(value).__name__}")
    data = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    dtype = str(value.dtype).removeprefix("torch.")
    encoder.encode(cbor2.CBORTag(_TENSOR_TAG, [dtype, list(value.shape), data]))


def _has_raw_tag(value: Any) -> bool:
    if isinstance(value, cbor2.CBORTag):
        return True
    if isinstance(value, dict):
        return any(_has_raw_tag(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_raw_tag(v) for v in value)
    return False


class FuzzFailure(AssertionError):
    """An invariant of the fuzzing broke (hypothesis shrinks the example that broke it)."""


# -- a raw client call -----------------------------------------------------------------------------


class _RawCall:
    """One stream with the RPC framing written by hand, so that anything can be sent."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(_WIRE_LIMITS)
        self.send_refused = False
        self.opened_at = self._idle_since = trio.current_time()
        #: The longest the server waited on us for a message: only that long an idle gap may
        #: end a session for its step timeout (on a loaded machine the client can be slow).
        self.max_idle_s = 0.0

    @classmethod
    async def open(cls, connection: Connection, method: str | None) -> _RawCall:
        call = cls(await connection.open_stream())
        if method is not None:
            await call.send_bytes(_frame({"call": method}))
        return call

    async def send_bytes(self, data: bytes, *, eof: bool = False) -> bool:
        """False once the server stopped reading (it refused the call: its error is waiting)."""
        if self.send_refused:
            return False
        self.max_idle_s = max(self.max_idle_s, trio.current_time() - self._idle_since)
        try:
            await self.stream.send_all(data, eof=eof)
        except TransportError:
            self.send_refused = True
            return False
        return True

    async def send(self, message: Mapping[str, Any], *, eof: bool = False) -> bool:
        return await self.send_bytes(_frame({"msg": message}), eof=eof)

    async def send_eof(self) -> None:
        if not self.send_refused:
            try:
                await self.stream.send_eof()
            except TransportError:
                self.send_refused = True

    async def receive(self) -> dict[str, Any] | None:
        """The next message; None once the server ended the call cleanly; raises RemoteError
        for an error frame and StreamReset if the server reset the stream."""
        while True:
            frame = self._decoder.next_frame()
            if frame is not None:
                self._idle_since = trio.current_time()
                envelope = decode_message_untrusted(frame, limits=_WIRE_LIMITS)
                if isinstance(envelope.get("msg"), dict):
                    message: dict[str, Any] = envelope["msg"]
                    return message
                error = envelope.get("err")
                if isinstance(error, dict):
                    raise RemoteError(str(error.get("type")), str(error.get("message")))
                raise FuzzFailure(f"the server sent neither a message nor an error: {envelope!r}")
            data = await self.stream.receive_some()
            if not data:
                if self._decoder.buffered_bytes:
                    raise FuzzFailure("the server ended the stream inside a frame")
                return None
            self._decoder.feed(data)

    async def finish(self) -> list[dict[str, Any]]:
        """Every message up to the server's end of the call (raises as :meth:`receive`)."""
        messages = []
        while (message := await self.receive()) is not None:
            messages.append(message)
        return messages

    def abandon(self) -> None:
        self.stream.reset()

    async def close(self) -> None:
        await self.stream.aclose()


def _refusal(exc: RemoteError, call: _RawCall) -> str:
    """The outcome of a refused call; raises for unclear refusals and unjustified timeouts.

    A session closed for its step timeout, or a request for its request timeout, is a
    refusal named ``"refused:timeout"``: valid input may get it when this machine is too slow
    to feed the session in time, but only if the client really was that slow.
    """
    if exc.remote_type not in CLEAR_ERRORS:
        raise FuzzFailure(
            f"unclear refusal {exc.remote_type}: {exc.remote_message}"
            " (a handler crashed instead of refusing the input)"
        )
    if exc.remote_type == "ServerError" and "step timeout" in exc.remote_message:
        _expect(
            call.max_idle_s >= LIMITS.step_timeout_s / 2,
            f"{exc} though every message came within {call.max_idle_s:.2f} s",
        )
        return "refused:timeout"
    if exc.remote_type == "ServerError" and "request timeout" in exc.remote_message:
        elapsed_s = trio.current_time() - call.opened_at
        _expect(elapsed_s >= LIMITS.request_timeout_s / 2, f"{exc} after {elapsed_s:.2f} s")
        return "refused:timeout"
    return f"refused:{exc.remote_type}"


async def _expect_end(call: _RawCall) -> str:
    """Read the server's answer to a call we gave up sending on; must be an error or an end."""
    try:
        extra = await call.finish()
    except RemoteError as exc:
        return _refusal(exc, call)
    except StreamReset as exc:
        raise FuzzFailure(f"the server reset the call instead of answering: {exc}") from exc
    finally:
        await call.close()
    return "ok" if extra else "closed"


# -- the harness (runs in the server's trio loop) --------------------------------------------------


class Harness:
    """The server, the client connection and the canary session; checks after each example."""

    def __init__(self, server: Server, connection: Connection) -> None:
        self.server = server
        self.connection = connection
        self.stop = trio.Event()
        self.errors_logged: list[logging.LogRecord] = []
        self._canary: _RawCall | None = None
        self._calls: list[_RawCall] = []
        self._canary_broken = False
        #: How often the canary was reopened (it timed out on a slow machine, or an example
        #: failed during its step).
        self.canary_reopened = 0
        self._canary_step = {
            "hidden_states": torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(7)),
            "start_from_position": 4,
        }
        self._canary_expected: torch.Tensor | None = None
        self.baseline_tokens = 0

    async def open_canary(self) -> None:
        """Open the canary (no other session may be open) and take its reference output."""
        call = await _RawCall.open(self.connection, INFERENCE)
        await call.send(
            {"session_id": CANARY_ID, "blocks": list(BLOCKS), "max_length": 16, "batch_size": 1}
        )
        if await call.receive() != {"ready": True, "position": 0}:
            raise FuzzFailure("the canary session did not open")
        prefix = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(6))
        await call.send({"hidden_states": prefix})
        await call.receive()
        self._canary = call
        expected = await self._canary_output()
        if expected is None:
            raise FuzzFailure("the canary session timed out as it opened")
        # A reopened canary computes what the first one did.
        if self._canary_expected is not None and not torch.equal(expected, self._canary_expected):
            raise FuzzFailure("a new canary session computes other outputs than the first")
        self._canary_expected = expected
        self.baseline_tokens = self.server.block_server.cache_tokens_left

    async def _reopen_canary(self) -> None:
        """After the canary timed out, or an example failed during a canary step (its stream
        may hold half a message); every example call is over by then."""
        assert self._canary is not None
        self._canary.abandon()
        self.canary_reopened += 1
        while self.server.block_server.open_sessions:  # noqa: ASYNC110 (see check_clean)
            await trio.sleep(0.005)
        await self.open_canary()

    async def close_canary(self) -> None:
        if self._canary is not None and not self._canary_broken:
            await self._canary.send_eof()
            await self._canary.finish()
            await self._canary.close()

    async def _canary_output(self) -> torch.Tensor | None:
        """The canary's output for its step; None if the server had closed it for its step
        timeout (this machine was too slow to feed it in time; it is reopened before the next
        check)."""
        call = self._canary
        assert call is not None
        self._canary_broken = True  # until its answer is in
        await call.send(self._canary_step)
        try:
            reply = await call.receive()
        except RemoteError as exc:
            if _refusal(exc, call) == "refused:timeout":
                return None
            raise FuzzFailure(f"the canary session was ended: {exc}") from exc
        if reply is None or reply.get("position") != 6:
            raise FuzzFailure(f"the canary answered {reply!r}")
        self._canary_broken = False
        output: torch.Tensor = reply["hidden_states"]
        return output

    async def check_canary(self, *, exact: bool) -> bool:
        """Whether the canary answered (and then: its output is unchanged, or raises)."""
        output = await self._canary_output()
        if output is None:
            return False
        assert self._canary_expected is not None
        if exact:
            if not torch.equal(output, self._canary_expected):
                raise FuzzFailure("the canary's output changed: another session's cache leaked")
        elif not torch.allclose(output, self._canary_expected, rtol=1e-5, atol=1e-5):
            raise FuzzFailure("the canary's output changed while batched with the example")
        return True

    async def check_clean(self) -> None:
        """The example's calls are over: the cache is back at its baseline, only the canary is
        open, nothing was logged as a crash, and the canary's cache is untouched."""
        block_server = self.server.block_server
        while True:
            # The handler frees its grant when it exits; after a reset that happens after the
            # reset's packet arrived, and the server has no event for it: poll (the loop
            # usually finds it done at once; the example's deadline bounds it).  No session
            # at all: the canary timed out too.
            while block_server.open_sessions and (  # noqa: ASYNC110
                block_server.cache_tokens_left != self.baseline_tokens
                or block_server.open_sessions != 1
            ):
                await trio.sleep(0.005)
            if self.errors_logged:
                record = self.errors_logged[0]
                self.errors_logged.clear()
                raise FuzzFailure(
                    f"the server logged an error: {record.getMessage()} {record.exc_text}"
                )
            if not self._canary_broken and await self.check_canary(exact=True):
                return
            await self._reopen_canary()

    async def with_canary(self, work: Callable[[], Awaitable[str]]) -> str:
        """Run ``work`` while the canary takes a step at the same time."""
        outcome = ""

        async def run_work() -> None:
            nonlocal outcome
            outcome = await work()

        async def run_canary() -> None:
            if not self._canary_broken:
                await self.check_canary(exact=False)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_work)
            nursery.start_soon(run_canary)
        return outcome

    async def open_call(self, method: str | None) -> _RawCall:
        call = await _RawCall.open(self.connection, method)
        self._calls.append(call)
        return call

    async def run_case(self, case: Case) -> str:
        if self._canary_broken:
            with trio.fail_after(EXAMPLE_TIMEOUT_S):
                await self._reopen_canary()
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT_S):
                outcome = await case.run(self)
        finally:
            # A failed example leaves its calls open: reset them, so that the next example
            # starts from a clean server (and hypothesis can shrink this one).
            for call in self._calls:
                call.abandon()
            self._calls.clear()
        with trio.fail_after(EXAMPLE_TIMEOUT_S):
            await self.check_clean()
        return outcome


class Case(Protocol):
    async def run(self, harness: Harness) -> str: ...


# -- 1. raw streams --------------------------------------------------------------------------------


@attrs.frozen
class RawStream:
    """Bytes written straight onto a call's stream, then our end of stream (or a reset).

    ``kind``: ``bytes`` (anything), ``header+`` (a valid header for ``method``, then ``data``),
    ``truncated`` (a header and a valid request cut after ``cut`` bytes), ``oversized`` (a
    header, then a frame prefix declaring ``length`` bytes, then ``data``).  ``abandon``:
    ``"reset"`` resets the stream after writing instead of ending it, ``"unread"`` ends it and
    lets go of it without reading the answer.
    """

    kind: str
    method: str
    data: bytes = b""
    cut: int = 0
    length: int = 0
    abandon: str = ""

    def payload(self) -> bytes:
        header = _frame({"call": self.method})
        if self.kind == "bytes":
            return self.data
        if self.kind == "header+":
            return header + self.data
        if self.kind == "truncated":
            request = _frame({"msg": _valid_request(self.method)})
            return header + request[: self.cut % max(1, len(request))]
        assert self.kind == "oversized"
        return header + self.length.to_bytes(4, "big") + self.data

    async def run(self, harness: Harness) -> str:
        call = await harness.open_call(None)
        if self.abandon == "reset":
            await call.send_bytes(self.payload())
            call.abandon()
            return "abandoned"
        if self.abandon == "unread":
            await call.send_bytes(self.payload(), eof=True)
            await call.close()
            return "abandoned"
        await call.send_bytes(self.payload(), eof=True)
        outcome = await _expect_end(call)
        known = self.method in _METHODS
        if self.kind == "oversized" and self.length > _MAX_FRAME_BYTES:
            # Refused as soon as its prefix is read; an unknown method may be refused first.
            _expect(
                outcome == "refused:ProtocolError" or (not known and outcome.endswith("Method")),
                f"an oversized frame got {outcome}",
            )
        if self.kind in ("truncated", "oversized"):
            _expect(outcome.startswith("refused:"), f"a truncated request got {outcome}")
        if self.kind == "header+" and not known:
            # Garbage after the header may be refused first, as soon as it is read.
            _expect(
                outcome in ("refused:UnknownMethod", "refused:ProtocolError"),
                f"an unknown method got {outcome}",
            )
        return outcome


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise FuzzFailure(problem)


_METHODS: Final = (INFO, INFERENCE, FORWARD, BACKWARD)


def _valid_request(method: str) -> dict[str, Any]:
    if method == INFERENCE:
        return {"session_id": "t", "blocks": [0, 2], "max_length": 8}
    if method in (FORWARD, BACKWARD):
        return {"meta": {"blocks": [0, 2]}}
    return {}


# -- 2. inference openings -------------------------------------------------------------------------


@attrs.frozen
class Opening:
    """One ``petals.inference`` opening; ``valid`` says whether every field was drawn valid (then
    the session must open).  An opened session takes one valid step and is closed."""

    fields: dict[str, Any]
    valid: bool

    async def run(self, harness: Harness) -> str:
        call = await harness.open_call(INFERENCE)
        await call.send(self.fields)
        try:
            ready = await call.receive()
        except RemoteError as exc:
            await call.close()
            outcome = _refusal(exc, call)
            _expect(not self.valid or outcome == "refused:timeout", f"a valid opening got {exc}")
            return outcome
        _expect(ready == {"ready": True, "position": 0}, f"the opening got {ready!r}")
        _expect(self.valid, "an invalid opening was accepted")
        batch = self.fields.get("batch_size", 1)
        return await _one_step_and_close(call, torch.ones(batch, 1, HIDDEN))


async def _one_step_and_close(call: _RawCall, hidden: torch.Tensor) -> str:
    """A valid first step of an open session, then its end."""
    await call.send({"hidden_states": hidden})
    try:
        reply = await call.receive()
    except RemoteError as exc:
        outcome = _refusal(exc, call)
        _expect(outcome == "refused:timeout", f"a valid first step got {exc}")
        return outcome
    _expect(reply is not None and reply["position"] == hidden.shape[1], f"the step got {reply!r}")
    await call.send_eof()
    return await _expect_end(call)


# -- 3. inference steps ----------------------------------------------------------------------------


@attrs.frozen
class Steps:
    """A valid session, then ``steps`` (each a dict of step fields, hostile or not); every step
    is predicted valid or not by the documented rules, and the server must agree."""

    blocks: tuple[int, int]
    batch: int
    max_length: int
    steps: tuple[dict[str, Any], ...]
    abandon: bool = False

    async def run(self, harness: Harness) -> str:
        call = await harness.open_call(INFERENCE)
        opening = {
            "session_id": "steps",
            "blocks": list(self.blocks),
            "max_length": self.max_length,
            "batch_size": self.batch,
        }
        await call.send(opening)
        _expect(await call.receive() == {"ready": True, "position": 0}, "the session did not open")
        position = 0
        for step in self.steps:
            expected = _predict_step(step, self, position)
            replies: list[dict[str, Any] | None] = []

            async def take_step(
                step: dict[str, Any] = step, replies: list[dict[str, Any] | None] = replies
            ) -> str:
                await call.send(step)
                try:
                    replies.append(await call.receive())
                except RemoteError as exc:
                    return _refusal(exc, call)
                return "ok"

            outcome = await harness.with_canary(take_step)
            where = f"step {step!r} at position {position}"
            if outcome != "ok":
                _expect(
                    expected is None or outcome == "refused:timeout",
                    f"a valid step was {outcome}: {where}",
                )
                _expect(await _expect_end(call) == "closed", "messages after the refusal")
                return outcome
            reply = replies[0]
            _expect(expected is not None, f"an invalid step was answered: {where}: {reply!r}")
            assert expected is not None and reply is not None
            output = reply.get("hidden_states")
            _expect(
                isinstance(output, torch.Tensor)
                and tuple(output.shape) == expected[0]
                and str(output.dtype) == "torch." + step["hidden_states"].dtype
                and reply.get("position") == expected[1],
                f"{where} got {reply!r}, expected (shape, position) {expected}",
            )
            position = expected[1]
        if self.abandon:
            call.abandon()
            return "abandoned"
        await call.send_eof()
        return await _expect_end(call)


def _predict_step(
    step: dict[str, Any], session: Steps, position: int
) -> tuple[tuple[int, ...], int] | None:
    """The output shape and the new position of a valid step; None if it must be refused."""
    hidden = step.get("hidden_states")
    if not isinstance(hidden, TensorSpec) or hidden.dtype not in FLOAT_DTYPES:
        return None
    if len(hidden.shape) != 3 or hidden.shape[0] != session.batch or hidden.shape[2] != HIDDEN:
        return None
    start_from = step.get("start_from_position", _MISSING)
    if start_from is not None and start_from != _MISSING:
        if type(start_from) is not int or not 0 <= start_from <= position:
            return None
        position = start_from
    tokens = hidden.shape[1]
    if position + tokens > session.max_length:
        return None
    hypo_ids = step.get("hypo_ids", _MISSING)
    if (
        hypo_ids is not None
        and hypo_ids != _MISSING
        and (
            not isinstance(hypo_ids, TensorSpec)
            or hypo_ids.dtype not in INT_DTYPES
            or hypo_ids.shape != (session.batch,)
            or not _indices_in_range(hypo_ids, session.batch)
        )
    ):
        return None
    prompts = step.get("prompts", _MISSING)
    if prompts is not None and prompts != _MISSING:
        nblocks = session.blocks[1] - session.blocks[0]
        if (
            not isinstance(prompts, TensorSpec)
            or prompts.dtype not in FLOAT_DTYPES
            or len(prompts.shape) != 4
            or prompts.shape[0] != nblocks
            or prompts.shape[1] not in (1, session.batch)
            or prompts.shape[2] > tokens
            or prompts.shape[3] != HIDDEN
        ):
            return None
    return hidden.shape, position + tokens


def _indices_in_range(spec: TensorSpec, batch: int) -> bool:
    values = spec.build()
    return bool(((values >= 0) & (values < batch)).all())


# -- 4. concurrent openings ------------------------------------------------------------------------


@attrs.frozen
class Concurrent:
    """Sessions opened at the same time, some with the same id (or the canary's): each id may
    be held once, and one peer may hold ``max_sessions_per_peer`` sessions (the canary is one)."""

    session_ids: tuple[str, ...]

    async def run(self, harness: Harness) -> str:
        answered = trio.Event()
        pending = len(self.session_ids)
        opened: list[str] = []
        refusals: list[str] = []

        async def one(session_id: str) -> None:
            nonlocal pending
            call = await harness.open_call(INFERENCE)
            opening = {"session_id": session_id, "blocks": [1, 3], "max_length": 4}
            await call.send(opening)
            try:
                ready = await call.receive()
            except RemoteError as exc:
                refusals.append(_refusal(exc, call))
                ready = None
            pending -= 1
            if pending == 0:
                answered.set()
            # Every call stays open until all were answered, so that all are open at once.
            await answered.wait()
            if ready is None:
                await call.close()
                return
            _expect(ready == {"ready": True, "position": 0}, f"the opening got {ready!r}")
            opened.append(session_id)
            await _one_step_and_close(call, torch.ones(1, 2, HIDDEN))

        async with trio.open_nursery() as nursery:
            for session_id in self.session_ids:
                nursery.start_soon(one, session_id)
        counts = collections.Counter(opened)
        _expect(CANARY_ID not in counts, "a second session opened with the canary's id")
        _expect(
            all(n == 1 for n in counts.values()),
            f"one session id was opened twice at once: {dict(counts)}",
        )
        _expect(
            len(opened) <= LIMITS.max_sessions_per_peer - 1,
            f"{len(opened)} + 1 sessions of one peer were open at once",
        )
        return f"opened {len(opened)}" if opened else "none opened"


# -- 5. forward / backward transfers ---------------------------------------------------------------


@attrs.frozen
class Transfer:
    """A ``petals.forward`` / ``petals.backward`` call: ``meta``, then ``tensors`` in parts of
    ``per_part`` elements, then ``{"done": true}`` and our end of stream, with one ``mutation``
    of that (see :data:`MUTATIONS`) applied at message ``index``, or a reset after
    ``abandon_after`` messages.  Valid transfers must be answered with the right tensors."""

    method: str
    meta: dict[str, Any]
    tensors: dict[str, TensorSpec]
    per_part: int
    mutation: str | None = None
    index: int = 1
    huge_shape: tuple[int, ...] = ()
    abandon_after: int | None = None

    def _target(self) -> tuple[list[dict[str, Any]], int]:
        """The unmutated messages, and the index of the part the mutation applies to."""
        messages: list[dict[str, Any]] = [{"meta": self.meta}]
        for name, spec in self.tensors.items():
            messages += _parts(name, spec, self.per_part)
        return messages, 1 + self.index % (len(messages) - 1)

    def messages(self) -> list[dict[str, Any]]:
        messages, index = self._target()
        part = messages[index]
        if self.mutation == "drop_part":
            messages.pop(index)
        elif self.mutation == "repeat_part":
            messages.insert(index, part)
        elif self.mutation == "part_dtype":
            # The first part's dtype is the tensor's: int32 is refused for what it is, and a
            # later part for the change.
            messages[index] = {**part, "part": part["part"].to(torch.int32)}
        elif self.mutation == "part_shape":
            messages[index] = {**part, "shape": [*part["shape"], 1]}
        elif self.mutation == "no_meta":
            messages.pop(0)
        elif self.mutation == "2d_part":
            messages[index] = {**part, "part": part["part"].view(1, -1)}
        elif self.mutation == "huge_shape":
            messages[index] = {**part, "shape": list(self.huge_shape)}
        elif self.mutation == "too_many_tensors":
            for i in range(9):
                messages.append({"name": f"extra{i}", "shape": [1], "part": torch.zeros(1)})
        if self.mutation != "no_done":
            messages.append({"done": True})
        if self.mutation == "extra_after_done":
            messages.append({"meta": {}})
        return messages

    @property
    def valid(self) -> bool:
        """Every mutation breaks the protocol but a message after "done" (the server stops
        reading there), and dropping or repeating the only, empty, part of the optional prompts
        (P = 0); an invalid meta field or tensor is refused too."""
        hidden = self.tensors["hidden_states"]
        if not _valid_meta(self.meta) or hidden.dtype not in FLOAT_DTYPES:
            return False
        if self.mutation in (None, "extra_after_done"):
            return True
        if self.mutation in ("drop_part", "repeat_part"):
            messages, index = self._target()
            part = messages[index]
            if self.mutation == "repeat_part":
                return part["part"].numel() == 0  # repeating an empty part adds nothing
            # Dropping the only part of the prompts leaves a request without prompts.
            return (
                part["name"] == "prompts" and sum(m.get("name") == "prompts" for m in messages) == 1
            )
        return False

    async def run(self, harness: Harness) -> str:
        call = await harness.open_call(self.method)
        for index, message in enumerate(self.messages()):
            if self.abandon_after == index:
                call.abandon()
                return "abandoned"
            if not await call.send(message):
                break
        await call.send_eof()
        valid = self.valid
        try:
            replies = await call.finish()
        except RemoteError as exc:
            await call.close()
            outcome = _refusal(exc, call)
            _expect(not valid or outcome == "refused:timeout", f"a valid transfer got {exc}")
            return outcome
        except StreamReset as exc:
            raise FuzzFailure(f"the server reset the call instead of answering: {exc}") from exc
        await call.close()
        _expect(valid, f"an invalid transfer was answered: {replies!r}")
        name = "hidden_states" if self.method == FORWARD else "grad_inputs"
        parts = [r for r in replies if r.get("name") == name]
        shape = list(self.tensors["hidden_states"].shape)
        _expect(bool(parts) and parts[0]["shape"] == shape, f"the reply was {replies!r}")
        return "ok"


def _valid_meta(meta: dict[str, Any]) -> bool:
    blocks, adapter = meta.get("blocks"), meta.get("active_adapter")
    points = meta.get("points", 0.0)
    return (
        isinstance(blocks, list)
        and len(blocks) == 2
        and all(type(b) is int for b in blocks)
        and BLOCKS[0] <= blocks[0] < blocks[1] <= BLOCKS[1]
        and adapter in (None, "")
        and type(points) in (int, float)
        and math.isfinite(points)
    )


# -- strategies ------------------------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=8)
#: Any value the codec can carry, none of them meaningful.
junk: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64 - 1),
    st.sampled_from([2**63, -(2**63), 2**64 - 1, -(2**64), -1, 0]),
    st.floats(),
    _text,
    st.binary(max_size=8),
    st.lists(st.integers(-3, 10), max_size=4),
    st.dictionaries(_text, st.integers(-(2**64), 2**64 - 1), max_size=2),
)


def float_tensors(shape: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[TensorSpec]:
    return st.builds(TensorSpec, st.sampled_from(FLOAT_DTYPES), shape, st.sampled_from(FLOAT_FILLS))


def any_tensors(shape: st.SearchStrategy[tuple[int, ...]]) -> st.SearchStrategy[TensorSpec]:
    ints = st.builds(
        TensorSpec,
        st.sampled_from((*INT_DTYPES, "bool")),
        shape,
        st.sampled_from(INT_FILLS),
    )
    return st.one_of(float_tensors(shape), ints)


#: Small shapes of any rank (at most 8**4 elements).
small_shapes = st.lists(st.integers(0, 8), max_size=4).map(tuple)
raw_tags = st.builds(
    RawTag,
    st.sampled_from(["float64", "complex64", "float32", "int64", "bool", "", "x" * 17]),
    st.lists(
        st.one_of(st.integers(0, 70), st.sampled_from([2**31, 2**32, 2**63, 2**64 - 1])),
        max_size=10,
    ).map(tuple),
    st.integers(0, 300),
)


def _some_hostile(
    draw: st.DrawFn, fields: Mapping[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]
) -> tuple[dict[str, Any], bool]:
    """Draw every field from its valid strategy but none, one or two from their hostile ones;
    also whether all were drawn valid.  Fields drawn as ``_MISSING`` are left out."""
    hostile = draw(st.sets(st.sampled_from(sorted(fields)), max_size=2))
    message = {name: draw(fields[name][name in hostile]) for name in fields}
    return {k: v for k, v in message.items() if v != _MISSING}, not hostile


valid_blocks = st.tuples(st.integers(0, 5), st.integers(1, 6)).filter(lambda b: b[0] < b[1])


@st.composite
def openings(draw: st.DrawFn) -> Opening:
    fields = {
        "session_id": (
            st.text(st.characters(codec="utf-8"), min_size=1, max_size=20).filter(
                lambda s: s != CANARY_ID and len(s.encode()) <= 128
            ),
            st.one_of(
                st.sampled_from([_MISSING, "", CANARY_ID, "x" * 129]),
                junk.filter(lambda v: not isinstance(v, str)),
            ),
        ),
        "blocks": (
            valid_blocks.map(list),
            st.one_of(
                st.sampled_from([_MISSING, [3, 3], [4, 2], [0, 7], [-1, 2], [0], [0, 1, 2], "0:6"]),
                st.sampled_from([[True, 2], [0, 2**63], [0.0, 2.0], [0, 2**64 - 1]]),
                junk,
            ),
        ),
        "max_length": (
            st.one_of(st.integers(1, 64), st.sampled_from([4096, 8192])),
            st.one_of(
                st.sampled_from([_MISSING, 0, -1, 8193, 2**63, 1.5, "8", True]),
                junk.filter(lambda v: not (type(v) is int and 1 <= v <= 8192)),
            ),
        ),
        "batch_size": (
            st.one_of(st.just(_MISSING), st.integers(1, 3), st.just(LIMITS.max_batch_tokens)),
            st.one_of(
                st.sampled_from([0, -5, LIMITS.max_batch_tokens + 1, 2**63, 1.0, False]),
                junk.filter(lambda v: not (type(v) is int and 1 <= v <= LIMITS.max_batch_tokens)),
            ),
        ),
        "alloc_timeout": (
            st.one_of(st.just(_MISSING), st.sampled_from([0, 0.0, 0.01, 1e308])),
            st.sampled_from([-1, -0.0001, math.nan, math.inf, "1", True, [1]]),
        ),
        "active_adapter": (
            st.sampled_from([_MISSING, None, ""]),
            st.one_of(st.sampled_from(["nope", "lora"]), st.integers(-9, 9), st.lists(_text)),
        ),
        "points": (
            st.one_of(st.just(_MISSING), st.floats(allow_nan=False, allow_infinity=False)),
            st.sampled_from([math.nan, math.inf, -math.inf, "1", True, None, [0.5]]),
        ),
    }
    message, valid = _some_hostile(draw, fields)
    if valid:
        # Valid fields, but the cache it asks for may not fit next to the canary's: refused.
        start, end = message["blocks"]
        tokens = message.get("batch_size", 1) * message["max_length"] * (end - start)
        valid = tokens <= ATTN_CACHE_TOKENS * 6 - CANARY_TOKENS
    extra = draw(st.dictionaries(_text.filter(lambda k: k not in fields), junk, max_size=2))
    return Opening({**message, **extra}, valid)


@st.composite
def steps_cases(draw: st.DrawFn) -> Steps:
    start, end = draw(valid_blocks)
    batch = draw(st.integers(1, 3))
    max_length = draw(st.integers(1, 32))
    nblocks = end - start
    hidden_shapes = st.one_of(
        st.tuples(st.just(batch), st.integers(0, max_length + 2), st.just(HIDDEN)),
        st.tuples(st.integers(0, 4), st.integers(0, 3), st.sampled_from([HIDDEN, 1, 63, 65])),
        small_shapes,
    )
    in_range = st.builds(
        TensorSpec,
        st.sampled_from(INT_DTYPES),
        st.just((batch,)),
        st.sampled_from(["ints", "zeros"]),
    )
    fields = {
        "hidden_states": (
            float_tensors(st.tuples(st.just(batch), st.integers(0, 12), st.just(HIDDEN))),
            st.one_of(any_tensors(hidden_shapes), raw_tags, junk, st.just(_MISSING)),
        ),
        "start_from_position": (
            st.one_of(st.just(_MISSING), st.just(None), st.integers(0, max_length)),
            st.one_of(
                st.integers(-3, max_length + 3),
                st.sampled_from([2**63, -(2**63), 2**64 - 1, True, 1.0, "0"]),
            ),
        ),
        "hypo_ids": (
            st.one_of(st.just(_MISSING), st.just(None), in_range),
            st.one_of(
                any_tensors(st.one_of(st.just((batch,)), small_shapes)),
                st.builds(
                    TensorSpec,
                    st.sampled_from(INT_DTYPES),
                    st.just((batch,)),
                    st.sampled_from(INT_FILLS),
                ),
                junk,
            ),
        ),
        "prompts": (
            st.one_of(
                st.just(_MISSING),
                st.just(None),
                float_tensors(
                    st.tuples(
                        st.just(nblocks),
                        st.sampled_from([1, batch]),
                        st.integers(0, 3),
                        st.just(HIDDEN),
                    )
                ),
            ),
            st.one_of(
                float_tensors(
                    st.tuples(
                        st.sampled_from([nblocks, nblocks + 1, 0]),
                        st.sampled_from([1, batch, batch + 1]),
                        st.integers(0, 4),
                        st.sampled_from([HIDDEN, 3]),
                    )
                ),
                any_tensors(small_shapes),
                junk,
            ),
        ),
    }

    @st.composite
    def steps(draw: st.DrawFn) -> dict[str, Any]:
        return _some_hostile(draw, fields)[0]

    return Steps(
        (start, end),
        batch,
        max_length,
        tuple(draw(st.lists(steps(), min_size=1, max_size=4))),
        draw(st.booleans()),
    )


concurrent_cases = st.builds(
    Concurrent,
    st.lists(st.sampled_from(["a", "a", "b", CANARY_ID, "c", "d", "e"]), min_size=2, max_size=10)
    .map(tuple)
    .map(
        lambda ids: tuple(s if s == "a" or s == CANARY_ID else f"{s}{i}" for i, s in enumerate(ids))
    ),
)


def _parts(name: str, spec: TensorSpec, per_part: int) -> list[dict[str, Any]]:
    flat = spec.build().reshape(-1)
    shape = list(spec.shape)
    if flat.numel() == 0:
        return [{"name": name, "shape": shape, "part": flat}]
    return [
        {"name": name, "shape": shape, "part": flat[i : i + per_part]}
        for i in range(0, flat.numel(), per_part)
    ]


MUTATIONS: Final = (
    "drop_part",
    "repeat_part",
    "part_dtype",
    "part_shape",
    "no_done",
    "no_meta",
    "2d_part",
    "huge_shape",
    "too_many_tensors",
    "extra_after_done",
)


@st.composite
def transfers(draw: st.DrawFn) -> Transfer:
    method = draw(st.sampled_from([FORWARD, BACKWARD]))
    start, end = draw(valid_blocks)
    batch, tokens = draw(st.integers(1, 2)), draw(st.integers(1, 6))
    shape = (batch, tokens, HIDDEN)
    tensors = {"hidden_states": draw(float_tensors(st.just(shape)))}
    if method == BACKWARD:
        tensors["grad_outputs"] = draw(float_tensors(st.just(shape)))
    if draw(st.booleans()):
        prompt_shape = (
            end - start,
            draw(st.sampled_from([1, batch])),
            draw(st.integers(0, tokens)),
        )
        tensors["prompts"] = draw(float_tensors(st.just((*prompt_shape, HIDDEN))))
    meta: dict[str, Any] = {"blocks": [start, end]}
    if draw(st.integers(0, 3)) == 0:
        key, value = draw(
            st.sampled_from(
                [
                    ("blocks", [0, 7]),
                    ("blocks", [2, 2]),
                    ("blocks", None),
                    ("active_adapter", "nope"),
                    ("active_adapter", 5),
                    ("points", math.nan),
                    ("points", "1"),
                ]
            )
        )
        meta[key] = value
    return Transfer(
        method,
        meta,
        tensors,
        per_part=draw(st.sampled_from([1 << 20, 64, 7, 1])),
        mutation=draw(st.one_of(st.none(), st.sampled_from(MUTATIONS))),
        index=draw(st.integers(0, 1000)),
        huge_shape=draw(
            st.sampled_from([(2**32, 2**32), (2**63, 2), (2**64 - 1,) * 8, (1 << 28, 2), (-1, 4)])
        ),
        abandon_after=draw(st.sampled_from([None, None, None, 0, 1, 2, 5, 30])),
    )


@st.composite
def raw_streams(draw: st.DrawFn) -> RawStream:
    kind = draw(st.sampled_from(["bytes", "header+", "truncated", "oversized"]))
    method = draw(
        st.one_of(st.sampled_from(_METHODS), st.sampled_from(["", "petals.", "x" * 300]), _text)
    )
    data = draw(
        st.one_of(
            st.binary(max_size=64),
            st.builds(_frame, st.fixed_dictionaries({"msg": junk})),
            st.builds(_frame, st.fixed_dictionaries({"call": junk})),
            st.builds(_frame, st.dictionaries(_text, junk, max_size=3)),
            st.builds(
                lambda tag: _frame({"msg": {"hidden_states": tag}}),
                raw_tags,
            ),
        )
    )
    return RawStream(
        kind,
        method,
        data,
        cut=draw(st.integers(0, 200)),
        length=draw(
            st.one_of(
                st.integers(0, 1 << 16),
                st.integers(_MAX_FRAME_BYTES - 4, 2**32 - 1),
            )
        ),
        abandon=draw(st.sampled_from(["", "reset", "unread"])),
    )


@st.composite
def raw_tag_steps(draw: st.DrawFn) -> Steps:
    """A session whose step carries a hand-written tensor tag (float64, complex, huge shapes)."""
    step = {"hidden_states": draw(raw_tags)}
    return Steps((0, 2), 1, 8, (step,))


def cases() -> st.SearchStrategy[Case]:
    """Every kind of hostile example, about equally often."""
    return st.one_of(
        raw_streams(),
        openings(),
        steps_cases(),
        raw_tag_steps(),
        concurrent_cases,
        transfers(),
    )


# -- running ---------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FuzzReport:
    """What a run did: examples run (shrinking included), outcome counts, RSS in bytes."""

    examples: int
    outcomes: dict[str, int]
    rss_before_bytes: int
    rss_after_bytes: int
    rss_peak_bytes: int
    #: RSS after each hypothesis run (of CHUNK_EXAMPLES): a leak grows steadily, allocator
    #: slack levels off.
    rss_samples_bytes: tuple[int, ...]
    #: Times the canary session was reopened (it idled past its step timeout on a loaded
    #: machine; any other way for it to end fails the run).
    canary_reopened: int
    elapsed_s: float

    @property
    def rss_growth_bytes(self) -> int:
        return self.rss_after_bytes - self.rss_before_bytes


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class _Collect(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self._records = records

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        self._records.append(record)


async def _host(checkpoint: TinyCheckpoint, cache_dir: Path, handoff: queue.Queue[Any]) -> None:
    async with (
        serve(
            checkpoint,
            cache_dir,
            blocks=BLOCKS,
            limits=LIMITS,
            attn_cache_tokens=ATTN_CACHE_TOKENS,
        ) as server,
        connect(server) as connection,
    ):
        harness = Harness(server, connection)
        with trio.fail_after(60):
            await harness.open_canary()
        handoff.put((harness, trio.lowlevel.current_trio_token()))
        await harness.stop.wait()
        with trio.fail_after(60):
            await harness.close_canary()


def _run_chunk(
    harness: Harness,
    token: trio.lowlevel.TrioToken,
    strategy: st.SearchStrategy[Case],
    examples: int,
    seed: int,
    outcomes: collections.Counter[str],
) -> None:
    @hypothesis.seed(seed)
    @settings(
        max_examples=examples,
        # The explicit seed decides the examples everywhere: hypothesis' CI profile (when CI is
        # set) would otherwise derandomize from the test's source and draw other ones.
        derandomize=False,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=strategy)
    def example(case: Case) -> None:
        outcome = trio.from_thread.run(harness.run_case, case, trio_token=token)
        outcomes[f"{type(case).__name__}:{outcome}"] += 1

    example()


def run_fuzz(
    checkpoint: TinyCheckpoint,
    cache_dir: Path,
    *,
    max_examples: int,
    strategy: st.SearchStrategy[Case] | None = None,
) -> FuzzReport:
    """Run ``max_examples`` hypothesis examples against a fresh server, in runs of at most
    :data:`CHUNK_EXAMPLES` (run ``i`` with seed ``i``: the same examples every time); raises
    the first broken invariant, shrunk.

    Hypothesis keeps every example of a run for shrinking (about 13 KiB each here), so one run
    of 10000 would grow the process by ~130 MB that is not the server's; separate runs give
    that memory back, and what still grows from run to run is the server's.
    """
    handoff: queue.Queue[Any] = queue.Queue()
    failures: list[BaseException] = []

    def trio_thread() -> None:
        try:
            trio.run(_host, checkpoint, cache_dir, handoff)
        except BaseException as exc:
            failures.append(exc)
            handoff.put(exc)

    thread = threading.Thread(target=trio_thread, name="fuzz-server", daemon=True)
    thread.start()
    started = handoff.get(timeout=300)
    if isinstance(started, BaseException):
        raise started
    harness, token = started
    collector = _Collect(harness.errors_logged)
    logging.getLogger("petals_core").addHandler(collector)
    outcomes: collections.Counter[str] = collections.Counter()
    samples: list[int] = []
    began = time.monotonic()
    try:
        rss_before = _status_bytes("VmRSS")
        for index, first in enumerate(range(0, max_examples, CHUNK_EXAMPLES)):
            _run_chunk(
                harness,
                token,
                strategy or cases(),
                min(CHUNK_EXAMPLES, max_examples - first),
                index,
                outcomes,
            )
            samples.append(_status_bytes("VmRSS"))
        rss_after = _status_bytes("VmRSS")
    finally:
        logging.getLogger("petals_core").removeHandler(collector)
        try:
            trio.from_thread.run_sync(harness.stop.set, trio_token=token)
        except trio.RunFinishedError:
            pass
        thread.join(timeout=120)
    if failures:
        raise failures[0]
    return FuzzReport(
        examples=sum(outcomes.values()),
        outcomes=dict(outcomes),
        rss_before_bytes=rss_before,
        rss_after_bytes=rss_after,
        rss_peak_bytes=_status_bytes("VmHWM"),
        rss_samples_bytes=tuple(samples),
        canary_reopened=harness.canary_reopened,
        elapsed_s=time.monotonic() - began,
    )
