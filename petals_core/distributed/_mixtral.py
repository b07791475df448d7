"""Mixtral models over a swarm: LLaMA's local layers (``model.embed_tokens``, ``model.norm``, an
RMSNorm) around ``model.layers`` (remote, with the experts).  The client never holds an expert."""

from __future__ import annotations

from transformers.models.mixtral.modeling_mixtral import MixtralPreTrainedModel

from ..models import DistributedMixtralConfig
from ._base import DistributedModelMixin
from ._heads import family_heads
from ._llama import LlamaLayers

__all__ = [
    "DistributedMixtralForCausalLM",
    "DistributedMixtralForSequenceClassification",
    "DistributedMixtralModel",
]


class DistributedMixtralModel(  # type: ignore[misc]  # from_pretrained takes keywords
    LlamaLayers, DistributedModelMixin, MixtralPreTrainedModel
):
    """``MixtralModel`` with its decoder layers on servers: ``(B, T)`` ids -> ``(B, T, hidden)``."""

    config_class = DistributedMixtralConfig


DistributedMixtralForCausalLM, DistributedMixtralForSequenceClassification = family_heads(
    "Mixtral", MixtralPreTrainedModel, DistributedMixtralModel
)
