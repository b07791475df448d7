"""A raw client of the block RPCs for the server tests, and the local blocks they compare with.

Everything goes over the real transport to a real server on loopback (:func:`serve`); the
reference results come from :class:`LlamaBlock` objects loaded from the same checkpoint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from petals_core.models import KVCache, LlamaBlock
from petals_core.protocol import (
    BACKWARD,
    DEFAULT_CHUNK_BYTES,
    FORWARD,
    INFERENCE,
    INFO,
    InfoReply,
    InfoRequest,
    receive_tensors,
    send_tensors,
)
from petals_core.server import Server, ServerConfig, ServingLimits, open_server
from petals_core.transport import Call, CallEnded, Connection, call_unary, open_call, open_node

from ..models.conftest import TinyCheckpoint

#: What a reply may hold; far above anything these tests send.
MAX_ELEMENTS = 1 << 24
#: The tiny checkpoint's hidden size.
HIDDEN = 64
#: Generous: a whole test module takes seconds; this only turns a hang into a failure.
DEADLINE_S = 60.0


# -- servers ---------------------------------------------------------------------------------------


@asynccontextmanager
async def serve(
    checkpoint: TinyCheckpoint,
    cache_dir: Path,
    *,
    blocks: tuple[int, int] = (0, 6),
    limits: ServingLimits | None = None,
    **config: Any,
) -> AsyncIterator[Server]:
    """A server of ``blocks`` of ``checkpoint`` in fp32 on loopback, in a swarm of its own."""
    server_config = ServerConfig(
        model=str(checkpoint.folder),
        new_swarm=True,
        host="127.0.0.1",
        block_indices=blocks,
        throughput=1.0,
        torch_dtype="float32",
        device="cpu",
        cache_dir=str(cache_dir),
        limits=limits or ServingLimits(),
        **config,
    )
    async with open_server(server_config, seed=0) as server:
        yield server


@asynccontextmanager
async def connect(server: Server) -> AsyncIterator[Connection]:
    """A client node of its own connected to ``server``."""
    async with open_node(host="127.0.0.1") as node:
        yield await node.connect(server.multiaddrs[0])


@asynccontextmanager
async def serve_and_connect(
    checkpoint: TinyCheckpoint, cache_dir: Path, **serving: Any
) -> AsyncIterator[tuple[Server, Connection]]:
    """A server (:func:`serve`, given ``serving``) and a client connected to it."""
    async with serve(checkpoint, cache_dir, **serving) as server, connect(server) as connection:
        yield server, connection


async def info(connection: Connection) -> InfoReply:
    return InfoReply.from_wire_untrusted(
        await call_unary(connection, INFO, InfoRequest().to_wire())
    )


# -- inference sessions ----------------------------------------------------------------------------


class Session:
    """One open ``petals.inference`` call."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.position = 0

    async def step(self, hidden: torch.Tensor, **extra: Any) -> torch.Tensor:
        """Send ``hidden`` (B, T, H) with ``extra`` fields; returns the (B, T, H) output."""
        await self.call.send({"hidden_states": hidden, **extra})
        reply = await self.call.receive()
        self.position = reply["position"]
        output = reply["hidden_states"]
        assert isinstance(output, torch.Tensor)
        return output

    async def close(self) -> None:
        """End our side and wait for the server's end: its handler has returned by then, so the
        session's cache is back in the budget."""
        await self.call.send_eof()
        try:
            reply = await self.call.receive()
        except CallEnded:
            return
        raise AssertionError(f"the server sent {reply!r} after the session's end")


async def open_raw_session(connection: Connection, opening: dict[str, Any]) -> None:
    """Send exactly ``opening`` and wait for the answer (for tests of refused openings)."""
    async with open_call(connection, INFERENCE) as call:
        await call.send(opening)
        await call.receive()


@asynccontextmanager
async def session(
    connection: Connection,
    *,
    blocks: tuple[int, int],
    max_length: int,
    session_id: str,
    batch_size: int = 1,
    **extra: Any,
) -> AsyncIterator[Session]:
    """An open session; it is closed (and its cache freed) when the block ends normally."""
    async with open_call(connection, INFERENCE) as call:
        await call.send(
            {
                "session_id": session_id,
                "blocks": list(blocks),
                "max_length": max_length,
                "batch_size": batch_size,
                **extra,
            }
        )
        assert await call.receive() == {"ready": True, "position": 0}
        opened = Session(call)
        yield opened
        await opened.close()


