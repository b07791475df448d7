"""Tensor transfers in parts (``send_tensors`` / ``receive_tensors``) between two functions.

The sender's messages go through a trio memory channel to the receiver, optionally through the
wire codec on the way (what the transport does to every message).  Malformed sequences are
built from valid ones and must raise :class:`CodecError` and nothing else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import trio
from hypothesis import given, settings, strategies as st

from petals_core import CodecError
from petals_core.protocol import receive_tensors, send_tensors
from petals_core.transport import decode_message_untrusted, encode_message

Message = Mapping[str, Any]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
MAX_TENSORS = 8


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 50
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.uint8:
        return values.abs().to(dtype)
    return values.to(dtype)


async def _transfer(
    tensors: Mapping[str, torch.Tensor | None],
    *,
    chunk_bytes: int,
    through_codec: bool,
    max_elements: int = 1 << 20,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Send and receive concurrently through a channel that holds one message at a time."""
    sender, receiver = trio.open_memory_channel[Message](0)
    received: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []

    async def send(message: Message) -> None:
        if through_codec:
            message = decode_message_untrusted(encode_message(message))
        await sender.send(message)

    async def receive_all() -> None:
        received.append(await receive_tensors(receiver.receive, max_elements=max_elements))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive_all)
        await send_tensors(send, {"blocks": [1, 4], "note": "x"}, tensors, chunk_bytes=chunk_bytes)
    (result,) = received
    return result


def _assert_same(
    received: dict[str, torch.Tensor], sent: Mapping[str, torch.Tensor | None]
) -> None:
    expected = {name: tensor for name, tensor in sent.items() if tensor is not None}
    assert set(received) == set(expected)
    for name, tensor in expected.items():
        assert received[name].dtype == tensor.dtype
        assert received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor)


@pytest.mark.parametrize("through_codec", [False, True])
@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 22])
async def test_round_trip(chunk_bytes: int, through_codec: bool) -> None:
    sent: dict[str, torch.Tensor | None] = {
        "hidden_states": _tensor((2, 5, 16), torch.float32, 0),
        "half": _tensor((3, 4), torch.float16, 1),
        "brain": _tensor((7,), torch.bfloat16, 2),
        "ids": _tensor((4,), torch.int64, 3),
        "mask": _tensor((2, 3), torch.bool, 4),
        "scalar": _tensor((), torch.float32, 5),
        "empty": torch.zeros(2, 0, 3),
        "left_out": None,
    }
    with trio.fail_after(30):
        meta, received = await _transfer(sent, chunk_bytes=chunk_bytes, through_codec=through_codec)
    assert meta == {"blocks": [1, 4], "note": "x"}
    _assert_same(received, sent)


async def test_parts_are_at_most_chunk_bytes() -> None:
    messages: list[Message] = []

    async def record(message: Message) -> None:
        messages.append(message)

    tensor = torch.arange(100, dtype=torch.float32)
    await send_tensors(record, {}, {"t": tensor, "e": torch.zeros(0)}, chunk_bytes=64)
    parts = [m["part"] for m in messages if m.get("name") == "t"]
    assert len(parts) == math.ceil(100 * 4 / 64)
    assert all(part.numel() * 4 <= 64 for part in parts)
    assert [m.get("name") for m in messages if "part" in m].count("e") == 1
    assert messages[0] == {"meta": {}} and messages[-1] == {"done": True}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_a_gpu_tensor_is_sent_from_one_cpu_copy() -> None:
    messages: list[Message] = []

    async def record(message: Message) -> None:
        messages.append(message)

    tensor = _tensor((4, 33), torch.float32, seed=9).cuda()
    await send_tensors(record, {}, {"t": tensor}, chunk_bytes=64)
    parts = [m["part"] for m in messages if m.get("name") == "t"]
    assert len(parts) > 1 and all(part.device.type == "cpu" for part in parts)
    assert len({part.untyped_storage().data_ptr() for part in parts}) == 1
    assert torch.equal(torch.cat(parts).view(4, 33), tensor.cpu())


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=0, max_size=MAX_TENSORS),
    chunk_bytes=st.integers(1, 200),
    through_codec=st.booleans(),
)
def test_round_trip_property(
    specs: list[tuple[tuple[int, ...], torch.dtype]], chunk_bytes: int, through_codec: bool
) -> None:
    sent: dict[str, torch.Tensor | None] = {
        f"t{index}": _tensor(shape, dtype, index) for index, (shape, dtype) in enumerate(specs)
    }

    async def main() -> None:
        _, received = await _transfer(sent, chunk_bytes=chunk_bytes, through_codec=through_codec)
        _assert_same(received, sent)

    trio.run(main)


# -- malformed transfers ---------------------------------------------------------------------------


