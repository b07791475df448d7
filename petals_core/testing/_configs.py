"""Model configs for tests and benchmarks: tiny ones with random weights in mind, and the shapes
of the real models the benchmarks stand in for.

Each function takes ``overrides``, config keys that replace or add to its settings, so that a
caller names only what it changes.  transformers is imported when a config is made, not with
:mod:`petals_core.testing`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import BloomConfig, FalconConfig, LlamaConfig, MixtralConfig

__all__ = [
    "bloom_560m_config",
    "falcon_7b_config",
    "mixtral_8x7b_config",
    "smollm2_135m_config",
    "tiny_bloom_config",
    "tiny_falcon_config",
    "tiny_llama_config",
    "tiny_mixtral_config",
    "tinyllama_1b_config",
]


def _llama(settings: dict[str, Any], overrides: dict[str, Any]) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(**{**settings, **overrides})


def _bloom(settings: dict[str, Any], overrides: dict[str, Any]) -> BloomConfig:
    from transformers import BloomConfig

    return BloomConfig(**{**settings, **overrides})


def _falcon(settings: dict[str, Any], overrides: dict[str, Any]) -> FalconConfig:
    from transformers import FalconConfig

    return FalconConfig(**{**settings, **overrides})


def _mixtral(settings: dict[str, Any], overrides: dict[str, Any]) -> MixtralConfig:
    from transformers import MixtralConfig

    return MixtralConfig(**{**settings, **overrides})


#: What the tiny LLaMA and the tiny Mixtral share: their sizes and grouped-query attention.
_TINY_GROUPED = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A tiny LLaMA: hidden size 64, 4 attention heads over 2 key/value heads (grouped-query),
    MLP width 128, 6 blocks, a vocabulary of 256, 128 positions."""
    return _llama({**_TINY_GROUPED, "intermediate_size": 128}, overrides)


def tiny_bloom_config(**overrides: Any) -> BloomConfig:
    """A tiny BLOOM: hidden size 64, 4 heads, 6 blocks, a vocabulary of 256."""
    return _bloom({"hidden_size": 64, "n_head": 4, "n_layer": 6, "vocab_size": 256}, overrides)


def tiny_falcon_config(**overrides: Any) -> FalconConfig:
    """A tiny Falcon of the new decoder architecture (Falcon-40B's layout): hidden size 64, 8
    attention heads in 2 groups sharing a key/value head each, two LayerNorms per block (one for
    attention, one for the MLP, run in parallel), rotary positions, 6 blocks, a vocabulary of 256,
    128 positions.  ``multi_query=True, new_decoder_architecture=False`` gives Falcon-7B's
    layout, ``alibi=True`` Falcon-RW's positions."""
    settings = {
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_kv_heads": 2,
        "new_decoder_architecture": True,
        "num_hidden_layers": 6,
        "vocab_size": 256,
        "max_position_embeddings": 128,
    }
    return _falcon(settings, overrides)


def tiny_mixtral_config(**overrides: Any) -> MixtralConfig:
    """A tiny Mixtral: hidden size 64, 4 attention heads over 2 key/value heads, 8 experts of
    width 96 of which each token uses 2, 6 blocks, a vocabulary of 256, 128 positions, pad token
    0."""
    settings = {
        **_TINY_GROUPED,
        "intermediate_size": 96,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "pad_token_id": 0,
    }
    return _mixtral(settings, overrides)


def smollm2_135m_config(**overrides: Any) -> LlamaConfig:
    """SmolLM2-135M's shape: hidden size 576, 9 attention heads of 64 over 3 key/value heads,
    MLP width 1536, 30 blocks, a vocabulary of 49152, RoPE base 100000, 8192 positions, tied
    embeddings."""
    settings = {
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }
    return _llama(settings, overrides)


def tinyllama_1b_config(**overrides: Any) -> LlamaConfig:
    """TinyLlama-1.1B's shape: hidden size 2048, 32 attention heads over 4 key/value heads, MLP
    width 5632, 22 blocks, a vocabulary of 32000, 2048 positions, an untied LM head."""
    settings = {
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    }
    return _llama(settings, overrides)


def bloom_560m_config(**overrides: Any) -> BloomConfig:
    """bloom-560m's shape: hidden size 1024, 16 heads, 24 blocks, a vocabulary of 250880."""
    return _bloom(
        {"hidden_size": 1024, "n_head": 16, "n_layer": 24, "vocab_size": 250880}, overrides
    )


def falcon_7b_config(**overrides: Any) -> FalconConfig:
    """Falcon-7B's shape: hidden size 4544, 71 attention heads of 64 sharing one key/value head
    (multi-query), attention and MLP in parallel from one LayerNorm, MLP width 18176, 32 blocks,
    a vocabulary of 65024, tied embeddings."""
    settings = {
        "hidden_size": 4544,
        "num_attention_heads": 71,
        "num_hidden_layers": 32,
        "multi_query": True,
        "parallel_attn": True,
        "new_decoder_architecture": False,
        "vocab_size": 65024,
        "tie_word_embeddings": True,
    }
    return _falcon(settings, overrides)


def mixtral_8x7b_config(**overrides: Any) -> MixtralConfig:
    """Mixtral-8x7B's shape: hidden size 4096, 32 attention heads over 8 key/value heads, 8
    experts of width 14336 of which each token uses 2, 32 blocks, a vocabulary of 32000, RoPE base
    1e6, 32768 positions."""
    settings = {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    return _mixtral(settings, overrides)
