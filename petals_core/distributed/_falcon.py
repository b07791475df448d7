"""Falcon models over a swarm: what differs from BLOOM is that nothing runs between the embeddings
and the first block.

``transformer.word_embeddings``, ``transformer.h`` (remote), ``transformer.ln_f`` (a LayerNorm).
Positions are the servers' (rotary embeddings or ALiBi, in the blocks).
"""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin
from transformers.models.falcon.modeling_falcon import FalconPreTrainedModel

from ..client import RemoteSequential
from ..models import DistributedFalconConfig
from ._base import DistributedModelMixin
from ._heads import DistributedCausalLMMixin, DistributedSequenceClassificationMixin

__all__ = [
    "DistributedFalconForCausalLM",
    "DistributedFalconForSequenceClassification",
    "DistributedFalconModel",
]


class DistributedFalconModel(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedModelMixin, FalconPreTrainedModel
):
    """``FalconModel`` with its blocks on servers: ``(B, T)`` ids -> ``(B, T, hidden)``."""

    config_class = DistributedFalconConfig
    embeddings_name, blocks_name, norm_name = "word_embeddings", "h", "ln_f"

    def init_layers(self, config: DistributedFalconConfig, blocks: RemoteSequential) -> None:
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = blocks
        eps = 1e-5 if config.layer_norm_epsilon is None else config.layer_norm_epsilon
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=eps)


class DistributedFalconForCausalLM(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedCausalLMMixin, FalconPreTrainedModel, GenerationMixin
):
    """``FalconForCausalLM`` over a swarm; ``generate()`` runs as an inference session."""

    config_class = DistributedFalconConfig
    base_model_class = DistributedFalconModel


class DistributedFalconForSequenceClassification(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedSequenceClassificationMixin, FalconPreTrainedModel
):
    """``FalconForSequenceClassification`` over a swarm; the ``score`` head is local."""

    config_class = DistributedFalconConfig
    base_model_class = DistributedFalconModel
