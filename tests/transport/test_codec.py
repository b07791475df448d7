"""Wire codec: round trips, compression bounds, limits, and hostile bytes that must only ever
raise CodecError."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import attrs
import cbor2
import pytest
import torch
from hypothesis import given, settings, strategies as st

from petals_core._errors import CodecError
from petals_core.transport import (
    CodecLimits,
    Compressed,
    FrameDecoder,
    RawTensor,
    compress,
    decode_message_untrusted,
    encode_frame,
    encode_message,
)
from petals_core.transport._codec import _TagDecoders
from petals_core.transport._codec_format import DEFAULT_LIMITS, DTYPES

REPO_ROOT = Path(__file__).resolve().parents[2]
TENSOR_TAG = 42_000
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(), (0,), (3, 0, 2), (1,), (1, 1, 1), (7,), (2, 3, 4), (300, 257)]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=25,
)
messages = st.dictionaries(st.text(max_size=8), values, max_size=5)


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=generator, dtype=dtype)


def round_trip(msg: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return decode_message_untrusted(encode_message(msg), **kwargs)


def tagged(fields: list[Any]) -> bytes:
    """A message holding one hand-made tensor (for inputs our encoder refuses to produce)."""
    return cbor2.dumps({"t": cbor2.CBORTag(TENSOR_TAG, fields)})


def assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.device.type == "cpu"
    # Compare bits so that NaN payloads and -0.0 count.
    assert bytes(actual.contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
        expected.contiguous().view(-1).view(torch.uint8).numpy()
    )


# Round trips


@settings(max_examples=200, deadline=None)
@given(messages)
def test_message_round_trip(msg: dict[str, Any]) -> None:
    assert round_trip(msg) == msg


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=8), values | st.just(float("nan")), max_size=5))
def test_encoding_is_what_cbor2_writes(msg: dict[str, Any]) -> None:
    # The writer is our own; the bytes are the ones cbor2 writes for the same values.
    assert encode_message(msg) == cbor2.dumps(msg)
    assert encode_frame(msg) == len(cbor2.dumps(msg)).to_bytes(4, "big") + cbor2.dumps(msg)


def test_tensor_encoding_is_what_cbor2_writes() -> None:
    tensor = sample(torch.float32, (2, 3, 300))
    data = tensor.numpy().tobytes()
    expected = cbor2.dumps(
        {"t": cbor2.CBORTag(TENSOR_TAG, ["float32", [2, 3, 300], data]), "n": [1, -5, 2**40]}
    )
    assert encode_message({"t": tensor, "n": (1, -5, 2**40)}) == expected


def test_nested_structures_and_buffers() -> None:
    msg = {
        "nested": {"a": [1, (2, 3), {"b": [[], {}]}], "c": None},
        "buffers": [bytearray(b"xy"), memoryview(b"zw")],
        "floats": [0.0, -0.0, float("inf"), 1e-300],
    }
    assert round_trip(msg) == {
        "nested": {"a": [1, [2, 3], {"b": [[], {}]}], "c": None},
        "buffers": [b"xy", b"zw"],
        "floats": [0.0, -0.0, float("inf"), 1e-300],
    }


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    tensor = sample(getattr(torch, dtype), shape)
    decoded = round_trip({"t": tensor, "in": [{"t": tensor}]})
    assert_same_tensor(decoded["t"], tensor)
    assert_same_tensor(decoded["in"][0]["t"], tensor)


@pytest.mark.parametrize(
    "make",
    [
        lambda: sample(torch.float32, (5, 7)).T,
        lambda: sample(torch.int64, (20,))[::3],
        lambda: sample(torch.bfloat16, (1, 4)).expand(6, 4),
        lambda: sample(torch.float16, (4, 5, 6)).permute(2, 0, 1)[1:],
        lambda: torch.nn.Parameter(sample(torch.float32, (3,))),
        lambda: torch.ones(3, requires_grad=True) * 2,
    ],
)
def test_tensor_views_and_autograd_tensors(make: Any) -> None:
    tensor = make()
    assert_same_tensor(round_trip({"t": tensor})["t"], tensor.detach().contiguous())


def test_special_float_bits_survive() -> None:
    bits = torch.randint(-(2**15), 2**15, (70_000,), dtype=torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        tensor = bits.view(dtype)  # every bit pattern: NaN payloads, infinities, subnormals
        assert_same_tensor(round_trip({"t": tensor})["t"], tensor)
    words = torch.randint(-(2**31), 2**31, (5000,), dtype=torch.int64).to(torch.int32)
    assert_same_tensor(round_trip({"t": words.view(torch.float32)})["t"], words.view(torch.float32))


def test_small_decoded_tensors_are_private_copies() -> None:
    # CPython shares one-byte bytes objects; writing through a tensor over one would corrupt it.
    decoded = round_trip({"t": torch.zeros(1, dtype=torch.uint8)})["t"]
    decoded.add_(7)
    assert bytes([0]) == b"\x00"


def test_large_decoded_tensors_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoded = round_trip({"t": torch.arange(100_000, dtype=torch.float32)})["t"]
    assert float(decoded[-1]) == 99_999


def test_raw_tensors_round_trip() -> None:
    raw = RawTensor("bfloat16", [2, 3], bytes(range(12)))
    assert raw.shape == (2, 3)
    decoded = round_trip({"t": raw, "list": [raw]}, tensors="raw")
    assert decoded == {"t": raw, "list": [raw]}
    as_torch = round_trip({"t": raw})["t"]
    assert as_torch.dtype == torch.bfloat16
    assert bytes(as_torch.view(-1).view(torch.uint8).numpy()) == bytes(range(12))
    assert RawTensor("float32", (2,), memoryview(bytearray(8))).numel == 2


def test_torch_tensors_decode_raw() -> None:
    tensor = sample(torch.int32, (3, 4))
    raw = round_trip({"t": tensor}, tensors="raw")["t"]
    assert raw == RawTensor("int32", (3, 4), tensor.numpy().tobytes())
    assert_same_tensor(raw.to_torch(), tensor)


def test_codec_works_without_torch() -> None:
    script = """