@asynccontextmanager
async def served_session(
    checkpoint: TinyCheckpoint,
    cache_dir: Path,
    *,
    blocks: tuple[int, int],
    served: tuple[int, int] | None = None,
    limits: ServingLimits | None = None,
    **opening: Any,
) -> AsyncIterator[Session]:
    """A :func:`session` of ``blocks`` (``opening`` says the rest) on a server of its own, of
    blocks ``served`` (by default ``blocks``) of ``checkpoint`` under ``limits``."""
    serving = {"blocks": served or blocks, "limits": limits}
    async with (
        serve_and_connect(checkpoint, cache_dir, **serving) as (_, connection),
        session(connection, blocks=blocks, **{"session_id": "served", **opening}) as opened,
    ):
        yield opened


# -- forward / backward ----------------------------------------------------------------------------


async def forward(
    connection: Connection, blocks: tuple[int, int], hidden: torch.Tensor, **options: Any
) -> torch.Tensor:
    """The output of a forward (``options`` as for :func:`forward_with_meta`)."""
    output, _ = await forward_with_meta(connection, blocks, hidden, **options)
    return output


async def forward_with_meta(
    connection: Connection,
    blocks: tuple[int, int],
    hidden: torch.Tensor,
    *,
    prompts: torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    meta: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The output and the reply's meta (``kept`` for a forward kept for backward)."""
    async with open_call(connection, FORWARD) as call:
        await send_tensors(
            call.send,
            {"blocks": list(blocks), **(meta or {})},
            {"hidden_states": hidden, "prompts": prompts},
            chunk_bytes=chunk_bytes,
        )
        reply, tensors = await receive_tensors(call.receive, max_elements=MAX_ELEMENTS)
    assert set(tensors) == {"hidden_states"}
    return tensors["hidden_states"], reply


async def backward(
    connection: Connection,
    blocks: tuple[int, int],
    hidden: torch.Tensor | None,
    grad_outputs: torch.Tensor,
    *,
    prompts: torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    meta: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """The reply's tensors: ``grad_inputs`` and, with prompts, ``grad_prompts``."""
    async with open_call(connection, BACKWARD) as call:
        await send_tensors(
            call.send,
            {"blocks": list(blocks), **(meta or {})},
            {"hidden_states": hidden, "grad_outputs": grad_outputs, "prompts": prompts},
            chunk_bytes=chunk_bytes,
        )
        _, tensors = await receive_tensors(call.receive, max_elements=MAX_ELEMENTS)
    return tensors


async def check_serving(
    checkpoint: TinyCheckpoint,
    connection: Connection,
    *,
    blocks: tuple[int, int] = (2, 5),
    max_length: int = 4,
) -> None:
    """A new session over ``blocks`` computes what the local blocks compute."""
    hidden = torch.randn(1, max_length, HIDDEN)
    async with session(
        connection, blocks=blocks, max_length=max_length, session_id="check"
    ) as opened:
        output = torch.cat(
            [await opened.step(hidden[:, :-1]), await opened.step(hidden[:, -1:])], dim=1
        )
    assert_close(output, run_local(local_blocks(checkpoint, *blocks), hidden))


# -- the local reference ---------------------------------------------------------------------------


def local_blocks(checkpoint: TinyCheckpoint, start: int, end: int) -> list[LlamaBlock]:
    """Blocks ``start .. end - 1`` of ``checkpoint``, fp32, built from its saved tensors."""
    config = LlamaConfig.from_pretrained(checkpoint.folder)
    blocks = []
    for index in range(start, end):
        prefix = f"model.layers.{index}."
        block = LlamaBlock(config, layer_idx=index)
        block.load_state_dict(
            {
                name.removeprefix(prefix): tensor
                for name, tensor in checkpoint.state_dict.items()
                if name.startswith(prefix)
            }
        )
        block.eval()
        blocks.append(block)
    return blocks


def add_prompt(x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``x`` (B, T, H) with ``prompt`` (1 or B, P, H) added to its first P positions."""
    length = prompt.shape[1]
    return torch.cat([x[:, :length] + prompt, x[:, length:]], dim=1)


def run_local(
    blocks: Sequence[LlamaBlock], hidden: torch.Tensor, *, prompts: torch.Tensor | None = None
) -> torch.Tensor:
    """The whole sequence through ``blocks`` without a cache (autograd works through it);
    ``prompts`` (len(blocks), 1 or B, P, H) are added before each block."""
    x = hidden
    for index, block in enumerate(blocks):
        if prompts is not None:
            x = add_prompt(x, prompts[index])
        x = block(x)
    return x


def run_local_cached(
    blocks: Sequence[LlamaBlock], hidden: torch.Tensor, caches: Sequence[KVCache]
) -> torch.Tensor:
    """New positions through ``blocks``, appending to ``caches`` (one per block)."""
    x = hidden
    with torch.no_grad():
        for block, cache in zip(blocks, caches, strict=True):
            x = block(x, cache=cache)
    return x


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-5) -> None:
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
