"""Tiny checkpoints for the server tests, and a raw client of the block RPCs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BloomForCausalLM, LlamaForCausalLM

from ..models.conftest import (
    SHARD_SIZE,
    TinyCheckpoint,
    _save,
    tiny_bloom_config,
    tiny_llama_config,
)


@pytest.fixture(scope="session")
def server_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A 6-block LLaMA (grouped-query attention) in several shards."""
    torch.manual_seed(10)
    model = LlamaForCausalLM(tiny_llama_config())
    return _save(model, tmp_path_factory.mktemp("server-llama"), max_shard_size=SHARD_SIZE)


@pytest.fixture(scope="session")
def server_bloom(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    torch.manual_seed(11)
    model = BloomForCausalLM(tiny_bloom_config())
    return _save(model, tmp_path_factory.mktemp("server-bloom"), max_shard_size=SHARD_SIZE)


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"
