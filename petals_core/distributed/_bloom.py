"""BLOOM models over a swarm: what differs from LLaMA is the local layers' names and kinds.

``transformer.word_embeddings`` and then ``word_embeddings_layernorm``, which runs before the
first block (after the trainable prompts are prepended, so they go through it too),
``transformer.h`` (remote), ``transformer.ln_f``; both norms are LayerNorms. Positions are the
servers' (ALiBi in the blocks).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.models.bloom.modeling_bloom import BloomPreTrainedModel

from ..client import RemoteSequential
from ..models import DistributedBloomConfig
from ._base import DistributedModelMixin
from ._heads import DistributedCausalLMMixin, DistributedSequenceClassificationMixin

__all__ = [
    "DistributedBloomForCausalLM",
    "DistributedBloomForSequenceClassification",
    "DistributedBloomModel",
]


class DistributedBloomModel(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedModelMixin, BloomPreTrainedModel
):
    """``BloomModel`` with its blocks on servers: ``(B, T)`` ids -> ``(B, T, hidden)``."""

    config_class = DistributedBloomConfig
    embeddings_name, blocks_name, norm_name = "word_embeddings", "h", "ln_f"

    def init_layers(self, config: DistributedBloomConfig, blocks: RemoteSequential) -> None:
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.word_embeddings_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.h = blocks
        self.ln_f = nn.LayerNorm(hidden, eps=eps)

    def prepare_hidden(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings_layernorm(embeddings)


class DistributedBloomForCausalLM(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedCausalLMMixin, BloomPreTrainedModel, GenerationMixin
):
    """``BloomForCausalLM`` over a swarm; ``generate()`` runs as an inference session."""

    config_class = DistributedBloomConfig
    base_model_class = DistributedBloomModel


class DistributedBloomForSequenceClassification(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedSequenceClassificationMixin, BloomPreTrainedModel
):
    """``BloomForSequenceClassification`` over a swarm; the ``score`` head is local."""

    config_class = DistributedBloomConfig
    base_model_class = DistributedBloomModel
