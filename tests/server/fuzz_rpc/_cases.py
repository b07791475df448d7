"""The kinds of fuzzing example: each sends something hostile and checks the server's answer."""

from __future__ import annotations

import collections
import math
from typing import Any, Final

import attrs
import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import BACKWARD, FORWARD, INFERENCE
from petals_core.transport import StreamReset

from ._harness import Harness
from ._wire import (
    BLOCKS,
    CANARY_ID,
    FLOAT_DTYPES,
    HIDDEN,
    INT_DTYPES,
    LIMITS,
    MAX_FRAME_BYTES,
    METHODS,
    MISSING,
    FuzzFailure,
    RawCall,
    TensorSpec,
    expect,
    expect_end,
    frame,
    refusal,
)

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
        header = frame({"call": self.method})
        if self.kind == "bytes":
            return self.data
        if self.kind == "header+":
            return header + self.data
        if self.kind == "truncated":
            request = frame({"msg": _valid_request(self.method)})
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
        outcome = await expect_end(call)
        known = self.method in METHODS
        if self.kind == "oversized" and self.length > MAX_FRAME_BYTES:
            # Refused as soon as its prefix is read; an unknown method may be refused first.
            expect(
                outcome == "refused:ProtocolError" or (not known and outcome.endswith("Method")),
                f"an oversized frame got {outcome}",
            )
        if self.kind in ("truncated", "oversized"):
            expect(outcome.startswith("refused:"), f"a truncated request got {outcome}")
        if self.kind == "header+" and not known:
            # Garbage after the header may be refused first, as soon as it is read.
            expect(
                outcome in ("refused:UnknownMethod", "refused:ProtocolError"),
                f"an unknown method got {outcome}",
            )
        return outcome


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
            outcome = refusal(exc, call)
            expect(not self.valid or outcome == "refused:timeout", f"a valid opening got {exc}")
            return outcome
        expect(ready == {"ready": True, "position": 0}, f"the opening got {ready!r}")
        expect(self.valid, "an invalid opening was accepted")
        batch = self.fields.get("batch_size", 1)
        return await _one_step_and_close(call, torch.ones(batch, 1, HIDDEN))


async def _one_step_and_close(call: RawCall, hidden: torch.Tensor) -> str:
    """A valid first step of an open session, then its end."""
    await call.send({"hidden_states": hidden})
    try:
        reply = await call.receive()
    except RemoteError as exc:
        outcome = refusal(exc, call)
        expect(outcome == "refused:timeout", f"a valid first step got {exc}")
        return outcome
    expect(reply is not None and reply["position"] == hidden.shape[1], f"the step got {reply!r}")
    await call.send_eof()
    return await expect_end(call)


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
        expect(await call.receive() == {"ready": True, "position": 0}, "the session did not open")
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
                    return refusal(exc, call)
                return "ok"

            outcome = await harness.with_canary(take_step)
            where = f"step {step!r} at position {position}"
            if outcome != "ok":
                expect(
                    expected is None or outcome == "refused:timeout",
                    f"a valid step was {outcome}: {where}",
                )
                expect(await expect_end(call) == "closed", "messages after the refusal")
                return outcome
            reply = replies[0]
            expect(expected is not None, f"an invalid step was answered: {where}: {reply!r}")
            assert expected is not None and reply is not None
            output = reply.get("hidden_states")
            expect(
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
        return await expect_end(call)


def _predict_step(
    step: dict[str, Any], session: Steps, position: int
) -> tuple[tuple[int, ...], int] | None:
    """The output shape and the new position of a valid step; None if it must be refused."""
    hidden = step.get("hidden_states")
    if not isinstance(hidden, TensorSpec) or hidden.dtype not in FLOAT_DTYPES:
        return None
    if len(hidden.shape) != 3 or hidden.shape[0] != session.batch or hidden.shape[2] != HIDDEN:
        return None
    start_from = step.get("start_from_position", MISSING)
    if start_from is not None and start_from != MISSING:
        if type(start_from) is not int or not 0 <= start_from <= position:
            return None
        position = start_from
    tokens = hidden.shape[1]
    if position + tokens > session.max_length:
        return None
    hypo_ids = step.get("hypo_ids", MISSING)
    if (
        hypo_ids is not None
        and hypo_ids != MISSING
        and (
            not isinstance(hypo_ids, TensorSpec)
            or hypo_ids.dtype not in INT_DTYPES
            or hypo_ids.shape != (session.batch,)
            or not _indices_in_range(hypo_ids, session.batch)
        )
    ):
        return None
    prompts = step.get("prompts", MISSING)
    if prompts is not None and prompts != MISSING:
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
                refusals.append(refusal(exc, call))
                ready = None
            pending -= 1
            if pending == 0:
                answered.set()
            # Every call stays open until all were answered, so that all are open at once.
            await answered.wait()
            if ready is None:
                await call.close()
                return
            expect(ready == {"ready": True, "position": 0}, f"the opening got {ready!r}")
            opened.append(session_id)
            await _one_step_and_close(call, torch.ones(1, 2, HIDDEN))

        async with trio.open_nursery() as nursery:
            for session_id in self.session_ids:
                nursery.start_soon(one, session_id)
        counts = collections.Counter(opened)
        expect(CANARY_ID not in counts, "a second session opened with the canary's id")
        expect(
            all(n == 1 for n in counts.values()),
            f"one session id was opened twice at once: {dict(counts)}",
        )
        expect(
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
            outcome = refusal(exc, call)
            expect(not valid or outcome == "refused:timeout", f"a valid transfer got {exc}")
            return outcome
        except StreamReset as exc:
            raise FuzzFailure(f"the server reset the call instead of answering: {exc}") from exc
        await call.close()
        expect(valid, f"an invalid transfer was answered: {replies!r}")
        name = "hidden_states" if self.method == FORWARD else "grad_inputs"
        parts = [r for r in replies if r.get("name") == name]
        shape = list(self.tensors["hidden_states"].shape)
        expect(bool(parts) and parts[0]["shape"] == shape, f"the reply was {replies!r}")
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
