"""Names that differ between the transformers releases ``pyproject.toml`` admits.

transformers 5.24 renamed the key-value cache of models' inputs and outputs (``forward``'s
argument, the output field, ``generate()``'s model kwargs) from ``past_key_values`` to ``cache``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["CACHE_ARG", "cache_kwargs"]

CACHE_ARG: str = (
    "cache"
    if any(field.name == "cache" for field in dataclasses.fields(CausalLMOutputWithPast))
    else "past_key_values"
)


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword argument that passes ``cache`` to a model or a model output."""
    return {CACHE_ARG: cache}
