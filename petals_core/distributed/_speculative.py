"""Speculative generation with a small local draft model (Petals' speculative model classes).

``AutoDistributedSpeculativeModel.from_pretrained(name, small_model=draft, initial_peers=[...])``
is the causal LM of ``name`` whose ``generate()`` lets ``draft`` (a local transformers model with
the same vocabulary) propose a window of tokens, then checks the whole window in one step of the
inference session: the servers compute every position of it at once, the longest run the model
agrees with is kept with the model's own next token, and the rest of the servers' caches is
dropped with the next step.  It is transformers' assisted decoding (``assistant_model=``), so
greedy tokens equal plain greedy generation and sampling keeps the model's distribution.
``speculative_inference_iteration_size`` (Petals' name) fixes the window; by default it adapts
as transformers' does.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from .._errors import ConfigError
from ._auto import _AutoDistributed
from ._bloom import DistributedBloomForCausalLM
from ._falcon import DistributedFalconForCausalLM
from ._llama import DistributedLlamaForCausalLM
from ._mixtral import DistributedMixtralForCausalLM

__all__ = [
    "AutoDistributedSpeculativeModel",
    "DistributedBloomForSpeculativeGeneration",
    "DistributedFalconForSpeculativeGeneration",
    "DistributedLlamaForSpeculativeGeneration",
    "DistributedMixtralForSpeculativeGeneration",
    "SpeculativeGenerationMixin",
]


def _draft(small_model: Any) -> Any:
    if small_model is None:
        raise ConfigError(
            "speculative generation needs small_model=: a local transformers causal LM with the "
            "same vocabulary (e.g. AutoModelForCausalLM.from_pretrained(...) of a smaller model)"
        )
    if not callable(getattr(small_model, "generate", None)):
        raise ConfigError(
            f"small_model must be a transformers causal LM, not {type(small_model).__name__}"
        )
    return small_model


class SpeculativeGenerationMixin:
    """``generate()`` drafting with :attr:`small_model` (see the module)."""

    #: The local draft model; kept out of this model's modules (its parameters are not ours
    #: to train, save or move).
    small_model: Any

    @classmethod
    def from_pretrained(
        cls, model_name_or_path: str | os.PathLike[str], *args: Any, **kwargs: Any
    ) -> Any:
        """As the causal LM's, plus ``small_model=`` (required): the draft model."""
        small_model = _draft(kwargs.pop("small_model", None))
        model = super().from_pretrained(model_name_or_path, *args, **kwargs)  # type: ignore[misc]
        object.__setattr__(model, "small_model", small_model)
        return model

    def generate(
        self,
        inputs: Any = None,
        *args: Any,
        speculative_inference_iteration_size: int | None = None,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``generate()`` with ``assistant_model=small_model``;
        ``speculative_inference_iteration_size``: draft windows of that many tokens."""
        draft = kwargs.setdefault("assistant_model", self.small_model)
        if speculative_inference_iteration_size is None:
            return super().generate(inputs, *args, **kwargs)  # type: ignore[misc]
        if speculative_inference_iteration_size < 1:
            raise ValueError(
                "speculative_inference_iteration_size must be >= 1, got "
                f"{speculative_inference_iteration_size}"
            )
        # transformers reads the window from the draft's own generation config.
        config = draft.generation_config
        saved = config.num_assistant_tokens, config.num_assistant_tokens_schedule
        config.num_assistant_tokens = speculative_inference_iteration_size
        config.num_assistant_tokens_schedule = "constant"
        try:
            return super().generate(inputs, *args, **kwargs)  # type: ignore[misc]
        finally:
            config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved


class DistributedLlamaForSpeculativeGeneration(  # type: ignore[misc]  # keywords only
    SpeculativeGenerationMixin, DistributedLlamaForCausalLM
):
    """LLaMA, drafting with a small local model (Petals' class of the same name)."""


class DistributedBloomForSpeculativeGeneration(  # type: ignore[misc]  # keywords only
    SpeculativeGenerationMixin, DistributedBloomForCausalLM
):
    """BLOOM, drafting with a small local model."""


class DistributedFalconForSpeculativeGeneration(  # type: ignore[misc]  # keywords only
    SpeculativeGenerationMixin, DistributedFalconForCausalLM
):
    """Falcon, drafting with a small local model."""


class DistributedMixtralForSpeculativeGeneration(  # type: ignore[misc]  # keywords only
    SpeculativeGenerationMixin, DistributedMixtralForCausalLM
):
    """Mixtral, drafting with a small local model."""


class AutoDistributedSpeculativeModel(_AutoDistributed):
    """The speculative causal LM of any supported family: ``from_pretrained(name,
    small_model=draft, ...)``."""

    _classes: ClassVar[dict[str, type[Any]]] = {
        "llama": DistributedLlamaForSpeculativeGeneration,
        "bloom": DistributedBloomForSpeculativeGeneration,
        "mixtral": DistributedMixtralForSpeculativeGeneration,
        "falcon": DistributedFalconForSpeculativeGeneration,
    }

    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike[str], **kwargs: Any) -> Any:
        small_model = _draft(kwargs.pop("small_model", None))
        model = super().from_pretrained(model_name_or_path, **kwargs)
        object.__setattr__(model, "small_model", small_model)
        return model
