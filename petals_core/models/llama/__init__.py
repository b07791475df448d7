"""LLaMA-family blocks (LLaMA 1-3, SmolLM, Mistral-style GQA) with transformers' weight names."""

from ._block import (
    LlamaAttention as LlamaAttention,
    LlamaBlock as LlamaBlock,
    LlamaMLP as LlamaMLP,
    LlamaRMSNorm as LlamaRMSNorm,
    LlamaRotary as LlamaRotary,
)
