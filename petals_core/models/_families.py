"""The block class of each served family, chosen by the config's ``model_type``."""

from __future__ import annotations

from transformers import PreTrainedConfig

from .._errors import ConfigError
from .bloom import BloomBlock
from .falcon import FalconBlock
from .llama import LlamaBlock
from .mixtral import MixtralBlock

__all__ = ["BLOCK_CLASSES", "Block", "new_block"]

#: A transformer block of any served family.
Block = LlamaBlock | BloomBlock | FalconBlock | MixtralBlock

BLOCK_CLASSES: dict[str, type[Block]] = {
    "bloom": BloomBlock,
    "falcon": FalconBlock,
    "llama": LlamaBlock,
    "mixtral": MixtralBlock,
}


def new_block(
    config: PreTrainedConfig, layer_idx: int = 0, *, purpose: str = "build blocks"
) -> Block:
    """Block ``layer_idx`` of the model ``config`` describes, with fresh parameters on torch's
    default device.  Raises :class:`~petals_core.ConfigError` saying that it cannot ``purpose``
    for a ``model_type`` without blocks."""
    block_class = BLOCK_CLASSES.get(config.model_type)
    if block_class is None:
        raise ConfigError(
            f"cannot {purpose} of model_type {config.model_type!r}; "
            f"supported model types: {', '.join(sorted(BLOCK_CLASSES))}"
        )
    return block_class(config, layer_idx=layer_idx)  # type: ignore[arg-type]
