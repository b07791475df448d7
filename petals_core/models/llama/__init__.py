"""LLaMA-family blocks (LLaMA 1-3, SmolLM, Mistral-style GQA) with transformers' weight names."""

from ._block import LlamaBlock as LlamaBlock, LlamaRotary as LlamaRotary
