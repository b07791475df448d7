"""One Falcon decoder layer, numerically equal to transformers' ``FalconDecoderLayer`` in eval mode.

Parameter names are transformers' per-layer names, so
``block.load_state_dict(hf_model.transformer.h[i].state_dict())`` loads a layer of a checkpoint.
Every layout the config admits is supported:

- ``new_decoder_architecture`` (Falcon-40B/180B): grouped-query attention whose fused projection
  holds, per key/value head, its group of queries then one key and one value; attention and MLP in
  parallel, from two LayerNorms (``ln_attn``, ``ln_mlp``) or one (``input_layernorm``);
- ``multi_query`` (Falcon-7B): every query head shares one key/value head; parallel attention and
  MLP from ``input_layernorm``;
- neither: one key/value head per query head, interleaved per head as in BLOOM; with
  ``parallel_attn=False`` the MLP reads ``post_attention_layernorm`` of the attention's residual
  (Falcon-RW).

Positions are rotary (:class:`~petals_core.models.llama.LlamaRotary`, the same as transformers'
``FalconRotaryEmbedding``) or, with ``config.alibi``, ALiBi as transformers' Falcon computes it:
``slope * position`` rounded to bfloat16 (not BLOOM's float32 product), divided by
``sqrt(head_dim)`` and added to the scaled scores.  Differences from transformers, on purpose:

- attention runs through :func:`petals_core.kernels.attention`, in float32 whatever the block's
  dtype (transformers rounds the ALiBi term, scores and probabilities of a bf16 model to bf16);
  with ALiBi that is the reference attention on every device (no kernel takes a bias tensor);
- linears are ``nn.Linear``, adding the bias inside the matmul, where transformers' ``FalconLinear``
  rounds the product to the activations' dtype before adding it: the same in float32 up to one
  rounding, half a bf16 step apart at most in bf16;
- the key/value heads of the new architecture are cached once per group (transformers broadcasts
  them to every query head), and attention shares them across the group;
- the cache is our :class:`KVCache`, preallocated per session; dropout is not applied.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.activations import ACT2FN

from ... import kernels
from .._block_base import CachedBlock
from .._cache import AttentionCache, PositionEncoding
from ..llama._block import LlamaRotary

if TYPE_CHECKING:
    from transformers import FalconConfig

__all__ = ["FalconAttention", "FalconBlock", "FalconMLP"]


class FalconAttention(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        self.n_head: int = config.num_attention_heads
        self.head_dim: int = config.hidden_size // self.n_head
        self.new_decoder_architecture = bool(config.new_decoder_architecture)
        self.multi_query = bool(config.multi_query)
        hidden, bias = config.hidden_size, bool(config.bias)
        if self.new_decoder_architecture:
            self.n_kv_head: int = config.num_kv_heads or self.n_head
            if self.n_head % self.n_kv_head:
                raise ValueError(
                    f"{self.n_head} heads cannot share {self.n_kv_head} key/value heads"
                )
        elif self.multi_query:
            self.n_kv_head = 1
        else:
            # One key/value per head in the fused projection, whatever num_kv_heads says.
            self.n_kv_head = self.n_head
        fused = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.query_key_value = nn.Linear(hidden, fused, bias=bias)
        self.dense = nn.Linear(hidden, hidden, bias=bias)

    def split_heads(
        self, fused: torch.Tensor, batch: int, new: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection of ``batch * new`` tokens, ``(..., (n_head + 2 * n_kv_head) *
        head_dim)``, as q ``(B, T, n_head, head_dim)`` and k, v ``(B, T, n_kv_head, head_dim)``."""
        heads, kv_heads, head_dim = self.n_head, self.n_kv_head, self.head_dim
        if self.new_decoder_architecture:
            # Per key/value head g: its group's queries, then its key, then its value.  Query head
            # h belongs to group h // group, the order grouped-query attention assumes.
            qkv = fused.view(batch, new, kv_heads, heads // kv_heads + 2, head_dim)
            q = qkv[..., :-2, :].reshape(batch, new, heads, head_dim)
            k, v = qkv[..., -2, :], qkv[..., -1, :]  # (B, T, n_kv_head, head_dim)
        elif self.multi_query:
            qkv = fused.view(batch, new, heads + 2, head_dim)
            q, k, v = qkv[:, :, :-2], qkv[:, :, -2:-1], qkv[:, :, -1:]
        else:
            # Megatron's layout, as BLOOM's: [q_h, k_h, v_h] for each head h.
            qkv = fused.view(batch, new, heads, 3, head_dim)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        return q, k, v

    def forward(
        self, x: torch.Tensor, cache: AttentionCache, positions: PositionEncoding
    ) -> torch.Tensor:
        """``(B, T, hidden)`` normed states in, the attention's projected output out; the new
        keys and values go into ``cache`` and the queries attend through it."""
        batch, new, _ = x.shape
        q, k, v = self.split_heads(self.query_key_value(x), batch, new)
        return self.dense(cache.attend(q, k, v, positions))


class FalconMLP(nn.Module):
    def __init__(self, config: FalconConfig) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.bias)
        inner = config.ffn_hidden_size or 4 * hidden  # the config's own default
        self.dense_h_to_4h = nn.Linear(hidden, inner, bias=bias)
        self.act = ACT2FN[config.activation]
        self.dense_4h_to_h = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconBlock(CachedBlock):
    """A Falcon decoder layer; ``state_dict()`` keys are transformers' ``FalconDecoderLayer`` keys.

    Parallel layouts compute ``x + (mlp(norm(x)) + attn(norm(x)))``, the sequential one
    ``x' = x + attn(norm(x))`` then ``x' + mlp(norm(x'))``, in transformers' order of additions.
    """

    def __init__(self, config: FalconConfig, layer_idx: int = 0) -> None:
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size {config.hidden_size} is not a multiple of num_attention_heads "
                f"{config.num_attention_heads}"
            )
        new_architecture = bool(config.new_decoder_architecture)
        # transformers takes two LayerNorms when the new architecture leaves the number unset.
        norms = config.num_ln_in_parallel_attn or (2 if new_architecture else 1)
        if new_architecture and not config.parallel_attn:
            raise ValueError("new_decoder_architecture needs parallel_attn=True")
        if norms == 2 and not new_architecture and config.parallel_attn:
            raise ValueError("num_ln_in_parallel_attn=2 needs new_decoder_architecture=True")
        self.layer_idx = layer_idx
        self.hidden_size: int = config.hidden_size
        self.parallel = new_architecture or bool(config.parallel_attn)
        self.two_norms = new_architecture and norms == 2
        eps = 1e-5 if config.layer_norm_epsilon is None else config.layer_norm_epsilon
        # Registered in transformers' order, so that state_dict() lists its keys in its order.
        self.self_attention = FalconAttention(config)
        self.mlp = FalconMLP(config)
        self.cache_heads = (self.self_attention.n_kv_head, self.self_attention.head_dim)
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
            self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        elif self.two_norms:
            self.ln_attn = nn.LayerNorm(config.hidden_size, eps=eps)
            self.ln_mlp = nn.LayerNorm(config.hidden_size, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.rotary = None if config.alibi else LlamaRotary(config)
        # Plain attributes, not buffers: ``block.to(torch.bfloat16)`` must not round them.  On the
        # CPU whatever the default device: a block built on "meta" still gets real slopes.
        with torch.device("cpu"):
            self._slopes = kernels.alibi_slopes(config.num_attention_heads)  # (n_head,) float32
            self._alibi = torch.empty(config.num_attention_heads, 0)  # see _alibi_terms
        self.positions = (
            PositionEncoding(key_bias=self._key_bias)
            if self.rotary is None
            else PositionEncoding(rotary=self.rotary)
        )

    @property
    def first_norm(self) -> nn.LayerNorm:
        """The LayerNorm before attention (never quantised: its weight gives the block's dtype
        and device)."""
        return self.ln_attn if self.two_norms else self.input_layernorm

    @property
    def norm_weight(self) -> torch.Tensor:
        return self.first_norm.weight

    def layer(self, x: torch.Tensor, attend: AttentionCache) -> torch.Tensor:
        """Rotary angles and ALiBi terms are those of the positions :meth:`forward` is given
        (Falcon's rounded ALiBi is not quite shift-invariant), with or without a cache."""
        attention = self.self_attention
        if self.two_norms:
            attention_out = attention(self.ln_attn(x), attend, self.positions)
            mlp_in = self.ln_mlp(x)
        else:
            mlp_in = self.input_layernorm(x)
            attention_out = attention(mlp_in, attend, self.positions)
        if not self.parallel:
            x = x + attention_out
            return x + self.mlp(self.post_attention_layernorm(x))
        return x + (self.mlp(mlp_in) + attention_out)

    def _key_bias(
        self,
        start: int,
        new: int,
        keys_from: int,
        device: torch.device,
        padding: torch.Tensor | None,
    ) -> torch.Tensor:
        """The ALiBi terms of the keys that tokens ``start .. start + new - 1`` attend to, at
        positions ``keys_from .. start + new - 1``: ``(1 or B, n_head, S)`` float32.

        With ``padding`` ((B,) left-padding lengths), row b counts positions from its first real
        token, as transformers does given an attention mask (padding positions count as 0).
        """
        end = start + new
        table = self._alibi_terms(end, device)  # (n_head, >= end)
        if padding is None:
            return table[None, :, keys_from:end]  # (1, n_head, S)
        key_positions = torch.arange(keys_from, end, device=device)
        rows = (key_positions[None, :] - padding.to(device).view(-1, 1)).clamp(min=0)
        return table[:, rows].transpose(0, 1)  # (B, n_head, S)

    def _alibi_terms(self, length: int, device: torch.device) -> torch.Tensor:
        """ALiBi terms of positions ``0 .. length - 1`` at least, ``(n_head, >= length)`` float32.

        transformers' ``build_alibi_tensor`` for Falcon multiplies bf16 slopes by the positions in
        bf16 (rounding each product to 8 significant bits), and its model divides the result by
        ``sqrt(head_dim)`` before adding it to the scaled scores: the same expressions here.  The
        table grows to the next power of two when a longer one is needed.
        """
        table = self._alibi
        if table.shape[1] < length or table.device != device:
            size = max(table.shape[1], 1 << (max(length, 1) - 1).bit_length())
            positions = torch.arange(size, device=device)  # int64, as transformers' cumsum
            rounded = self._slopes.to(device)[:, None].bfloat16() * positions  # (n_head, size)
            table = rounded.float() / math.sqrt(self.self_attention.head_dim)
            self._alibi = table  # one store: safe for readers in other threads
        return table
