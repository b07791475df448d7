"""One LLaMA decoder block, as a server runs it: weights named as in transformers, our KV cache.

The block is ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` with RMSNorm, rotary grouped-query
attention and a SwiGLU MLP. Parameter names are transformers' per-layer names, so
``block.load_state_dict(hf_model.model.layers[i].state_dict())`` loads a layer of a checkpoint.

The block holds no per-session state: one instance serves every session, each bringing its own
:class:`KVCache`. That is why rotary frequencies are a function of the positions being computed only
(see :class:`LlamaRotary` for what this means for dynamic NTK scaling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from ... import kernels
from .._block_base import CachedBlock
from .._cache import AttentionCache, PositionEncoding

__all__ = ["LlamaAttention", "LlamaBlock", "LlamaMLP", "LlamaRMSNorm", "LlamaRotary"]

# RoPE types whose frequencies depend on the configuration alone; "dynamic" also on the length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class LlamaRotary:
    """cos/sin of the rotary embedding for absolute positions, with transformers' RoPE scalings.

    Frequencies and attention scaling come from transformers' own ``ROPE_INIT_FUNCTIONS`` and the
    values match ``LlamaRotaryEmbedding`` (float32, then cast like it casts). Dynamic NTK scaling
    recomputes the frequencies from the end of the chunk being computed whenever it lies past
    ``max_position_embeddings``. transformers keeps a high-water mark in the module instead, which
    gives the same result as long as positions only grow; a block shared by many sessions, any of
    which may roll back, cannot keep that state, so here the result depends on the inputs alone.

    Falcon's rotary embedding is the same (transformers copies it from LLaMA's): Falcon blocks use
    this class too.
    """

    def __init__(self, config: PretrainedConfig) -> None:
        if not config.rope_parameters:
            raise ValueError("the config has no rope_parameters")
        self.config = config
        self.rope_type: str = config.rope_parameters.get("rope_type") or "default"
        if self.rope_type not in (*_STATIC_ROPE_TYPES, "dynamic"):
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported for LLaMA blocks; "
                f"supported: {', '.join((*_STATIC_ROPE_TYPES, 'dynamic'))}"
            )
        init: Callable[..., tuple[torch.Tensor, float]] = ROPE_INIT_FUNCTIONS.get(
            self.rope_type, LlamaRotaryEmbedding.compute_default_rope_parameters
        )
        self._init = init
        # On the CPU whatever the default device: a block built on "meta" (to count its
        # parameters) still gets real frequencies.
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = self._init(config)
        # A plain attribute, not a buffer, so that ``block.to(bfloat16)`` leaves it in float32.
        self.inv_freq = inv_freq  # (head_dim // 2,) float32
        self.original_max_length: int = config.max_position_embeddings
        # What makes two instances' angles equal: every block of a model has its own instance,
        # and a server step asks each of them for the same positions (see ``__call__``).
        self._identity = (self.rope_type, self.attention_scaling, tuple(inv_freq.tolist()))

    def same_angles(self, other: LlamaRotary) -> bool:
        """Whether ``other`` gives the same angles for every position."""
        return self._identity == other._identity

    def _rescaled(self, end: int) -> bool:
        """Whether a chunk ending at ``end - 1`` has frequencies of its own (dynamic NTK)."""
        return self.rope_type == "dynamic" and end > self.original_max_length

    def inv_freq_for(self, end: int, device: torch.device) -> torch.Tensor:
        """Frequencies for a chunk whose last position is ``end - 1``."""
        if self._rescaled(end):
            # A tensor seq_len, as transformers passes it, so the new base is computed the same way.
            seq_len = torch.tensor(end, device=device)
            inv_freq, _ = self._init(self.config, device, seq_len=seq_len)
            return inv_freq
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def __call__(
        self,
        position: int,
        length: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``position .. position + length - 1``, each (1, T, head_dim).

        With ``padding`` ((B,) left-padding lengths), row b counts positions from its first real
        token, as transformers' generate() does for left-padded batches: (B, T, head_dim).

        Under ``torch.inference_mode()``, without padding and with frequencies that do not depend
        on the length, the last result is kept and handed to the next call with the same
        arguments, from this instance or any other with the same frequencies: the blocks of a
        server's span all ask for the angles of the same positions in one step.  (Inference
        tensors, never written to, cannot leak into autograd: only inference mode reuses them.)
        """
        key = None
        if (
            padding is None
            and not self._rescaled(position + length)
            and torch.is_inference_mode_enabled()
        ):
            key = (self._identity, position, length, device, dtype)
            last = _last_angles[0]
            if last is not None and last[0] == key:
                return last[1]
        inv_freq = self.inv_freq_for(position + length, device)
        positions = torch.arange(position, position + length, device=device)[None, :]  # (1, T)
        if padding is not None:
            positions = (positions - padding.to(device).view(-1, 1)).clamp(min=0)  # (B, T)
        freqs = positions[:, :, None].float() * inv_freq  # (B or 1, T, head_dim // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (1, T, head_dim)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        angles = cos.to(dtype), sin.to(dtype)
        if key is not None:
            _last_angles[0] = (key, angles)  # one store: safe for readers in other threads
        return angles


