"""BLOOM models over a swarm: local embeddings, norm and head; remote blocks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.bloom.modeling_bloom import BloomPreTrainedModel

from .._hf_compat import cache_kwargs
from ..client import RemoteSequential
from ..models import DistributedBloomConfig
from ..routing import SequenceManagerConfig
from ._base import (
    ChunkedLMHead,
    DistributedCausalLMMixin,
    DistributedModelMixin,
    DistributedSequenceClassificationMixin,
    make_remote_blocks,
)
from ._pretrained import FromPretrainedMixin

__all__ = [
    "DistributedBloomForCausalLM",
    "DistributedBloomForSequenceClassification",
    "DistributedBloomModel",
]


class DistributedBloomModel(  # type: ignore[misc]  # from_pretrained takes keywords
    FromPretrainedMixin, DistributedModelMixin, BloomPreTrainedModel
):
    """``BloomModel`` with its blocks on servers: ``(B, T)`` ids -> ``(B, T, hidden)``."""

    config_class = DistributedBloomConfig
    _client_tensors = ("transformer.",)
    _checkpoint_prefix_to_strip = "transformer."

    def __init__(
        self,
        config: DistributedBloomConfig,
        *,
        sequence_manager_config: SequenceManagerConfig | None = None,
    ) -> None:
        super().__init__(config)
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.word_embeddings_layernorm = nn.LayerNorm(hidden, eps=eps)
        self.h = make_remote_blocks(config, sequence_manager_config)
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        self.init_prompts(config)
        self.post_init()
        self.finish_init()

    @property
    def remote_blocks(self) -> RemoteSequential:
        return self.h

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids)

    def prepare_hidden(self, embeddings: torch.Tensor) -> torch.Tensor:
        # As BloomModel: the layernorm comes after the embeddings, so prompts go through it too.
        return self.word_embeddings_layernorm(embeddings)

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.ln_f(hidden_states)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> Any:
        """As ``BloomModel.forward``: ``last_hidden_state`` after ``ln_f``."""
        hidden, cache = self.forward_base(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        outputs = BaseModelOutputWithPast(last_hidden_state=hidden, **cache_kwargs(cache))
        return outputs if return_dict is not False else outputs.to_tuple()


class DistributedBloomForCausalLM(  # type: ignore[misc]  # from_pretrained takes keywords
    FromPretrainedMixin, DistributedCausalLMMixin, BloomPreTrainedModel, GenerationMixin
):
    """``BloomForCausalLM`` over a swarm; ``generate()`` runs as an inference session."""

    config_class = DistributedBloomConfig
    base_model_prefix = "transformer"
    _client_tensors = ("transformer.", "lm_head.")

    def __init__(
        self,
        config: DistributedBloomConfig,
        *,
        sequence_manager_config: SequenceManagerConfig | None = None,
    ) -> None:
        super().__init__(config)
        self.transformer = DistributedBloomModel(
            config, sequence_manager_config=sequence_manager_config
        )
        self.vocab_size = config.vocab_size
        self.lm_head = ChunkedLMHead(config.hidden_size, config.vocab_size)
        self.post_init()
        self.tie_client_weights()
        self.lm_head.requires_grad_(False)

    def tie_client_weights(self) -> None:
        if self.config.tie_word_embeddings:
            weight = self.transformer.word_embeddings.weight
            assert isinstance(weight, nn.Parameter)
            self.lm_head.weight = weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.word_embeddings


class DistributedBloomForSequenceClassification(  # type: ignore[misc]  # from_pretrained takes keywords
    FromPretrainedMixin, DistributedSequenceClassificationMixin, BloomPreTrainedModel
):
    """``BloomForSequenceClassification`` over a swarm; the ``score`` head is local."""

    config_class = DistributedBloomConfig
    base_model_prefix = "transformer"
    _client_tensors = ("transformer.",)

    def __init__(
        self,
        config: DistributedBloomConfig,
        *,
        sequence_manager_config: SequenceManagerConfig | None = None,
    ) -> None:
        super().__init__(config)
        assert config.num_labels is not None
        self.num_labels: int = config.num_labels
        self.transformer = DistributedBloomModel(
            config, sequence_manager_config=sequence_manager_config
        )
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
        self.init_score()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.word_embeddings
