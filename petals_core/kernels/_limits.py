"""What the Triton attention kernels take and when dispatch launches them, known without importing
triton."""

from __future__ import annotations

import torch

__all__ = [
    "CUDA_ATTENTION_DTYPES",
    "MAX_DECODE_ROWS",
    "MAX_DECODE_TOKENS",
    "attention_kernel",
]

#: New tokens per step that the flash-decoding kernel takes (more: the prefill kernel).
MAX_DECODE_TOKENS = 16
#: Query rows (heads of a group x new tokens) that one decode program holds in registers.
MAX_DECODE_ROWS = 128
#: The dtypes the attention kernels are launched for on a GPU.  fp32 attention there goes to
#: torch, whose IEEE fp32 kernels are as exact (the interpreter's CPU tests run the kernels in
#: fp32 as well).
CUDA_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


def attention_kernel(*, dtype: torch.dtype, new_tokens: int, group: int, alibi: bool) -> str | None:
    """The Triton attention kernel that dispatch launches on a GPU for a call of ``new_tokens``
    queries per head, ``group`` query heads per key/value head, with ALiBi or not:
    ``"decode"`` (flash-decoding, or torch's SDPA where that measured faster), ``"prefill"``, or
    None (torch's SDPA).  The prefill kernel runs only with ALiBi: without, SDPA is the
    flash-attention kernel."""
    if dtype not in CUDA_ATTENTION_DTYPES:
        return None
    if new_tokens <= MAX_DECODE_TOKENS and group * new_tokens <= MAX_DECODE_ROWS:
        return "decode"
    return "prefill" if alibi else None
