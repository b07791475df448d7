"""LLaMA-family models over a swarm: what differs from BLOOM is the local layers' names and kinds.

``model.embed_tokens`` (with the pad token's row), ``model.layers`` (remote), ``model.norm`` (an
RMSNorm). Positions are the servers' (rotary embeddings in the blocks): nothing runs between the
embeddings and the first block.
"""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRMSNorm

from ..client import RemoteSequential
from ..models import DistributedLlamaConfig
from ._base import DistributedModelMixin
from ._heads import DistributedCausalLMMixin, DistributedSequenceClassificationMixin

__all__ = [
    "LlamaLayers",
    "DistributedLlamaForCausalLM",
    "DistributedLlamaForSequenceClassification",
    "DistributedLlamaModel",
]


class LlamaLayers:
    """The local layers of LLaMA's architecture (Mixtral's too), for a distributed base model."""

    embeddings_name, blocks_name, norm_name = "embed_tokens", "layers", "norm"

    def init_layers(self, config: DistributedLlamaConfig, blocks: RemoteSequential) -> None:
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = blocks
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DistributedLlamaModel(  # type: ignore[misc]  # from_pretrained takes keywords
    LlamaLayers, DistributedModelMixin, LlamaPreTrainedModel
):
    """``LlamaModel`` with its decoder layers on servers: ``(B, T)`` ids -> ``(B, T, hidden)``."""

    config_class = DistributedLlamaConfig


class DistributedLlamaForCausalLM(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedCausalLMMixin, LlamaPreTrainedModel, GenerationMixin
):
    """``LlamaForCausalLM`` over a swarm; ``generate()`` runs as an inference session."""

    config_class = DistributedLlamaConfig
    base_model_class = DistributedLlamaModel


class DistributedLlamaForSequenceClassification(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedSequenceClassificationMixin, LlamaPreTrainedModel
):
    """``LlamaForSequenceClassification`` over a swarm; the ``score`` head is local."""

    config_class = DistributedLlamaConfig
    base_model_class = DistributedLlamaModel
