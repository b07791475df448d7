"""The registry of models: entries round-trip, malformed ones are refused (test_records fuzzes
the decoder with the announcements'), and the entries filed on a loopback swarm are read back by
any node, junk under the key left out."""

from __future__ import annotations

from typing import Any

import attrs
import cbor2
import pytest
import trio

from petals_core._errors import CodecError, LocalProtocolError
from petals_core.dht import MAX_MODEL_BLOCKS, MODELS_KEY, ModelInfo, get_models, register_model

from ._swarm import FakeClock, swarm

DEADLINE_S = 60
LLAMA = ModelInfo(num_blocks=32, repository="meta-llama/Llama-2-7b-hf", model_type="llama")


def test_model_info_round_trips_and_leaves_out_what_is_unknown() -> None:
    assert ModelInfo.from_bytes_untrusted(LLAMA.to_bytes()) == LLAMA
    local = ModelInfo(num_blocks=6)
    assert cbor2.loads(local.to_bytes()) == {"num_blocks": 6}
    assert ModelInfo.from_bytes_untrusted(local.to_bytes()) == local


def test_readers_ignore_unknown_fields_and_nulls() -> None:
    message = cbor2.loads(LLAMA.to_bytes()) | {"new_field": [1, {"x": b"y"}], "model_type": None}
    assert ModelInfo.from_bytes_untrusted(cbor2.dumps(message)) == attrs.evolve(
        LLAMA, model_type=None
    )


@pytest.mark.parametrize(
    "change",
    [
        {"num_blocks": 0},
        {"num_blocks": -1},
        {"num_blocks": MAX_MODEL_BLOCKS + 1},
        {"num_blocks": 2**64},
        {"num_blocks": 6.0},
        {"num_blocks": True},
        {"num_blocks": "6"},
        {"repository": 7},
        {"repository": "r" * 257},
        {"model_type": ["llama"]},
    ],
)
def test_malformed_model_info_is_refused(change: dict[str, Any]) -> None:
    message = cbor2.loads(LLAMA.to_bytes()) | change
    with pytest.raises(CodecError):
        ModelInfo.from_bytes_untrusted(cbor2.dumps(message))
    with pytest.raises(LocalProtocolError):
        ModelInfo(**{**attrs.asdict(LLAMA), **change})


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff", cbor2.dumps([6]), cbor2.dumps({"repository": "a/b"}), b"\xa1" * 5000],
)
def test_model_info_that_is_not_a_map_of_fields_is_refused(data: bytes) -> None:
    with pytest.raises(CodecError):
        ModelInfo.from_bytes_untrusted(data)


async def test_registered_models_are_read_back_by_any_node_and_junk_is_left_out() -> None:
    clock = FakeClock()
    with trio.fail_after(DEADLINE_S):
        async with swarm(clock, 4, with_client=True) as (nodes, client):
            assert client is not None
            assert await get_models(client) == {}
            bloom = ModelInfo(num_blocks=24, repository="bigscience/bloom-560m")
            assert await register_model(nodes[1], "llama-2-7b", LLAMA, expiration=clock.now + 60)
            assert await register_model(nodes[2], "bloom-560m", bloom, expiration=clock.now + 30)
            # Whoever stores junk under the key does not take a model's place.
            junk = cbor2.dumps({"num_blocks": 10**9})
            assert await nodes[3].store(MODELS_KEY, junk, clock.now + 60, subkey="junk")

            assert await get_models(client) == {"llama-2-7b": LLAMA, "bloom-560m": bloom}
            # A later entry for the same model replaces the earlier one.
            bigger = attrs.evolve(LLAMA, num_blocks=40)
            assert await register_model(nodes[2], "llama-2-7b", bigger, expiration=clock.now + 90)
            assert (await get_models(nodes[3]))["llama-2-7b"] == bigger

            clock.now += 45  # bloom's entry expires
            assert set(await get_models(client)) == {"llama-2-7b"}
