"""Distributed configs: dht_prefix rules, class choice by model_type, and clear refusals."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, strategies as st
from transformers import (
    BloomConfig,
    FalconConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
)

from petals_core import ConfigError
from petals_core.models._config import (
    AutoDistributedConfig,
    DistributedBloomConfig,
    DistributedConfig,
    DistributedFalconConfig,
    DistributedLlamaConfig,
    DistributedMixtralConfig,
    default_dht_prefix,
    original_repo,
)
from petals_core.testing import tiny_falcon_config, tiny_mixtral_config

from .conftest import Hub, tiny_bloom_config, tiny_llama_config


@pytest.mark.parametrize(
    ("model_name_or_path", "model_type", "expected"),
    [
        # BLOOM repos keep Petals' swarm names.
        ("bigscience/bloom", "bloom", "bigscience/bloom-petals"),
        ("bigscience/bloom-560m", "bloom", "bigscience/bloom-560m-petals"),
        ("bigscience/bloom-7b1", "bloom", "bigscience/bloom-7b1-petals"),
        ("bigscience/bloomz", "bloom", "bigscience/bloomz-petals"),
        ("bigscience/bloomz-560m", "bloom", "bigscience/bloomz-560m-petals"),
        ("bigscience/bloom-7b1.x", "bloom", "bigscience/bloom-7b1-x-petals"),
        # LLaMA repos, as in Petals: the repo name without its owner, dots replaced, "-hf" last.
        ("someone/llama-65b-hf", "llama", "llama-65b-hf"),
        ("meta-llama/Llama-2-70b-chat-hf", "llama", "Llama-2-70b-chat-hf"),
        ("meta-llama/Llama-3.1-8B", "llama", "Llama-3-1-8B-hf"),
        ("meta-llama/Meta-Llama-3.1-405B-Instruct", "llama", "Meta-Llama-3-1-405B-Instruct-hf"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "llama", "SmolLM2-135M-Instruct-hf"),
        ("llama-7b", "llama", "llama-7b-hf"),
        # Falcon: the repo name as it is, without its owner and without "-hf".
        ("tiiuae/falcon-40b", "falcon", "falcon-40b"),
        ("tiiuae/falcon-180B-chat", "falcon", "falcon-180B-chat"),
        ("tiiuae/falcon-7b-instruct", "falcon", "falcon-7b-instruct"),
        ("someone/Falcon3-7B.v1-hf", "falcon", "Falcon3-7B-v1-hf"),
        (Path("/data/models/falcon-40b"), "falcon", "falcon-40b"),
        # Mixtral: the repo id, owner included.
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral", "mistralai/Mixtral-8x7B-Instruct-v0-1"),
        ("mistralai/Mixtral-8x22B-v0.1", "mixtral", "mistralai/Mixtral-8x22B-v0-1"),
        (Path("/data/Mixtral-8x7B"), "mixtral", "Mixtral-8x7B"),
        # Local folders: the folder name, sanitised.
        (Path("/data/models/My Model.v2"), "llama", "My-Model-v2"),
        (Path("/data/models/bloom-560m"), "bloom", "bloom-560m"),
        (Path("relative/llama_7b"), "llama", "llama_7b"),
        ("/data/models/bloom-560m", "bloom", "bloom-560m"),
        ("/data/models/llama-7b/", "llama", "llama-7b"),
        ("./checkpoints/tiny", "llama", "tiny"),
        ("~/models/naïve:model", "llama", "na-ve-model"),
        ("a/b/c", "bloom", "c"),
    ],
)
def test_default_dht_prefix(
    model_name_or_path: str | os.PathLike[str], model_type: str, expected: str
) -> None:
    assert default_dht_prefix(model_name_or_path, model_type) == expected


@given(st.text(min_size=1), st.sampled_from(["llama", "bloom", "falcon", "mixtral"]))
def test_derived_prefixes_of_folders_have_no_dots(name: str, model_type: str) -> None:
    prefix = default_dht_prefix(Path("/models") / name.replace("/", "_"), model_type)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", prefix)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("bigscience/bloom-petals", "bigscience/bloom"),
        ("bigscience/bloom-7b1-petals", "bigscience/bloom-7b1"),
        ("bigscience/bloomz-petals", "bigscience/bloomz"),
        ("bigscience/bloom-7b1", "bigscience/bloom-7b1"),
        ("someone/bloom-petals", "someone/bloom-petals"),
        ("bigscience/-petals", "bigscience/-petals"),
        (Path("bigscience/bloom-petals"), Path("bigscience/bloom-petals")),
    ],
)
def test_petals_converted_repos_name_their_originals(
    name: str | os.PathLike[str], expected: str | os.PathLike[str]
) -> None:
    assert original_repo(name) == expected


def _save_config(folder: Path, config: object) -> Path:
    folder.mkdir(parents=True)
    config.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder


@pytest.mark.parametrize(
    ("config", "expected_class", "base_class"),
    [
        (tiny_llama_config(), DistributedLlamaConfig, LlamaConfig),
        # SmolLM2, Vicuna & co: LLaMA blocks under model_type "llama", whatever the name.
        (
            tiny_llama_config(architectures=["SmolLM2ForCausalLM"]),
            DistributedLlamaConfig,
            LlamaConfig,
        ),
        (tiny_bloom_config(), DistributedBloomConfig, BloomConfig),
        (tiny_falcon_config(), DistributedFalconConfig, FalconConfig),
        (tiny_mixtral_config(), DistributedMixtralConfig, MixtralConfig),
    ],
)
def test_auto_config_chooses_by_model_type(
    tmp_path: Path, config: object, expected_class: type, base_class: type
) -> None:
    folder = _save_config(tmp_path / "my.model", config)
    loaded = AutoDistributedConfig.from_pretrained(folder)
    assert type(loaded) is expected_class
    assert isinstance(loaded, DistributedConfig)
    assert isinstance(loaded, base_class)
    assert loaded.hidden_size == 64
    assert loaded.num_hidden_layers == 6
    assert loaded.dht_prefix == "my-model"
    assert expected_class.from_pretrained(str(folder)).dht_prefix == "my-model"


@pytest.mark.parametrize("config", [GPT2Config(), MistralConfig()])
def test_unsupported_model_type_is_named(tmp_path: Path, config: object) -> None:
    folder = _save_config(tmp_path / "model", config)
    model_type = config.model_type  # type: ignore[attr-defined]
    supported = "bloom, falcon, llama, mixtral"
    with pytest.raises(ConfigError, match=f"model_type '{model_type}'.*supported.*{supported}"):
        AutoDistributedConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match=model_type):
        DistributedLlamaConfig.from_pretrained(folder)


@pytest.mark.parametrize(
    "make", [tiny_falcon_config, tiny_mixtral_config], ids=["falcon", "mixtral"]
)
def test_falcon_and_mixtral_without_a_pad_token_pad_with_0(tmp_path: Path, make: Any) -> None:
    """As in Petals: their checkpoints have no pad token, and batches need one."""
    folder = _save_config(tmp_path / "none", make(pad_token_id=None))
    assert AutoDistributedConfig.from_pretrained(folder).pad_token_id == 0
    folder = _save_config(tmp_path / "seven", make(pad_token_id=7))
    assert AutoDistributedConfig.from_pretrained(folder).pad_token_id == 7
    llama = _save_config(tmp_path / "llama", tiny_llama_config(pad_token_id=None))
    assert AutoDistributedConfig.from_pretrained(llama).pad_token_id is None


def test_family_mismatch(tmp_path: Path) -> None:
    folder = _save_config(tmp_path / "llama", tiny_llama_config())
    with pytest.raises(
        ConfigError, match=r"model_type 'llama', not 'bloom'.*DistributedLlamaConfig"
    ):
        DistributedBloomConfig.from_pretrained(folder)


def test_explicit_prefix_wins_then_the_stored_one(tmp_path: Path) -> None:
    folder = _save_config(tmp_path / "llama", tiny_llama_config())
    config = DistributedLlamaConfig.from_pretrained(folder, dht_prefix="my-swarm")
    assert config.dht_prefix == "my-swarm"

    config.save_pretrained(tmp_path / "saved")
    assert DistributedLlamaConfig.from_pretrained(tmp_path / "saved").dht_prefix == "my-swarm"
    reloaded = AutoDistributedConfig.from_pretrained(tmp_path / "saved", dht_prefix="other")
    assert reloaded.dht_prefix == "other"


def test_other_keyword_arguments_override_attributes(tmp_path: Path) -> None:
    folder = _save_config(tmp_path / "bloom", tiny_bloom_config())
    config = AutoDistributedConfig.from_pretrained(folder, n_layer=3)
    assert config.num_hidden_layers == 3


def test_auto_config_is_not_instantiated() -> None:
    with pytest.raises(TypeError, match="from_pretrained"):
        AutoDistributedConfig()


def test_prefixes_of_hub_repos(hub: Hub, tmp_path: Path) -> None:
    bloom = _save_config(tmp_path / "bloom", tiny_bloom_config())
    llama = _save_config(tmp_path / "llama", tiny_llama_config())
    hub.server.serve("bigscience/bloom-560m", bloom)
    hub.server.serve("someone/llama-65b-hf", llama)

    config = AutoDistributedConfig.from_pretrained("bigscience/bloom-560m")
    assert type(config) is DistributedBloomConfig
    assert config.dht_prefix == "bigscience/bloom-560m-petals"
    config = AutoDistributedConfig.from_pretrained("someone/llama-65b-hf", cache_dir=hub.cache_dir)
    assert type(config) is DistributedLlamaConfig
    assert config.dht_prefix == "llama-65b-hf"

    # One config download per load: the class is chosen from one read. Newer huggingface_hub
    # releases look the revision up first (one API call per load), older ones do not.
    assert hub.server.api_calls() in (
        [],
        ["/api/models/bigscience/bloom-560m", "/api/models/someone/llama-65b-hf"],
    )
    assert hub.server.count("GET", "someone/llama-65b-hf")["config.json"] == 1

    hub.go_offline()
    hub.server.clear_log()
    assert AutoDistributedConfig.from_pretrained("bigscience/bloom-560m").dht_prefix == (
        "bigscience/bloom-560m-petals"
    )
    assert hub.server.requests == []

    # Petals' converted repo names load the original, under the same swarm name.
    config = AutoDistributedConfig.from_pretrained("bigscience/bloom-560m-petals")
    assert type(config) is DistributedBloomConfig
    assert config.dht_prefix == "bigscience/bloom-560m-petals"
    assert config.name_or_path == "bigscience/bloom-560m"
