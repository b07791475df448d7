"""Mixtral models over a swarm: LLaMA's local layers (``model.embed_tokens``, ``model.norm``, an
RMSNorm) around ``model.layers`` (remote, with the experts).  The client never holds an expert."""

from __future__ import annotations

from transformers import GenerationMixin
from transformers.models.mixtral.modeling_mixtral import MixtralPreTrainedModel

from ..models import DistributedMixtralConfig
from ._base import DistributedModelMixin
from ._heads import DistributedCausalLMMixin, DistributedSequenceClassificationMixin
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


class DistributedMixtralForCausalLM(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedCausalLMMixin, MixtralPreTrainedModel, GenerationMixin
):
    """``MixtralForCausalLM`` over a swarm; ``generate()`` runs as an inference session."""

    config_class = DistributedMixtralConfig
    base_model_class = DistributedMixtralModel


class DistributedMixtralForSequenceClassification(  # type: ignore[misc]  # from_pretrained takes keywords
    DistributedSequenceClassificationMixin, MixtralPreTrainedModel
):
    """``MixtralForSequenceClassification`` over a swarm; the ``score`` head is local."""

    config_class = DistributedMixtralConfig
    base_model_class = DistributedMixtralModel
