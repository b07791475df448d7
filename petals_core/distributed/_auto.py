"""``AutoDistributedModel*``: pick the family class from the checkpoint's ``model_type``."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from .._errors import ConfigError
from ._bloom import (
    DistributedBloomForCausalLM,
    DistributedBloomForSequenceClassification,
    DistributedBloomModel,
)
from ._falcon import (
    DistributedFalconForCausalLM,
    DistributedFalconForSequenceClassification,
    DistributedFalconModel,
)
from ._llama import (
    DistributedLlamaForCausalLM,
    DistributedLlamaForSequenceClassification,
    DistributedLlamaModel,
)
from ._mixtral import (
    DistributedMixtralForCausalLM,
    DistributedMixtralForSequenceClassification,
    DistributedMixtralModel,
)
from ._pretrained import load_config, load_pretrained, split_options

__all__ = [
    "AutoDistributedModel",
    "AutoDistributedModelForCausalLM",
    "AutoDistributedModelForSequenceClassification",
]


class _AutoDistributed:
    _classes: ClassVar[dict[str, type[Any]]] = {}

    def __init__(self) -> None:
        raise TypeError(f"use {type(self).__name__}.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike[str], **kwargs: Any) -> Any:
        """Read the config once, then load the class of its ``model_type`` (see
        ``FromPretrainedMixin.from_pretrained`` for the keyword arguments)."""
        options = split_options(kwargs)
        config = load_config(model_name_or_path, options)
        model_class = cls._classes.get(config.model_type)
        if model_class is None:
            raise ConfigError(
                f"{cls.__name__} has no class for model_type {config.model_type!r}; "
                f"supported: {', '.join(sorted(cls._classes))}"
            )
        return load_pretrained(model_class, model_name_or_path, config=config, options=options)


class AutoDistributedModel(_AutoDistributed):
    """The base model (hidden states) of any supported family."""

    _classes: ClassVar[dict[str, type[Any]]] = {
        "llama": DistributedLlamaModel,
        "bloom": DistributedBloomModel,
        "mixtral": DistributedMixtralModel,
        "falcon": DistributedFalconModel,
    }


class AutoDistributedModelForCausalLM(_AutoDistributed):
    """The causal LM (logits, ``generate()``) of any supported family."""

    _classes: ClassVar[dict[str, type[Any]]] = {
        "llama": DistributedLlamaForCausalLM,
        "bloom": DistributedBloomForCausalLM,
        "mixtral": DistributedMixtralForCausalLM,
        "falcon": DistributedFalconForCausalLM,
    }


class AutoDistributedModelForSequenceClassification(_AutoDistributed):
    """The sequence classifier (local ``score`` head) of any supported family."""

    _classes: ClassVar[dict[str, type[Any]]] = {
        "llama": DistributedLlamaForSequenceClassification,
        "bloom": DistributedBloomForSequenceClassification,
        "mixtral": DistributedMixtralForSequenceClassification,
        "falcon": DistributedFalconForSequenceClassification,
    }
