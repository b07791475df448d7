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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import alibi_slopes
from .._block_base import CachedBlock
from .._cache import AttentionCache, PositionEncoding

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


class BloomBlock(CachedBlock):
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
        self.cache_heads = (self.n_head, self.head_dim)
        # Not a buffer: ``block.to(torch.bfloat16)`` must not round the slopes.  On the CPU
        # whatever the default device: a block built on "meta" gets real slopes.
        with torch.device("cpu"):
            self.positions = PositionEncoding(slopes=alibi_slopes(config.n_head))

    @property
    def norm_weight(self) -> torch.Tensor:
        return self.input_layernorm.weight

    def layer(self, x: torch.Tensor, attend: AttentionCache) -> torch.Tensor:
        """``position`` is accepted by :meth:`forward` for symmetry with rotary families and
        changes nothing here, since ALiBi depends only on distances."""
        normed = self.input_layernorm(x)  # (B, T, hidden)
        residual = normed if self.residual_after_norm else x
        x = residual + self.self_attention(normed, attend, self.positions)
        normed = self.post_attention_layernorm(x)
        residual = normed if self.residual_after_norm else x
        return residual + self.mlp(normed)
