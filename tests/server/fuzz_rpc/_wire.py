"""What a fuzzing example is made of, and a client call with its framing written by hand; with
the constants of the fuzzed server (its blocks, cache and limits) and of the examples."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import attrs
import cbor2
import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import BACKWARD, FORWARD, INFERENCE, INFO
from petals_core.server import ServingLimits
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
#: What a refusal may be reported as: each names the fault.
CLEAR_ERRORS: Final = frozenset(
    {
        "ServerError",
        "AllocationFailed",
        "SessionTooLarge",
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
MAX_FRAME_BYTES: Final = _WIRE_LIMITS.max_frame_bytes
FLOAT_DTYPES: Final = ("float32", "float16", "bfloat16")
INT_DTYPES: Final = ("int64", "int32", "int8", "uint8")
WIRE_DTYPES: Final = (*FLOAT_DTYPES, *INT_DTYPES, "bool")
FLOAT_FILLS: Final = ("randn", "zeros", "nan", "inf", "ninf", "huge", "mixed")
INT_FILLS: Final = ("ints", "zeros", "neg", "max")
CANARY_ID: Final = "canary"
#: Cache positions x blocks the canary session holds (max_length 16 over blocks 0:6).
CANARY_TOKENS: Final = 16 * 6
MISSING: Final = "<missing>"
METHODS: Final = (INFO, INFERENCE, FORWARD, BACKWARD)


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
        return {k: _value(v) for k, v in value.items() if v != MISSING}
    if isinstance(value, list | tuple):
        return [_value(v) for v in value]
    return value


def frame(envelope: Mapping[str, Any]) -> bytes:
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


class RawCall:
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
    async def open(cls, connection: Connection, method: str | None) -> RawCall:
        call = cls(await connection.open_stream())
        if method is not None:
            await call.send_bytes(frame({"call": method}))
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
        return await self.send_bytes(frame({"msg": message}), eof=eof)

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


def refusal(exc: RemoteError, call: RawCall) -> str:
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
        expect(
            call.max_idle_s >= LIMITS.step_timeout_s / 2,
            f"{exc} though every message came within {call.max_idle_s:.2f} s",
        )
        return "refused:timeout"
    if exc.remote_type == "ServerError" and "request timeout" in exc.remote_message:
        elapsed_s = trio.current_time() - call.opened_at
        expect(elapsed_s >= LIMITS.request_timeout_s / 2, f"{exc} after {elapsed_s:.2f} s")
        return "refused:timeout"
    return f"refused:{exc.remote_type}"


async def expect_end(call: RawCall) -> str:
    """Read the server's answer to a call we gave up sending on; must be an error or an end."""
    try:
        extra = await call.finish()
    except RemoteError as exc:
        return refusal(exc, call)
    except StreamReset as exc:
        raise FuzzFailure(f"the server reset the call instead of answering: {exc}") from exc
    finally:
        await call.close()
    return "ok" if extra else "closed"


def expect(condition: bool, problem: str) -> None:
    if not condition:
        raise FuzzFailure(problem)
