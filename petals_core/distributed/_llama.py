"""LLaMA-family models over a swarm: local embeddings, norm and head; remote blocks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRMSNorm

from .._hf_compat import cache_kwargs
from ..client import RemoteSequential
from ..models import DistributedLlamaConfig
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
    "DistributedLlamaForCausalLM",
    "DistributedLlamaForSequenceClassification",
    "DistributedLlamaModel",
]


class DistributedLlamaModel(  # type: ignore[misc]  # from_pretrained takes keywords
    FromPretrainedMixin, DistributedModelMixin, LlamaPreTrainedModel
):
    """``LlamaModel`` with its decoder layers on servers: ``(B, T)`` ids -> ``(B, T, hidden)``."""

    config_class = DistributedLlamaConfig
    _client_tensors = ("model.",)
    _checkpoint_prefix_to_strip = "model."

    def __init__(
        self,
        config: DistributedLlamaConfig,
        *,
        sequence_manager_config: SequenceManagerConfig | None = None,
    ) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = make_remote_blocks(config, sequence_manager_config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.init_prompts(config)
        self.post_init()
        self.finish_init()

    @property
    def remote_blocks(self) -> RemoteSequential:
        return self.layers

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden_states)

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
        """As ``LlamaModel.forward``: ``last_hidden_state`` after the final norm."""
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


class DistributedLlamaForCausalLM(  # type: ignore[misc]  # from_pretrained takes keywords
    FromPretrainedMixin, DistributedCausalLMMixin, LlamaPreTrainedModel, GenerationMixin
):
    """``LlamaForCausalLM`` over a swarm; ``generate()`` runs as an inference session."""

    config_class = DistributedLlamaConfig
    base_model_prefix = "model"
    _client_tensors = ("model.", "lm_head.")

    def __init__(
        self,
        config: DistributedLlamaConfig,
        *,
        sequence_manager_config: SequenceManagerConfig | None = None,
    ) -> None:
        super().__init__(config)
        self.model = DistributedLlamaModel(config, sequence_manager_config=sequence_manager_config)
        self.vocab_size = config.vocab_size
        self.lm_head = ChunkedLMHead(config.hidden_size, config.vocab_size)
        self.post_init()
        self.tie_client_weights()
        self.lm_head.requires_grad_(False)

    def tie_client_weights(self) -> None:
        if self.config.tie_word_embeddings:
            weight = self.model.embed_tokens.weight
            assert isinstance(weight, nn.Parameter)
            self.lm_head.weight = weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens


class DistributedLlamaForSequenceClassification(  # type: ignore[misc]  # from_pretrained takes keywords
    FromPretrainedMixin, DistributedSequenceClassificationMixin, LlamaPreTrainedModel
):
    """``LlamaForSequenceClassification`` over a swarm; the ``score`` head is local."""

    config_class = DistributedLlamaConfig
    base_model_prefix = "model"
    _client_tensors = ("model.",)

    def __init__(
        self,
        config: DistributedLlamaConfig,
        *,
        sequence_manager_config: SequenceManagerConfig | None = None,
    ) -> None:
        super().__init__(config)
        assert config.num_labels is not None
        self.num_labels: int = config.num_labels
        self.model = DistributedLlamaModel(config, sequence_manager_config=sequence_manager_config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()
        self.init_score()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens
