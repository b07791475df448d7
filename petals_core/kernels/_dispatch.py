"""Choose each kernel's implementation by device: Triton on CUDA, the torch reference elsewhere.

Kernels launch inside ``torch.cuda.device(<the tensors' device>)``: Triton launches on the current
device, which for a block on ``cuda:1`` need not be the tensors' own.

The Triton kernels are imported only when a CUDA tensor first needs them, so CPU-only programs never
import triton.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from ._reference import (
    attention_reference,
    rms_norm_reference,
    rotary_append_reference,
    rotary_reference,
)

__all__ = ["attention", "rms_norm", "rotary", "rotary_append", "triton_usable"]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    query_offset: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`attention_reference` for shapes and semantics.

    On CUDA: the flash-decoding kernel for up to 16 new tokens, the prefill kernel beyond.
    Elsewhere, and whenever autograd needs a backward: without ALiBi, torch's fused SDPA with the
    same semantics (called as transformers' SDPA attention calls it, so LLaMA blocks match
    transformers' default attention); with ALiBi, the reference (as transformers' BLOOM), except
    for an fp32 decode step (one query at the end of the cache), which gives the ALiBi term to
    SDPA as an additive mask: half the ops of the reference, the same scores.
    """
    if key_padding is not None:
        # Left-padded sessions (batched generation) take the reference path everywhere.
        return attention_reference(
            q,
            k,
            v,
            query_offset=query_offset,
            scale=scale,
            alibi_slopes=alibi_slopes,
            key_padding=key_padding,
        )
    if q.is_cuda and _use_triton(q, k, v):
        from . import _triton_attention

        with torch.cuda.device(q.device):
            return _triton_attention.attention(
                q, k, v, query_offset=query_offset, scale=scale, alibi_slopes=alibi_slopes
            )
    if alibi_slopes is None:
        return _sdpa_attention(q, k, v, query_offset=query_offset, scale=scale)
    if (
        q.shape[2] == 1
        and query_offset == k.shape[2] - 1
        and q.dtype == k.dtype == v.dtype == torch.float32
    ):
        return _sdpa_alibi_decode(q, k, v, scale=scale, alibi_slopes=alibi_slopes)
    return attention_reference(
        q, k, v, query_offset=query_offset, scale=scale, alibi_slopes=alibi_slopes
    )


def _sdpa_alibi_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    alibi_slopes: torch.Tensor,
) -> torch.Tensor:
    """fp32 decode (one query, at the end of the cache) with ALiBi: the reference's scores, the
    ALiBi term given to torch's fused attention as an additive mask (one query sees every key,
    so there is nothing else to mask)."""
    n_head, length = q.shape[1], k.shape[2]
    key_pos = torch.arange(length, device=q.device, dtype=torch.float32)
    bias = alibi_slopes.to(q.device, torch.float32).view(1, n_head, 1, 1) * key_pos.view(
        1, 1, 1, -1
    )  # (1, n_head, 1, S)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, scale=scale, enable_gqa=n_head != k.shape[1]
    )


def _sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_offset: int, scale: float | None
) -> torch.Tensor:
    """The reference's semantics through torch's fused attention (fp32 accumulation inside)."""
    new, length = q.shape[2], k.shape[2]
    if length < query_offset + new:
        raise ValueError(f"{length} keys cannot cover queries up to {query_offset + new}")
    mask = None
    causal = False
    if query_offset == 0 and new == length:
        causal = True
    elif not (new == 1 and query_offset == length - 1):
        # Query t sees keys 0 .. query_offset + t.
        key_pos = torch.arange(length, device=q.device)
        query_pos = query_offset + torch.arange(new, device=q.device)
        mask = key_pos.view(1, -1) <= query_pos.view(-1, 1)  # (T, S)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and _use_triton(x, weight):
        from . import _triton_norm

        with torch.cuda.device(x.device):
            return _triton_norm.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and cos.shape[0] == 1 and _use_triton(x, cos, sin):
        from . import _triton_rotary

        with torch.cuda.device(x.device):
            return _triton_rotary.rotary(x, cos, sin)
    return rotary_reference(x, cos, sin)


def rotary_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """See :func:`rotary_append_reference`: returns the rotated q; the cache gets k and v.

    On CUDA one kernel launch does all three.
    """
    if q.is_cuda and cos.shape[0] == 1 and _use_triton(q, k, v, cos, sin):
        from . import _triton_rotary

        with torch.cuda.device(q.device):
            return _triton_rotary.rotary_append(
                q, k, v, cos, sin, keys=keys, values=values, start=start
            )
    return rotary_append_reference(q, k, v, cos, sin, keys=keys, values=values, start=start)


def _use_triton(*tensors: torch.Tensor) -> bool:
    """Triton for CUDA tensors, unless autograd will need a backward (the kernels have none;
    training takes the torch path, which has one).  Callers test ``is_cuda`` of the first tensor
    before calling (CPU steps skip the call)."""
    first = tensors[0]
    if not first.is_cuda or not _triton_installed() or not _kernels_fit(first.device.index):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: a CUDA device of compute capability 8.0 or
    newer, with triton installed."""
    return device.type == "cuda" and _triton_installed() and _kernels_fit(device.index)


@functools.cache
def _kernels_fit(device_index: int | None) -> bool:
    """The kernels' tiles assume Ampere or newer (shared memory, bf16); older GPUs use torch."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