import sys
sys.modules["torch"] = None  # any attempt to import torch now fails
import petals_core.transport as codec

raw = codec.RawTensor("float16", (2, 2), bytes(8))
squeezed = codec.RawTensor("float32", (3,), bytes(6), compression="float16")
frame = codec.encode_frame({"t": raw, "c": [squeezed], "n": 1})
decoder = codec.FrameDecoder()
decoder.feed(frame)
message = codec.decode_message_untrusted(decoder.next_frame(), tensors="raw")
assert message == {"t": raw, "c": [squeezed], "n": 1}, message
"""
    subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True)


def test_import_does_not_import_torch() -> None:
    check = "import petals_core.transport._codec, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, check=True)


# Compression


def blockwise_absmax(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1).float()
    blocks = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 256)).view(-1, 256)
    absmax = blocks.abs().amax(dim=1, keepdim=True).expand(-1, 256).reshape(-1)
    return absmax[: flat.numel()].view(tensor.shape)


def check_blockwise8(tensor: torch.Tensor) -> None:
    decoded = round_trip({"t": compress(tensor, "blockwise8")})["t"]
    assert decoded.dtype == tensor.dtype
    assert decoded.shape == tensor.shape
    error = (decoded.float() - tensor.float()).abs()
    # Scales of blocks with absmax below 127 * tiny underflow and decode as zeros (documented).
    underflow = 127 * torch.finfo(torch.float32).tiny
    rounding = torch.finfo(tensor.dtype).eps * decoded.float().abs() + underflow
    absmax = blockwise_absmax(tensor)
    assert bool((error <= absmax / 127 + rounding).all())
    # The documented bound before rounding to the dtype: half a quantization step.
    assert bool((error <= absmax / 254 * (1 + 1e-4) + rounding).all())


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (255,), (256,), (257,), (3, 1000), (2, 0, 5)], ids=str)
def test_blockwise8_error_bound(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = sample(dtype, shape)
    if tensor.numel() > 300:
        tensor.view(-1)[:256] = 0  # an all-zero block
        tensor.view(-1)[300] = 1e4  # a block with a large outlier
    check_blockwise8(tensor)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=700))
def test_blockwise8_error_bound_random(items: list[float]) -> None:
    check_blockwise8(torch.tensor(items, dtype=torch.float32))


def test_blockwise8_zero_block_is_exact_and_payload_is_small() -> None:
    tensor = torch.zeros(1000)
    tensor[700] = -3.5
    frame = encode_message({"t": compress(tensor, "blockwise8")})
    assert len(frame) < 1000 + 4 * 4 + 64
    assert torch.equal(decode_message_untrusted(frame)["t"], tensor)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_float16_compression(dtype: torch.dtype) -> None:
    tensor = sample(dtype, (33, 17))
    decoded = round_trip({"t": Compressed(tensor.T, "float16")})["t"]
    assert decoded.dtype == dtype
    assert decoded.shape == (17, 33)
    expected = tensor.T.to(torch.float16).to(dtype)
    assert torch.equal(decoded, expected)
    relative = ((decoded.float() - tensor.T.float()).abs() / tensor.T.float().abs()).max()
    assert float(relative) <= 2**-11


def test_compressed_tensors_relay_unchanged_as_raw() -> None:
    msg = {"a": compress(sample(torch.bfloat16, (3, 300)), "blockwise8")}
    msg["b"] = compress(sample(torch.float32, (5,)), "float16")
    frame = encode_message(msg)
    relayed = decode_message_untrusted(frame, tensors="raw")
    assert relayed["a"].compression == "blockwise8"
    assert relayed["a"].shape == (3, 300)
    assert encode_message(relayed) == frame
    direct = decode_message_untrusted(frame)
    assert_same_tensor(relayed["a"].to_torch(), direct["a"])
    assert_same_tensor(relayed["b"].to_torch(), direct["b"])


def test_compression_refusals() -> None:
    with pytest.raises(CodecError, match="finite"):
        encode_message({"t": compress(torch.tensor([1.0, float("nan")]), "blockwise8")})
    with pytest.raises(CodecError, match="compressed"):
        compress(torch.arange(4), "float16")
    with pytest.raises(CodecError, match="compressed"):
        compress(torch.zeros(2, dtype=torch.float64), "blockwise8")
    with pytest.raises(CodecError, match="scheme"):
        compress(torch.zeros(2), "zip")  # type: ignore[arg-type]


# Encoding errors


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        object(),
        datetime.datetime(2026, 1, 2, 3, 4, 5),
        1j,
        2**64,
        -(2**64) - 1,
        "\ud800",
        {1: "non-str key"},
        {"a": {b"k": 1}},
        torch.zeros(2, dtype=torch.float64),
        torch.zeros(2, dtype=torch.complex64),
        torch.zeros(3).to_sparse(),
        torch.empty(3, device="meta"),
        RawTensor,
    ],
    # Named the same in every process (pytest-xdist's workers must collect the same tests).
    ids=lambda value: "object()" if type(value) is object else repr(value),
)
def test_unencodable_values(value: Any) -> None:
    with pytest.raises(CodecError):
        encode_message({"v": value})


def test_top_level_must_be_a_mapping() -> None:
    with pytest.raises(CodecError):
        encode_message([1, 2])  # type: ignore[arg-type]


def test_invalid_raw_tensors() -> None:
    with pytest.raises(CodecError, match="dtype"):
        RawTensor("float64", (1,), bytes(8))
    with pytest.raises(CodecError, match="shape"):
        RawTensor("uint8", (-1,), b"")
    with pytest.raises(CodecError, match="needs"):
        RawTensor("int32", (2,), bytes(7))
    with pytest.raises(CodecError, match="compressed"):
        RawTensor("int8", (2,), bytes(2), compression="blockwise8")
    with pytest.raises(CodecError, match="needs"):
        RawTensor("float32", (300,), bytes(300), compression="blockwise8", scales=bytes(4))


@pytest.mark.parametrize(
    ("limits", "msg"),
    [
        (CodecLimits(max_depth=3), {"a": [[[1]]]}),
        (CodecLimits(max_depth=2), {"t": torch.zeros(1)}),
        (CodecLimits(max_container_items=5), {"a": list(range(5))}),
        (CodecLimits(max_container_items=9), {"t": torch.zeros(2, 3, 4, 5, 6, 7)}),
        (CodecLimits(max_string_bytes=3), {"abcd": 1}),
        (CodecLimits(max_string_bytes=3), {"a": "é" * 2}),
        (CodecLimits(max_tensor_dims=2), {"t": torch.zeros(1, 1, 1)}),
        (CodecLimits(max_tensor_elements=10), {"t": torch.zeros(11)}),
        (CodecLimits(max_frame_bytes=100), {"b": bytes(100)}),
    ],
)
def test_encoder_applies_the_decoder_limits(limits: CodecLimits, msg: dict[str, Any]) -> None:
    with pytest.raises(CodecError):
        encode_message(msg, limits=limits)
    with pytest.raises(CodecError):
        decode_message_untrusted(encode_message(msg), limits=limits)


small_limits = CodecLimits(max_depth=4, max_container_items=12, max_string_bytes=6)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_what_encodes_decodes_under_the_same_limits(msg: dict[str, Any]) -> None:
    try:
        frame = encode_message(msg, limits=small_limits)
    except CodecError:
        return
    assert decode_message_untrusted(frame, limits=small_limits) == msg


def test_tensor_at_the_deepest_level_decodes() -> None:
    limits = CodecLimits(max_depth=6)
    msg = {"a": [[{"t": torch.arange(3)}]]}  # map, list, list, map, then tensor array and shape
    decoded = decode_message_untrusted(encode_message(msg, limits=limits), limits=limits)
    assert torch.equal(decoded["a"][0][0]["t"], torch.arange(3))
    with pytest.raises(CodecError):
        encode_message({"a": [[[{"t": torch.arange(3)}]]]}, limits=limits)


def test_limits_are_validated() -> None:
    assert attrs.evolve(DEFAULT_LIMITS, max_depth=8).max_depth == 8
    for bad in ({"max_depth": 0}, {"max_frame_bytes": 2**32}, {"max_tensor_dims": -1}):
        with pytest.raises(ValueError, match="must be"):
            CodecLimits(**bad)
    with pytest.raises(TypeError):
        CodecLimits(max_string_bytes=1.5)  # type: ignore[arg-type]


def test_limits_without_tensors_refuse_any_tensor_but_a_scalar_and_keep_the_rest() -> None:
    limits = CodecLimits(max_depth=3, max_string_bytes=10).without_tensors()
    assert (limits.max_depth, limits.max_string_bytes) == (3, 10)
    scalar = decode_message_untrusted(encode_message({"t": torch.tensor(2.0)}), limits=limits)
    assert scalar["t"] == torch.tensor(2.0)
    for tensor in (torch.zeros(1), torch.zeros(2, 2)):
        frame = encode_message({"t": tensor})
        with pytest.raises(CodecError, match="tensor"):
            decode_message_untrusted(frame, limits=limits)


# Decoding hostile bytes


def nested_lists(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = {
    "empty": b"",
    "array at top": cbor2.dumps([1, 2]),
    "int at top": cbor2.dumps(5),
    "text at top": cbor2.dumps("x"),
    "too deep": cbor2.dumps({"a": nested_lists(DEFAULT_LIMITS.max_depth)}),
    "very deep": b"\xa1\x61a" + b"\x81" * 100_000 + b"\x00",
    "int key": cbor2.dumps({1: 2}),
    "bytes key": cbor2.dumps({"a": {b"k": 1}}),
    "undefined": cbor2.dumps({"a": cbor2.undefined}),
    "simple value": cbor2.dumps({"a": cbor2.CBORSimpleValue(5)}),
    "break at top": b"\xff",
    "indefinite map": bytes.fromhex("bf616101ff"),
    "indefinite array": bytes.fromhex("a1616b9f01ff"),
    "indefinite bytes": bytes.fromhex("a1616b5f4101ff"),
    "trailing bytes": cbor2.dumps({"a": 1}) + b"\x00",
    "duplicate keys": bytes.fromhex("a2616101616102"),
    "truncated": cbor2.dumps({"a": "hello"})[:-1],
    "huge array length": b"\xa1\x61a\x9b" + b"\xff" * 8,
    "huge map length": b"\xbb" + b"\xff" * 8,
    "huge bytes length": b"\xa1\x61a\x5b" + b"\x00\x00\x00\x00\xff\xff\xff\xff" + b"abc",
    "huge text length": b"\xa1\x61a\x7b" + b"\x7f" + b"\xff" * 7,
    "bad utf-8": b"\xa1\x61a\x62\xff\xfe",
    "reserved head": b"\xa1\x61a\x1c",
    "bignum": cbor2.dumps({"a": 2**70}),
    "datetime": cbor2.dumps({"a": datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)}),
    "set": cbor2.dumps({"a": {1, 2}}),
    "regex": bytes.fromhex("a16161d823626128"),
    "shared reference": cbor2.dumps({"a": [[1], [1]]}, value_sharing=True),
    "string reference": cbor2.dumps({"a": ["xyzw", "xyzw"]}, string_referencing=True),
    "unknown tag": cbor2.dumps({"a": cbor2.CBORTag(1234, 1)}),
    "tag as key": bytes.fromhex("a1d9a410836166800001"),
    "tensor not array": cbor2.dumps({"t": cbor2.CBORTag(TENSOR_TAG, "x")}),
    "tensor of 4 fields": tagged(["float32", [1], bytes(4), "float16"]),
    "tensor in tensor": tagged(["float32", [cbor2.CBORTag(TENSOR_TAG, [])], bytes(4)]),
    "unknown dtype": tagged(["float64", [1], bytes(8)]),
    "long dtype": tagged(["f" * 100, [1], bytes(8)]),
    "dtype not text": tagged([b"float32", [1], bytes(4)]),
    "shape not array": tagged(["float32", 1, bytes(4)]),
    "negative shape": tagged(["float32", [-1], b""]),
    "float shape": tagged(["float32", [1.0], bytes(4)]),
    "huge shape": tagged(["float32", [2**40, 2**40], b""]),
    "too many elements": tagged(["uint8", [2**31 + 1], b""]),
    "too many dims": tagged(["float32", [1] * 9, bytes(4)]),
    "short data": tagged(["float32", [2], bytes(7)]),
    "long data": tagged(["float32", [2], bytes(9)]),
    "data not bytes": tagged(["float32", [1], "abcd"]),
    "bool not 0 or 1": tagged(["bool", [3], b"\x00\x01\x02"]),
    "unknown scheme": tagged(["float32", [2], bytes(2), "zip", b""]),
    "compressed int": tagged(["int32", [2], bytes(2), "blockwise8", bytes(4)]),
    "missing scales": tagged(["float32", [2], bytes(2), "blockwise8", b""]),
    "float16 with scales": tagged(["float32", [2], bytes(4), "float16", bytes(4)]),
}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_messages_raise_codec_error(data: bytes) -> None:
    started = time.monotonic()
    for tensors in ("torch", "raw"):
        with pytest.raises(CodecError):
            decode_message_untrusted(data, tensors=tensors)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("hex_cbor", ["d81c80", "d9010080", "d9010280", "c240", "d8236161"])
def test_no_cbor2_tag_decoder_is_reachable(hex_cbor: str) -> None:
    # The backstop behind the structure walk: shared and string references, sets, bignums and
    # regular expressions all meet our refusal instead of cbor2's decoders.
    with pytest.raises(cbor2.CBORDecodeError, match="semantic tag"):
        cbor2.loads(bytes.fromhex(hex_cbor), semantic_decoders=_TagDecoders(DEFAULT_LIMITS, "raw"))


def test_limits_on_decode() -> None:
    frame = encode_message({"a": list(range(100)), "s": "x" * 50})
    decode_message_untrusted(frame, limits=CodecLimits(max_container_items=102))
    with pytest.raises(CodecError, match="container items"):
        decode_message_untrusted(frame, limits=CodecLimits(max_container_items=101))
    with pytest.raises(CodecError, match="text"):
        decode_message_untrusted(frame, limits=CodecLimits(max_string_bytes=49))
    with pytest.raises(CodecError, match="exceeds"):
        decode_message_untrusted(frame, limits=CodecLimits(max_frame_bytes=len(frame) - 1))
    with pytest.raises(ValueError, match="numpy"):
        decode_message_untrusted(frame, tensors="numpy")  # type: ignore[arg-type]


def mutations(seed: bytes) -> st.SearchStrategy[bytes]:
    @st.composite
    def mutate(draw: st.DrawFn) -> bytes:
        data = bytearray(seed)
        for _ in range(draw(st.integers(1, 4))):
            where = draw(st.integers(0, len(data)))
            kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
            if kind == "truncate":
                del data[where:]
            elif kind == "insert":
                data[where:where] = draw(st.binary(min_size=1, max_size=9))
            elif where < len(data):
                if kind == "flip":
                    data[where] ^= 1 << draw(st.integers(0, 7))
                elif kind == "set":
                    data[where] = draw(st.integers(0, 255))
                else:
                    del data[where : where + draw(st.integers(1, 9))]
        return bytes(data)

    return mutate()


VALID = encode_message(
    {
        "i": [0, -1, 2**40, 1.5, True, None],
        "s": {"k": "text", "b": b"bytes"},
        "f": sample(torch.float32, (2, 3)),
        "bf": sample(torch.bfloat16, (4,)),
        "flags": sample(torch.bool, (5,)),
        "idx": sample(torch.int64, (2,)),
        "c8": compress(sample(torch.float32, (3,)), "blockwise8"),
        "c16": compress(sample(torch.bfloat16, (2,)), "float16"),
    }
)


def decode_or_codec_error(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> None:
    for tensors in ("torch", "raw"):
        try:
            message = decode_message_untrusted(data, limits=limits, tensors=tensors)
        except CodecError:
            continue
        assert isinstance(message, dict)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_codec_error(data: bytes) -> None:
    decode_or_codec_error(data)
    decode_or_codec_error(b"\xa1\x61a" + data, limits=small_limits)


@settings(max_examples=500, deadline=None)
@given(mutations(VALID))
def test_mutated_messages_raise_only_codec_error(data: bytes) -> None:
    decode_or_codec_error(data)
    decode_or_codec_error(data, limits=small_limits)


@settings(max_examples=200, deadline=None)
@given(mutations(encode_frame({"x": 1}) + encode_frame({"y": [1.5]}) + VALID), st.data())
def test_mutated_streams_raise_only_codec_error(stream: bytes, data: st.DataObject) -> None:
    decoder = FrameDecoder(CodecLimits(max_frame_bytes=4096))
    try:
        position = 0
        while position < len(stream):
            step = data.draw(st.integers(1, 64))
            decoder.feed(stream[position : position + step])
            position += step
            while (frame := decoder.next_frame()) is not None:
                decode_or_codec_error(frame)
    except CodecError:
        pass


# Framing


def test_frames_split_anywhere() -> None:
    frames = [encode_frame({"n": n, "pad": "x" * n}) for n in range(5)]
    stream = b"".join(frames)
    decoder = FrameDecoder()
    received = []
    for byte in range(len(stream)):
        decoder.feed(stream[byte : byte + 1])
        while (frame := decoder.next_frame()) is not None:
            received.append(decode_message_untrusted(frame))
    assert received == [{"n": n, "pad": "x" * n} for n in range(5)]
    assert decoder.buffered_bytes == 0


def test_truncated_frame_yields_none_until_complete() -> None:
    frame = encode_frame({"a": list(range(50))})
    decoder = FrameDecoder()
    decoder.feed(frame[:2])
    assert decoder.next_frame() is None
    decoder.feed(memoryview(frame)[2:-1])
    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == len(frame) - 1
    decoder.feed(frame[-1:] + frame[:5])  # the end of this frame and the start of the next
    assert decoder.next_frame() == frame[4:]
    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == 5


def test_several_frames_in_one_feed_and_empty_frames() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame({"a": 1}) + b"\x00\x00\x00\x00" + encode_frame({"b": 2}))
    assert decode_message_untrusted(decoder.next_frame() or b"") == {"a": 1}
    assert decoder.next_frame() == b""
    assert decode_message_untrusted(decoder.next_frame() or b"") == {"b": 2}
    assert decoder.next_frame() is None


def test_oversized_declared_length_is_refused_at_once() -> None:
    decoder = FrameDecoder(CodecLimits(max_frame_bytes=1000))
    decoder.feed(encode_frame({"a": 1}))
    with pytest.raises(CodecError, match="1001"):
        decoder.feed((1001).to_bytes(4, "big"))
    assert decode_message_untrusted(decoder.next_frame() or b"") == {"a": 1}
    with pytest.raises(CodecError):
        decoder.next_frame()
    with pytest.raises(CodecError):
        decoder.feed(bytes(1000))
    assert decoder.buffered_bytes == 4
    with pytest.raises(CodecError):
        FrameDecoder().feed(b"\xff\xff\xff\xff")


def test_bulk_frame_feeding_is_linear() -> None:
    payload = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    frame = memoryview(encode_frame({"x": payload}))
    decoder = FrameDecoder()
    started = time.monotonic()
    for offset in range(0, len(frame), 16 << 10):
        decoder.feed(frame[offset : offset + (16 << 10)])
        assert (offset + (16 << 10) >= len(frame)) or decoder.next_frame() is None
    elapsed = time.monotonic() - started
    received = decoder.next_frame()
    assert received is not None
    # Re-joining the buffer on every chunk would copy about 128 GiB: minutes, not this.
    assert elapsed < 10
    assert torch.equal(decode_message_untrusted(received)["x"], payload)


def test_compress_floats_marks_floating_point_tensors_only() -> None:
    import torch

    from petals_core.transport import Compressed, compress_floats

    message = {"hidden": torch.ones(2, 3), "ids": torch.tensor([1, 2]), "n": 3}
    assert compress_floats(message, None) is message
    marked = compress_floats(message, "float16")
    assert isinstance(marked["hidden"], Compressed) and marked["hidden"].scheme == "float16"
    assert marked["ids"] is message["ids"] and marked["n"] == 3
    decoded = decode_message_untrusted(encode_message(marked))
    assert torch.equal(decoded["hidden"], message["hidden"])