def _valid_messages(
    specs: list[tuple[tuple[int, ...], torch.dtype]], chunk_bytes: int
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def record(message: Message) -> None:
        messages.append(dict(message))

    tensors = {f"t{i}": _tensor(shape, dtype, i) for i, (shape, dtype) in enumerate(specs)}
    trio.run(lambda: send_tensors(record, {"blocks": [0, 1]}, tensors, chunk_bytes=chunk_bytes))
    return messages


def _part_indices(messages: list[dict[str, Any]], name: str) -> list[int]:
    return [i for i, message in enumerate(messages) if message.get("name") == name]


def _other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype != torch.float64 else torch.float32


Mutation = Callable[[list[dict[str, Any]], st.DataObject], tuple[list[dict[str, Any]], int]]


def _missing_meta(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    first = data.draw(st.sampled_from([None, {"meta": [1]}, {"meta": "x"}, {"done": True}]))
    return ([] if first is None else [first]) + messages[1:], 1 << 20


def _overrun(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    """A copy of one of t0's parts inserted anywhere after t0 began: more than its shape holds."""
    indices = _part_indices(messages, "t0")
    copy = messages[data.draw(st.sampled_from(indices))]
    at = data.draw(st.integers(indices[0] + 1, len(messages) - 1))
    return [*messages[:at], copy, *messages[at:]], 1 << 20


def _shape_change(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    indices = _part_indices(messages, "t0")
    index = data.draw(st.sampled_from(indices[1:] or [len(messages) - 1]))
    first = messages[indices[0]]
    changed = {**first, "shape": [*first["shape"], 1]}
    return [*messages[:index], changed, *messages[index:]], 1 << 20


def _dtype_change(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    indices = _part_indices(messages, "t0")
    index = data.draw(st.sampled_from(indices[1:] or [len(messages) - 1]))
    first = messages[indices[0]]
    changed = {**first, "part": first["part"][:1].to(_other_dtype(first["part"].dtype))}
    return [*messages[:index], changed, *messages[index:]], 1 << 20


def _too_many_tensors(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    extra = [
        {"name": f"extra{i}", "shape": [1], "part": torch.zeros(1)}
        for i in range(MAX_TENSORS + 1 - len({m.get("name") for m in messages} - {None}))
    ]
    return [*messages[:-1], *extra, messages[-1]], 1 << 20


def _incomplete(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    """One of t0's parts loses its last element."""
    index = data.draw(st.sampled_from(_part_indices(messages, "t0")))
    shortened = {**messages[index], "part": messages[index]["part"][:-1]}
    return [*messages[:index], shortened, *messages[index + 1 :]], 1 << 20


def _too_many_elements(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    total = sum(math.prod(m["shape"]) for i, m in enumerate(messages) if _first_part(messages, i))
    return messages, data.draw(st.integers(0, total - 1))


def _garbage_part(messages: list[dict[str, Any]], data: st.DataObject) -> tuple[Any, int]:
    index = data.draw(st.sampled_from(_part_indices(messages, "t0")))
    broken = dict(messages[index])
    field, value = data.draw(
        st.sampled_from(
            [
                ("name", 3),
                ("name", None),
                ("part", [1.0, 2.0]),
                ("part", torch.zeros(1, 1)),
                ("part", None),
                ("shape", [-1]),
                ("shape", [True]),
                ("shape", "2"),
                ("shape", [1] * 9),
            ]
        )
    )
    broken[field] = value
    return [*messages[:index], broken, *messages[index + 1 :]], 1 << 20


def _first_part(messages: list[dict[str, Any]], index: int) -> bool:
    name = messages[index].get("name")
    return name is not None and _part_indices(messages, name)[0] == index


#: name: (mutation, what the error says)
MUTATIONS: dict[str, tuple[Mutation, str]] = {
    "missing meta": (_missing_meta, "starts with {'meta'"),
    "overrun": (_overrun, "overrun its declared shape"),
    "shape change": (_shape_change, "parts declare different shapes"),
    "dtype change": (_dtype_change, "parts of different dtypes"),
    "too many tensors": (_too_many_tensors, f"more than {MAX_TENSORS} tensors"),
    "incomplete": (_incomplete, "is incomplete"),
    "too many elements": (_too_many_elements, "elements in all"),
    "garbage part": (_garbage_part, "shape"),
}

nonempty_shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@settings(max_examples=25, deadline=None)
@given(
    first=st.tuples(nonempty_shapes, st.sampled_from(DTYPES)),
    others=st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), max_size=3),
    chunk_bytes=st.integers(1, 40),
    data=st.data(),
)
def test_malformed_transfers_raise_only_codec_error(
    mutation: str,
    first: tuple[tuple[int, ...], torch.dtype],
    others: list[tuple[tuple[int, ...], torch.dtype]],
    chunk_bytes: int,
    data: st.DataObject,
) -> None:
    """``t0`` is never empty, so every mutation has a part to work on."""
    mutate, says = MUTATIONS[mutation]
    messages, max_elements = mutate(_valid_messages([first, *others], chunk_bytes), data)
    remaining = list(messages)

    async def receive() -> Message:
        if not remaining:
            raise AssertionError("the receiver read past the last message without refusing")
        return remaining.pop(0)

    with pytest.raises(CodecError, match=re.escape(says)):
        trio.run(lambda: receive_tensors(receive, max_elements=max_elements))
