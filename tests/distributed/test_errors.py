"""A model that cannot reach its swarm says why at once: no initial peers, peers that do not
answer, blocks that no server holds."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from petals_core import ConfigError, PeerUnreachable
from petals_core.distributed import AutoDistributedModelForCausalLM
from petals_core.routing import MissingBlocksError

from .._served_swarm import ServedModel

#: Far below the default request_timeout_s (180 s) that these errors once waited for.
PROMPT_S = 60.0


def _generate(model: AutoDistributedModelForCausalLM) -> float:
    began = time.monotonic()
    try:
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=1)
    finally:
        model.shutdown()
    return time.monotonic() - began


def test_no_initial_peers_says_what_to_pass(served_llama: ServedModel) -> None:
    model = AutoDistributedModelForCausalLM.from_pretrained(served_llama.folder)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"no initial_peers: pass initial_peers=\[") as caught:
        _generate(model)
    assert time.monotonic() - began < PROMPT_S
    assert "Server listening on" in str(caught.value)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback UDP port that receives and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_unreachable_peers_are_named_within_connect_timeout(
    served_llama: ServedModel, silent_port: int
) -> None:
    address = f"/ip4/127.0.0.1/udp/{silent_port}/quic-v1"
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served_llama.folder, initial_peers=[address], connect_timeout=1.0
    )
    began = time.monotonic()
    with pytest.raises(PeerUnreachable, match="none of the initial peers answered") as caught:
        _generate(model)
    assert time.monotonic() - began < PROMPT_S
    assert address in str(caught.value)


def test_blocks_nobody_serves_are_named_with_the_servers_seen(served_llama: ServedModel) -> None:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served_llama.folder,
        initial_peers=served_llama.initial_peers,
        dht_prefix="a-swarm-nobody-serves",
        missing_blocks_timeout_s=1.0,
    )
    began = time.monotonic()
    with pytest.raises(MissingBlocksError, match="no server of it seen") as caught:
        _generate(model)
    assert time.monotonic() - began < PROMPT_S
    assert caught.value.dht_prefix == "a-swarm-nobody-serves"
    assert caught.value.blocks == tuple(range(model.config.num_hidden_layers))
