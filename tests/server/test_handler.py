"""A real server on loopback refusing what breaks its rules, in every block RPC: each refusal
is checked for its remote type and message, and for the server going on serving (an open
session and a new one still compute the right thing).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import BACKWARD, FORWARD, send_tensors
from petals_core.server import ServingLimits
from petals_core.transport import Connection, open_call

from ..models.conftest import TinyCheckpoint
from ._client import (
    DEADLINE_S,
    HIDDEN,
    assert_close,
    backward,
    check_serving,
    connect,
    info,
    local_blocks,
    open_raw_session,
    run_local,
    serve,
    session,
)

# -- refusals --------------------------------------------------------------------------------------

#: The server of the refusal tests holds [1, 6); the session that stays open uses [2, 5).
HELD = (1, 6)
KEEPER = "keeper"
MAX_LENGTH = 32


async def _bad_step(connection: Connection, step: dict[str, Any], *, batch_size: int = 1) -> None:
    """Open a valid session of max_length 4, step 2 valid tokens, then send ``step``."""
    async with session(
        connection, blocks=(2, 5), max_length=4, batch_size=batch_size, session_id="bad"
    ) as opened:
        await opened.step(torch.randn(batch_size, 2, HIDDEN))
        await opened.step(step.pop("hidden_states"), **step)


def _opening(**fields: Any) -> dict[str, Any]:
    return {"session_id": "bad", "blocks": [2, 5], "max_length": 4, **fields}


async def _backward_mismatched(connection: Connection) -> None:
    await backward(connection, (2, 5), torch.randn(1, 4, HIDDEN), torch.randn(1, 3, HIDDEN))


async def _forward_without_hidden(connection: Connection) -> None:
    async with open_call(connection, FORWARD) as call:
        await send_tensors(call.send, {"blocks": [2, 5]}, {"prompts": torch.zeros(3, 1, 1, 64)})
        await call.receive()


async def _backward_without_grad(connection: Connection) -> None:
    async with open_call(connection, BACKWARD) as call:
        await send_tensors(call.send, {"blocks": [2, 5]}, {"hidden_states": torch.zeros(1, 2, 64)})
        await call.receive()


Refusal = Callable[[Connection], Awaitable[None]]

REFUSALS: dict[str, tuple[Refusal, str, str]] = {
    # name: (what the client does, remote type, part of the remote message)
    "unknown adapter": (
        lambda c: open_raw_session(c, _opening(active_adapter="nope")),
        "AdapterError",
        "unknown adapter 'nope'",
    ),
    "reused open session id": (
        lambda c: open_raw_session(c, _opening(session_id=KEEPER)),
        "ServerError",
        "session id 'keeper' is already in use",
    ),
    "wrong hidden size": (
        lambda c: _bad_step(c, {"hidden_states": torch.randn(1, 1, HIDDEN // 2)}),
        "ServerError",
        f"hidden_states must be (batch >= 1, tokens, {HIDDEN})",
    ),
    "wrong batch rows": (
        lambda c: _bad_step(c, {"hidden_states": torch.randn(3, 1, HIDDEN)}, batch_size=2),
        "ServerError",
        "the session has 2 rows; this step has 3",
    ),
    "integer dtype": (
        lambda c: _bad_step(c, {"hidden_states": torch.ones(1, 1, HIDDEN, dtype=torch.int64)}),
        "ServerError",
        "must be floating point",
    ),
    "steps past max_length": (
        lambda c: _bad_step(c, {"hidden_states": torch.randn(1, 3, HIDDEN)}),
        "ServerError",
        "2 + 3 positions exceed the session's max_length 4",
    ),
    "start_from_position beyond the position": (
        lambda c: _bad_step(
            c, {"hidden_states": torch.randn(1, 1, HIDDEN), "start_from_position": 3}
        ),
        "ServerError",
        "cannot start from position 3: the cache holds 2",
    ),
    "hypo_ids out of range": (
        lambda c: _bad_step(
            c,
            {"hidden_states": torch.randn(2, 1, HIDDEN), "hypo_ids": torch.tensor([0, 2])},
            batch_size=2,
        ),
        "ServerError",
        "hypo_ids must be (2,) integers in [0, batch)",
    ),
    "blocks outside the span": (
        lambda c: open_raw_session(c, _opening(blocks=[0, 3])),
        "CodecError",
        "blocks [0, 3) are not inside the blocks this server holds, [1, 6)",
    ),
    "max_length above inference_max_length": (
        lambda c: open_raw_session(c, _opening(max_length=MAX_LENGTH + 1)),
        "SessionTooLarge",
        f"max_length {MAX_LENGTH + 1} is more than this server takes, {MAX_LENGTH} "
        "(--inference_max_length)",
    ),
    "malformed opening": (
        lambda c: open_raw_session(c, {"blocks": [2, 5], "max_length": 4}),
        "CodecError",
        "session_id must be a string",
    ),
    "forward without hidden_states": (
        _forward_without_hidden,
        "ServerError",
        "request refused: hidden_states must be a tensor",
    ),
    "backward without grad_outputs": (
        _backward_without_grad,
        "ServerError",
        "grad_outputs must have the shape of hidden_states",
    ),
    "backward with mismatched grad_outputs": (
        _backward_mismatched,
        "ServerError",
        "grad_outputs must have the shape of hidden_states, (1, 4, 64)",
    ),
}


@pytest.mark.parametrize("name", list(REFUSALS))
async def test_refusals_name_the_fault_and_the_server_keeps_serving(
    name: str, server_llama: TinyCheckpoint, cache_dir: Path
) -> None:
    """While a session is open, another call breaks a rule: it gets the error naming the fault;
    the open session goes on computing the right thing, and a new one works too."""
    action, remote_type, message = REFUSALS[name]
    torch.manual_seed(9)
    hidden = torch.randn(1, 6, HIDDEN)
    limits = ServingLimits(inference_max_length=MAX_LENGTH)
    with trio.fail_after(DEADLINE_S):
        async with (
            serve(server_llama, cache_dir, blocks=HELD, limits=limits) as server,
            connect(server) as connection,
        ):
            budget = server.block_server.cache_tokens_left
            async with session(
                connection, blocks=(2, 5), max_length=MAX_LENGTH, session_id=KEEPER
            ) as keeper:
                before = await keeper.step(hidden[:, :3])
                with pytest.raises(RemoteError) as caught:
                    await action(connection)
                assert caught.value.remote_type == remote_type
                assert message in caught.value.remote_message
                after = await keeper.step(hidden[:, 3:])
                assert keeper.position == 6
                await check_serving(server_llama, connection)
            assert server.block_server.cache_tokens_left == budget
            assert (await info(connection)).open_sessions == 0
    assert_close(
        torch.cat([before, after], dim=1), run_local(local_blocks(server_llama, 2, 5), hidden)
    )
