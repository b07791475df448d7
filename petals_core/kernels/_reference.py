"""Plain-torch references for every kernel: the semantics the Triton versions must match.

Attention and RMSNorm compute in float32 and cast the result back to the input dtype, which is
also what the Triton kernels do (and what keeps bf16 results stable).  Rotary follows transformers:
it computes in the dtype of its inputs (callers pass cos/sin in the activations' dtype).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "alibi_slopes",
    "attention_reference",
    "rms_norm_reference",
    "rotary_append_reference",
    "rotary_reference",
    "rows_append_reference",
    "rows_attention_reference",
]


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    query_offset: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new queries over a cache prefix.

    q: (B, n_head, T, head_dim), the queries of absolute positions query_offset .. query_offset+T-1
    k, v: (B, n_kv_head, S, head_dim), keys/values of positions 0 .. S-1 (S >= query_offset + T)
    alibi_slopes: (n_head,) float32, adds slope * key_position to the scores (BLOOM)
    key_bias: (B or 1, n_head, S), added to every query's scaled scores of key j: a position term
    computed by the caller (Falcon's ALiBi, which rounds slope * position to bfloat16)
    Query t sees keys 0 .. query_offset + t.  n_head must be a multiple of n_kv_head (GQA).
    key_padding: (B,) integers: row b's first key_padding[b] positions are left padding, hidden
    from the row's real queries (a padding query still sees the keys before it, so that no row
    of scores is empty).
    Returns (B, n_head, T, head_dim) in q's dtype.
    """
    n_head, new, head_dim = q.shape[1:]
    n_kv_head, length = k.shape[1], k.shape[2]
    check_attention_shapes(q, k, query_offset)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = n_head // n_kv_head
    qf, kf, vf = q.float(), k.float(), v.float()
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)  # (B, n_head, S, head_dim)
        vf = vf.repeat_interleave(group, dim=1)
    scores = torch.matmul(qf, kf.transpose(-1, -2)).mul_(scale)  # (B, n_head, T, S)
    key_pos = torch.arange(length, device=q.device)
    if alibi_slopes is not None:
        scores += alibi_slopes.float().view(1, n_head, 1, 1) * key_pos.view(1, 1, 1, -1)
    if key_bias is not None:
        scores += key_bias.float().unsqueeze(2)  # (B or 1, n_head, 1, S)
    if query_offset + new < length or new > 1:
        # Keys after a query's own position are hidden (nothing to hide for a single query at
        # the end of the cache).
        query_pos = query_offset + torch.arange(new, device=q.device)
        scores.masked_fill_(key_pos.view(1, -1) > query_pos.view(-1, 1), float("-inf"))
    if key_padding is not None:
        pads = key_padding.to(q.device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        query_pos = (query_offset + torch.arange(new, device=q.device)).view(1, 1, -1, 1)
        hidden = (key_pos.view(1, 1, 1, -1) < pads) & (query_pos >= pads)  # (B, 1, T, S)
        scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vf).to(q.dtype)


def check_attention_shapes(q: torch.Tensor, k: torch.Tensor, query_offset: int) -> None:
    """Raise ValueError unless the query heads share the key/value heads evenly and the keys
    reach the last query's position (shapes as in :func:`attention_reference`)."""
    n_head, new = q.shape[1], q.shape[2]
    n_kv_head, length = k.shape[1], k.shape[2]
    if n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads cannot share {n_kv_head} key/value heads")
    if length < query_offset + new:
        raise ValueError(f"{length} keys cannot cover queries up to {query_offset + new}")


def check_cache_room(start: int, new_tokens: int, max_length: int) -> None:
    """Raise ValueError unless positions ``start .. start+new_tokens-1`` fit a cache of
    ``max_length`` positions."""
    end = start + new_tokens
    if start < 0 or end > max_length:
        raise ValueError(f"positions {start} .. {end - 1} do not fit a cache of {max_length}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaMA's RMSNorm: x / rms(x) * weight, the mean over the last dimension, in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) by per-position angles, halves layout (HF LLaMA).

    cos, sin: (B or 1, T, head_dim), as transformers' rotary embedding returns them.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def rotary_append_reference(
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
    """Rotate q and k, and write the rotated k and v into the cache at ``start .. start+T-1``.

    q: (B, n_head, T, head_dim); k, v: (B, n_kv_head, T, head_dim); cos, sin: (B or 1, T, head_dim)
    keys, values: (B, n_kv_head, max_length, head_dim), written in place (cast to their dtype)
    Returns the rotated q.
    """
    end = start + k.shape[2]
    check_cache_room(start, k.shape[2], keys.shape[2])
    keys[:, :, start:end] = rotary_reference(k, cos, sin)
    values[:, :, start:end] = v
    return rotary_reference(q, cos, sin)


def rows_append_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    positions: Sequence[int],
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One new token per row, each row with a cache of its own: write row r's key and value into
    ``keys[r]`` / ``values[r]`` (its ``(n_kv_head, max_length, head_dim)`` slab) at
    ``positions[r]``; with ``cos``/``sin`` tables (``(positions, head_dim)``), rotate q and the
    keys by line ``positions[r]`` first and return the rotated q.

    q: (R, n_head, head_dim); k, v: (R, n_kv_head, head_dim).
    """
    rotated = []
    for row, position in enumerate(positions):
        k_row = k[row].unsqueeze(1)  # (n_kv_head, 1, head_dim)
        if cos is not None:
            assert sin is not None
            angles = cos[position].view(1, 1, -1), sin[position].view(1, 1, -1)
            k_row = rotary_reference(k_row.unsqueeze(0), *angles)[0]
            rotated.append(rotary_reference(q[row].view(1, -1, 1, q.shape[-1]), *angles)[0, :, 0])
        keys[row][:, position] = k_row[:, 0]
        values[row][:, position] = v[row]
    return torch.stack(rotated) if cos is not None else None


def rows_attention_reference(
    q: torch.Tensor,
    *,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    positions: Sequence[int],
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row r's query, at position ``positions[r]``, over keys ``0 .. positions[r]`` of its own
    cache slab ``keys[r]`` / ``values[r]`` (``(n_kv_head, max_length, head_dim)``).

    q: (R, n_head, head_dim).  Returns (R, n_head, head_dim) in q's dtype.
    """
    outputs = [
        attention_reference(
            q[row].view(1, q.shape[1], 1, q.shape[2]),
            keys[row][None, :, : position + 1],
            values[row][None, :, : position + 1],
            query_offset=position,
            scale=scale,
            alibi_slopes=alibi_slopes,
        )[0, :, 0]
        for row, position in enumerate(positions)
    ]
    return torch.stack(outputs) if outputs else torch.empty_like(q)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """BLOOM's ALiBi head slopes (float32, (n_head,)), for any number of heads.

    Computed as transformers' ``build_alibi_tensor`` does, powers taken in float32: the slopes
    multiply key positions, so one float32 step of difference shows on long sequences.
    """
    closest = 2 ** math.floor(math.log2(n_head))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest != n_head:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float32)
        remaining = min(closest, n_head - closest)
        extra = torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))
        slopes = torch.cat([slopes, extra])
    return slopes
