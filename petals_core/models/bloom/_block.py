"""One BLOOM transformer block, numerically equal to transformers' ``BloomBlock`` in eval mode.

Parameter names are transformers' per-layer names, so
``block.load_state_dict(hf_layer.state_dict())`` works and checkpoints load shard by shard.
Differences from transformers, on purpose:

- positions come from ALiBi slopes kept in float32 (never cast with the block: a bf16 slope times
  a position in the thousands is off by whole logits); attention runs through
  :func:`petals_core.kernels.attention`, which computes in float32 and dispatches to Triton on CUDA;
- the cache is our :class:`KVCache`, preallocated per session;
- dropout is not applied: serving and fine-tuning through a swarm both use eval-mode numerics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import alibi_slopes
from .._batched import check_many_inputs, join_tokens, split_tokens
from .._cache import AttentionCache, CacheBatch, KVCache, PositionEncoding, attention_cache

if TYPE_CHECKING:
    from transformers import BloomConfig

__all__ = ["BloomAttention", "BloomBlock", "BloomMLP"]


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """BLOOM's tanh-approximated GELU.

    transformers writes it out as ``x * 0.5 * (1 + tanh(0.79788456 * x * (1 + 0.044715 * x * x)))``;
    0.79788456 and sqrt(2/pi) round to the same float32, so torch's fused op computes the same
    function without five temporaries the size of the MLP's hidden layer.
    """
    return F.gelu(x, approximate="tanh")


class BloomAttention(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.hidden_size // config.n_head
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, cache: AttentionCache, positions: PositionEncoding
    ) -> torch.Tensor:
        """``(B, T, hidden)`` normed states in, the attention's projected output out; the new
        keys and values go into ``cache`` and the queries attend through it."""
        batch, new, _ = x.shape
        # Megatron's fused layout interleaves per head: [q_h, k_h, v_h] for each head h.
        qkv = self.query_key_value(x).view(batch, new, self.n_head, 3, self.head_dim)
        q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]  # (B, T, n_head, head_dim)
        return self.dense(cache.attend(q, k, v, positions))


class BloomMLP(nn.Module):
    def __init__(self, config: BloomConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size)
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(bloom_gelu(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    """LayerNorm -> ALiBi self-attention -> residual -> LayerNorm -> GELU MLP -> residual."""

    def __init__(self, config: BloomConfig, layer_idx: int = 0) -> None:
        super().__init__()
        if config.hidden_size % config.n_head:
            raise ValueError(
                f"hidden_size {config.hidden_size} is not a multiple of n_head {config.n_head}"
            )
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_dim = config.hidden_size // config.n_head
        self.residual_after_norm = config.apply_residual_connection_post_layernorm
        self.hidden_size: int = config.hidden_size
        eps = config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = BloomMLP(config)
        # Not a buffer: ``block.to(torch.bfloat16)`` must not round the slopes.  On the CPU
        # whatever the default device: a block built on "meta" gets real slopes.
        with torch.device("cpu"):
            self.positions = PositionEncoding(slopes=alibi_slopes(config.n_head))

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        cache: AttentionCache | None = None,
        position: int | None = None,
    ) -> torch.Tensor:
        """Run ``(B, T, hidden)`` states of positions ``position .. position + T - 1``.

        With a :class:`KVCache`, their keys and values are appended to it and the queries attend
        over everything it holds; ``position`` defaults to ``cache.length`` and must equal it
        (roll the cache back to resend from earlier).  The cache outlives the call, so that path
        records no autograd graph.  Without a cache the T tokens attend causally among
        themselves, with autograd; ``position`` is accepted for symmetry with rotary families and
        changes nothing, since ALiBi depends only on distances.  Any other
        :class:`AttentionCache` (several sessions joined, a decode graph's row tables) works as a
        cache does.
        """
        attend = attention_cache(
            hidden_states,
            cache,
            position,
            hidden_size=self.hidden_size,
            weight=self.input_layernorm.weight,
        )
        with contextlib.nullcontext() if cache is None else torch.no_grad():
            x = hidden_states
            normed = self.input_layernorm(x)  # (B, T, hidden)
            residual = normed if self.residual_after_norm else x
            x = residual + self.self_attention(normed, attend, self.positions)
            normed = self.post_attention_layernorm(x)
            residual = normed if self.residual_after_norm else x
            return residual + self.mlp(normed)

    def forward_many(
        self, hidden_states: Sequence[torch.Tensor], caches: Sequence[KVCache]
    ) -> list[torch.Tensor]:
        """Run several sessions' steps through this block at once.

        ``hidden_states[i]`` is ``(B_i, T_i, hidden)`` for the session whose cache for this block
        is ``caches[i]`` (``B_i`` rows, its own length, i.e. position); each cache is appended at
        its own length.  Returns what ``self(hidden_states[i], cache=caches[i])`` would return for
        each ``i``: the items' tokens, joined, go through :meth:`forward` once (one matmul per
        layer instead of one per session), attending through a :class:`CacheBatch`.

        Every item is checked before any cache is written: if one is refused, no cache changes.
        Runs without autograd, like the single-step cache path.
        """
        check_many_inputs(
            hidden_states,
            caches,
            hidden_size=self.hidden_size,
            weight=self.input_layernorm.weight,
            kv_heads=self.n_head,
            head_dim=self.head_dim,
        )
        if not hidden_states:
            return []
        shapes = [(states.shape[0], states.shape[1]) for states in hidden_states]
        x = self(join_tokens(hidden_states), cache=CacheBatch(caches, shapes))
        return split_tokens(x, hidden_states)

    def allocate_cache(
        self,
        batch: int,
        max_length: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> KVCache:
        """A cache for ``batch`` rows of up to ``max_length`` positions, by default in the
        dtype and on the device of the block's (never quantised) LayerNorm."""
        reference = self.input_layernorm.weight
        return KVCache.allocate(
            batch=batch,
            kv_heads=self.n_head,
            max_length=max_length,
            head_dim=self.head_dim,
            dtype=reference.dtype if dtype is None else dtype,
            device=reference.device if device is None else device,
        )
