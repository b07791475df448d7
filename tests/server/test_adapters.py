"""A server with a LoRA adapter, end to end: the adapter is chosen per request.

The adapter is a PEFT-format folder written by hand (``tests/models/test_lora.py``), loaded by a
real server on loopback; every output is compared with local blocks whose weights were merged,
``W + scaling * B @ A``, or with the plain blocks when no adapter is asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from petals_core import RemoteError
from petals_core.models import LlamaBlock

from ..models.conftest import TinyCheckpoint, tiny_llama_config
from ..models.test_lora import LLAMA_LINEARS, merged, write_adapter
from ._client import (
    connect,
    forward,
    info,
    local_blocks as load_local_blocks,
    open_raw_session,
    run_local,
    serve,
    session,
)

START, END = 1, 4
RANK, ALPHA = 4, 8.0
SCALING = ALPHA / RANK
DEADLINE_S = 30.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def hidden_states(seed: int) -> torch.Tensor:
    return torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(seed))  # (B, T, hidden)


async def test_adapter_is_chosen_per_request(
    server_llama: TinyCheckpoint, cache_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "lora"
    weights = write_adapter(folder, tiny_llama_config(), LLAMA_LINEARS, rank=RANK, alpha=ALPHA)
    name = str(folder)
    base = load_local_blocks(server_llama, START, END)
    adapted: list[LlamaBlock] = [
        merged(block, weights, index, SCALING, LLAMA_LINEARS)  # type: ignore[misc]
        for index, block in zip(range(START, END), base, strict=True)
    ]
    x = hidden_states(0)
    with torch.no_grad():
        expected_base = run_local(base, x)
        expected_adapted = run_local(adapted, x)
    assert not torch.allclose(expected_base, expected_adapted, atol=1e-3)  # the adapter matters

    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(START, END), adapters=(name,)) as server,
            connect(server) as connection,
        ):
            # What it holds: in petals.info and in its announcement.
            assert (await info(connection)).adapters == (name,)
            own = str(server.dht.peer_id)
            snapshot = await server.topic.wait_snapshot(
                lambda s: (
                    own in s.servers_for(START) and s.servers_for(START)[own].adapters == (name,)
                )
            )
            assert all(snapshot.servers_for(b)[own].adapters == (name,) for b in range(START, END))

            # Forward passes.
            adapter = {"active_adapter": name}
            assert_close(await forward(connection, (START, END), x, meta=adapter), expected_adapted)
            assert_close(await forward(connection, (START, END), x), expected_base)
            # A part of the span: the adapter of those blocks only.
            with torch.no_grad():
                expected_part = run_local(adapted[1:], x)
            assert_close(
                await forward(connection, (START + 1, END), x, meta=adapter), expected_part
            )

            # Sessions: a prefill then one more position, with and without the adapter, open at
            # once (their single-position steps are not batched together: different adapters).
            async with (
                session(
                    connection,
                    blocks=(START, END),
                    max_length=8,
                    session_id="adapted",
                    batch_size=2,
                    active_adapter=name,
                ) as with_adapter,
                session(
                    connection, blocks=(START, END), max_length=8, session_id="base", batch_size=2
                ) as without,
            ):
                outputs: dict[str, list[torch.Tensor]] = {"adapted": [], "base": []}
                for part in (x[:, :4], x[:, 4:]):
                    outputs["adapted"].append(await with_adapter.step(part))
                    outputs["base"].append(await without.step(part))
            assert_close(torch.cat(outputs["adapted"], dim=1), expected_adapted)
            assert_close(torch.cat(outputs["base"], dim=1), expected_base)


async def test_unknown_adapter_is_refused(
    server_llama: TinyCheckpoint, cache_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "lora"
    write_adapter(folder, tiny_llama_config(), LLAMA_LINEARS, rank=RANK, alpha=ALPHA)
    name = str(folder)
    unknown = str(tmp_path / "other")
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=(START, END), adapters=(name,)) as server,
            connect(server) as connection,
        ):
            opening = {
                "session_id": "unknown",
                "blocks": [START, END],
                "max_length": 8,
                "active_adapter": unknown,
            }
            with pytest.raises(RemoteError) as raised:
                await open_raw_session(connection, opening)
            assert raised.value.remote_type == "AdapterError"
            assert unknown in raised.value.remote_message
            assert name in raised.value.remote_message  # it says which adapters it holds

            with pytest.raises(RemoteError) as raised:
                await forward(
                    connection, (START, END), hidden_states(1), meta={"active_adapter": unknown}
                )
            assert f"unknown adapter {unknown!r}" in raised.value.remote_message

            # Nothing was left behind: the server still serves both kinds of request.
            assert server.block_server.open_sessions == 0
            output = await forward(
                connection, (START, END), hidden_states(1), meta={"active_adapter": name}
            )
            assert output.shape == (2, 5, 64)
