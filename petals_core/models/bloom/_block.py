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

from ...kernels import alibi_slopes, attention
from .._batched import check_many_inputs, join_rows, join_tokens, split_tokens
from .._cache import KVCache, check_block_input, step_position

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
        self,
        x: torch.Tensor,
        slopes: torch.Tensor,
        cache: KVCache | None,
        position: int,
    ) -> torch.Tensor:
        batch, new, hidden = x.shape  # (B, T, hidden)
        # Megatron's fused layout interleaves per head: [q_h, k_h, v_h] for each head h.
        qkv = self.query_key_value(x).view(batch, new, self.n_head, 3, self.head_dim)
        q = qkv[..., 0, :].transpose(1, 2)  # (B, n_head, T, head_dim)
        k = qkv[..., 1, :].transpose(1, 2)
        v = qkv[..., 2, :].transpose(1, 2)
        padding = None
        if cache is not None:
            k, v = cache.append(k, v)  # (B, n_head, position + T, head_dim)
            padding = cache.padding
        y = attention(
            q, k, v, query_offset=position, alibi_slopes=slopes, key_padding=padding
        )  # (B, n_head, T, hd)
        return self.dense(y.transpose(1, 2).reshape(batch, new, hidden))

    def forward_many(
        self,
        x: torch.Tensor,
        shapes: Sequence[tuple[int, int]],
        slopes: torch.Tensor,
        caches: Sequence[KVCache],
    ) -> torch.Tensor:
        """Several sessions' tokens, joined: ``(1, N, hidden)`` in and out, N = sum B_i * T_i.

        The projections run once over all N tokens; the cache append and attention run per item,
        item ``i`` being ``shapes[i] = (B_i, T_i)`` tokens at its cache's length.  The caller has
        validated every item (nothing here may fail half-way).
        """
        hidden = x.shape[-1]
        qkv_all = self.query_key_value(x)  # (1, N, 3 * hidden), per head [q_h, k_h, v_h]
        outputs = []
        start = 0
        for (batch, new), cache in zip(shapes, caches, strict=True):
            end = start + batch * new
            qkv = qkv_all[0, start:end].view(batch, new, self.n_head, 3, self.head_dim)
            q = qkv[..., 0, :].transpose(1, 2)  # (B, n_head, T, head_dim)
            k = qkv[..., 1, :].transpose(1, 2)
            v = qkv[..., 2, :].transpose(1, 2)
            position = cache.length
            k, v = cache.append(k, v)  # (B, n_head, position + T, head_dim)
            y = attention(
                q, k, v, query_offset=position, alibi_slopes=slopes, key_padding=cache.padding
            )  # (B, n_head, T, hd)
            outputs.append(y.transpose(1, 2).reshape(batch * new, hidden))
            start = end
        return self.dense(join_rows(outputs).unsqueeze(0))  # (1, N, hidden)


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
        # A plain attribute, not a buffer: ``block.to(torch.bfloat16)`` must not round the slopes.
        # On the CPU whatever the default device: a block built on "meta" gets real slopes.
        with torch.device("cpu"):
            self._slopes = alibi_slopes(config.n_head)  # (n_head,) float32

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        cache: KVCache | None = None,
        position: int | None = None,
    ) -> torch.Tensor:
        """Run ``(B, T, hidden)`` states of positions ``position .. position + T - 1``.

        With a cache, their keys and values are appended to it and the queries attend over
        everything it holds; ``position`` defaults to ``cache.length`` and must equal it (roll the
        cache back to resend from earlier).  The cache outlives the call, so that path records no
        autograd graph.  Without a cache the T tokens attend causally among themselves, with
        autograd; ``position`` is accepted for symmetry with rotary families and changes nothing,
        since ALiBi depends only on distances.
        """
        check_block_input(
            hidden_states,
            hidden_size=self.input_layernorm.normalized_shape[0],
            weight=self.input_layernorm.weight,
            cache=cache,
        )
        step_position(cache, position)  # checked; ALiBi needs only the cache's length
        offset = 0 if cache is None else cache.length
        # Without a cache: autograd, for training.  With one: none (the cache checks that the new
        # entries fit before writing them).
        with contextlib.nullcontext() if cache is None else torch.no_grad():
            x = hidden_states
            normed = self.input_layernorm(x)  # (B, T, hidden)
            residual = normed if self.residual_after_norm else x
            slopes = self._slopes_on(x.device)
            x = residual + self.self_attention(normed, slopes, cache, offset)
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
        each ``i``.  LayerNorms, projections and the MLP run once over all items' tokens (one
        matmul each instead of one per session); the cache append and attention run per item.

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
        with torch.no_grad():
            x = join_tokens(hidden_states)  # (1, N, hidden)
            shapes = [(states.shape[0], states.shape[1]) for states in hidden_states]
            normed = self.input_layernorm(x)
            residual = normed if self.residual_after_norm else x
            slopes = self._slopes_on(x.device)
            x = residual + self.self_attention.forward_many(normed, shapes, slopes, caches)
            normed = self.post_attention_layernorm(x)
            residual = normed if self.residual_after_norm else x
            return split_tokens(residual + self.mlp(normed), hidden_states)

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

    def _slopes_on(self, device: torch.device) -> torch.Tensor:
        if self._slopes.device != device:
            self._slopes = self._slopes.to(device)
        return self._slopes
