"""Petals' names, spelled the same with the package changed: the root exports and ClientConfig."""

from __future__ import annotations

import functools

import pytest

import petals_core
from petals_core import ConfigError

from ._fresh import MODEL_STACK, Fresh, run_fresh

#: What ``from petals import *`` offers that petals_core has, name for name.
PETALS_ROOT_NAMES = (
    "AutoDistributedConfig",
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "AutoDistributedModelForSequenceClassification",
    "AutoDistributedSpeculativeModel",
    "ClientConfig",
    "DistributedBloomConfig",
    "DistributedBloomForCausalLM",
    "DistributedBloomForSequenceClassification",
    "DistributedBloomModel",
    "DistributedFalconConfig",
    "DistributedFalconForCausalLM",
    "DistributedFalconForSequenceClassification",
    "DistributedFalconModel",
    "DistributedLlamaConfig",
    "DistributedLlamaForCausalLM",
    "DistributedLlamaForSequenceClassification",
    "DistributedLlamaForSpeculativeGeneration",
    "DistributedLlamaModel",
    "DistributedMixtralConfig",
    "DistributedMixtralForCausalLM",
    "DistributedMixtralForSequenceClassification",
    "DistributedMixtralModel",
    "InferenceSession",
    "RemoteSequenceManager",
    "RemoteSequential",
)


@functools.cache
def _imported_alone() -> dict[str, Fresh]:
    """Each root name imported first thing in an interpreter that has loaded nothing of
    petals_core (what a user's ``from petals_core import X`` meets)."""
    snippets = {
        name: f"from petals_core import {name}; print({name}.__name__)"
        for name in PETALS_ROOT_NAMES
    }
    return run_fresh(snippets, preload=MODEL_STACK)


@pytest.mark.parametrize("name", PETALS_ROOT_NAMES)
def test_petals_root_names_are_exported(name: str) -> None:
    assert _imported_alone()[name].check().strip() == name
    assert name in dir(petals_core)


def test_unknown_root_names_still_fail() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'DistributedGPT2Model'"):
        petals_core.DistributedGPT2Model  # noqa: B018


def test_client_config_takes_petals_field_names() -> None:
    from petals_core import ClientConfig
    from petals_core.client import SequenceManagerConfig

    config = ClientConfig(initial_peers=["/ip4/127.0.0.1/udp/1/quic-v1"], request_timeout=30)
    assert isinstance(config, SequenceManagerConfig)
    assert config.request_timeout_s == 30
    assert config.initial_peers == ("/ip4/127.0.0.1/udp/1/quic-v1",)
    assert ClientConfig(ban_timeout_s=2).ban_timeout_s == 2
    with pytest.raises(ConfigError, match="give ban_timeout_s or ban_timeout"):
        ClientConfig(ban_timeout=1, ban_timeout_s=2)
    with pytest.raises(ConfigError):
        ClientConfig(request_timeout=-1)
    with pytest.raises(TypeError, match="no_such_field"):
        ClientConfig(no_such_field=1)
