"""A client asking for a server-side LoRA adapter: its requests go only to servers holding it,
and the outputs are those of the model with the adapter merged (as peft's merged model gives)."""

from __future__ import annotations

from pathlib import Path

import torch
import trio

from petals_core.client import RemoteSequential
from petals_core.server import open_server

from ..models.conftest import tiny_llama_config
from ..models.test_lora import LLAMA_LINEARS, merged, write_adapter
from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    Model,
    assert_close,
    manager_for,
    server_config,
    wait_for_servers,
)

RANK, ALPHA = 4, 8.0


async def test_active_adapter_routes_to_its_servers_and_changes_outputs_like_merged_weights(
    model: Model, tmp_path: Path
) -> None:
    folder = tmp_path / "lora"
    weights = write_adapter(folder, tiny_llama_config(), LLAMA_LINEARS, rank=RANK, alpha=ALPHA)
    name = str(folder)
    adapted = [
        merged(block, weights, index, ALPHA / RANK, LLAMA_LINEARS)
        for index, block in enumerate(model.blocks)
    ]
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected_base = model.forward(x)
        expected = x
        for block in adapted:
            expected = block(expected)
    assert not torch.allclose(expected, expected_base, atol=1e-3)

    with trio.fail_after(DEADLINE_S):
        async with open_server(
            server_config(model, tmp_path, block_indices=(0, N_BLOCKS), new_swarm=True)
        ) as plain:
            peers = (str(plain.multiaddrs[0]),)
            async with open_server(
                server_config(
                    model,
                    tmp_path,
                    block_indices=(0, N_BLOCKS),
                    initial_peers=peers,
                    adapters=(name,),
                )
            ) as with_adapter:
                holder = str(with_adapter.dht.peer_id)
                manager = manager_for([plain, with_adapter], active_adapter=name)
                async with RemoteSequential(manager) as seq:
                    await wait_for_servers(manager, 1)
                    # Only the server holding the adapter is usable.
                    assert set(manager.servers()) == {holder}
                    for _ in range(3):
                        assert_close(await seq.forward_async(x), expected)
                    async with seq.open_inference_session(max_length=8) as session:
                        out = torch.cat(
                            [await session.step(x[:, :3]), await session.step(x[:, 3:])], dim=1
                        )
                        assert [span.peer_id for span in session.route] == [holder]
                    assert_close(out, expected)
                # Without the adapter: the base model, through either server.
                base = manager_for([plain, with_adapter])
                async with RemoteSequential(base) as seq:
                    await wait_for_servers(base, 2)
                    assert_close(await seq.forward_async(x), expected_base)
