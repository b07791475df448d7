"""``open_local_swarm``: real processes on loopback (a bootstrap DHT node and servers), all stopped
cleanly when the block ends; a process that exits before it is ready is an error naming it, with
the end of its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from transformers import LlamaForCausalLM

from petals_core.testing import open_local_swarm

from .models.conftest import _save, tiny_llama_config

#: Deadline of a whole swarm's life here; starting a process takes seconds on a busy machine.
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(30)
    folder = tmp_path_factory.mktemp("swarm-llama")
    _save(LlamaForCausalLM(tiny_llama_config()), folder, max_shard_size="100KB")
    return str(folder)


def server_args(span: str) -> list[str]:
    return ["--block_indices", span, "--throughput", "1", "--num_threads", "1"]


async def test_swarm_starts_and_stops_every_process(model_folder: str) -> None:
    with trio.fail_after(DEADLINE_S):
        async with open_local_swarm(
            model_folder, [server_args("0:3"), server_args("3:6")]
        ) as swarm:
            processes = [swarm.bootstrap, *swarm.servers]
            assert [p.name for p in processes] == ["bootstrap", "server-0", "server-1"]
            assert all(p.alive for p in processes)
            assert swarm.initial_peers == [swarm.bootstrap.address]
            peer_ids = {p.address.rsplit("/p2p/", 1)[1] for p in processes}
            assert len(peer_ids) == 3
            assert all(p.address.startswith("/ip4/127.0.0.1/") for p in processes)
            assert all("Server listening on" in "\n".join(p.output) for p in swarm.servers)
    assert [p.process.returncode for p in processes] == [0, 0, 0]
    assert not any(p.alive for p in processes)


async def test_a_server_failing_at_start_is_an_error_with_its_output(tmp_path: Path) -> None:
    """No such model: the server exits at once; the error (not an exception group) names it and
    quotes its output, and the bootstrap node is stopped."""
    with trio.fail_after(DEADLINE_S):
        with pytest.raises(RuntimeError, match="server-0 exited with") as failed:
            async with open_local_swarm(str(tmp_path / "absent"), [server_args("0:1")]):
                pytest.fail("the swarm started without its server")
    assert "absent" in str(failed.value)