#: The angles :class:`LlamaRotary` computed last under inference mode, with their key.
_last_angles: list[tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] | None] = [None]


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head: int = config.num_attention_heads
        self.n_kv_head: int = config.num_key_value_heads or self.n_head
        self.head_dim: int = config.head_dim or config.hidden_size // config.num_attention_heads
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{self.n_head} heads cannot share {self.n_kv_head} key/value heads")
        # Mixtral's config has no attention_bias: its projections have none.
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.n_head * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_head * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_head * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, hidden, bias=bias)

    def forward(
        self, x: torch.Tensor, cache: AttentionCache, positions: PositionEncoding
    ) -> torch.Tensor:
        """``(B, T, hidden)`` normed states in, the attention's projected output out; the new
        keys and values go into ``cache`` and the queries attend through it."""
        batch, new, _ = x.shape
        q = self.q_proj(x).view(batch, new, self.n_head, self.head_dim)
        k = self.k_proj(x).view(batch, new, self.n_kv_head, self.head_dim)
        v = self.v_proj(x).view(batch, new, self.n_kv_head, self.head_dim)
        return self.o_proj(cache.attend(q, k, v, positions))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]
        #: Whether the activation is SiLU, which the CPU decode backend computes.
        self.silu: bool = config.hidden_act in ("silu", "swish")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(CachedBlock):
    """A LLaMA decoder layer; ``state_dict()`` keys are transformers' ``LlamaDecoderLayer`` keys."""

    def __init__(self, config: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.self_attn = LlamaAttention(config)
        self.init_feed_forward(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # A plain int: reading the config (transformers overrides its attribute access) costs a
        # Python call on every step.
        self.hidden_size: int = config.hidden_size
        self.rotary = LlamaRotary(config)
        self.positions = PositionEncoding(rotary=self.rotary)
        self.cache_heads = (self.self_attn.n_kv_head, self.self_attn.head_dim)

    def init_feed_forward(self, config: PretrainedConfig) -> None:
        """Build the part after attention (a family with another one overrides this and
        :meth:`feed_forward`)."""
        self.mlp = LlamaMLP(config)  # type: ignore[arg-type]

    def feed_forward(self, x: torch.Tensor, *, static: bool = False) -> torch.Tensor:
        """The part after attention, on the normed residual: ``(..., hidden)`` in and out;
        ``static``: without waiting for the device (see :attr:`AttentionCache.static`)."""
        return self.mlp(x)

    @property
    def norm_weight(self) -> torch.Tensor:
        return self.input_layernorm.weight

    def layer(self, x: torch.Tensor, attend: AttentionCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), attend, self.positions)
        x = x + self.feed_forward(self.post_attention_layernorm(x), static=attend.static)
        return x
