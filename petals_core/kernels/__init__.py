"""Compute kernels used by the blocks, each with a plain-torch reference.

Dispatch picks a Triton kernel for CUDA tensors (when no backward is needed), torch's fused
attention or the reference otherwise.  Triton is imported only when a CUDA tensor needs it.
"""

from ._dispatch import (
    attention as attention,
    rms_norm as rms_norm,
    rotary as rotary,
    rotary_append as rotary_append,
)
from ._reference import (
    alibi_slopes as alibi_slopes,
    attention_reference as attention_reference,
    rms_norm_reference as rms_norm_reference,
    rotary_append_reference as rotary_append_reference,
    rotary_reference as rotary_reference,
)
