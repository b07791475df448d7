"""Mixtral: LLaMA's grouped-query attention with sparse mixture-of-experts MLPs."""

from ._block import (
    MixtralBlock as MixtralBlock,
    MixtralExpert as MixtralExpert,
    MixtralSparseMoE as MixtralSparseMoE,
    state_from_transformers as state_from_transformers,
)
