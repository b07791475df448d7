"""What the block of every family does the same way around its own layer: the checks and the
autograd choice of ``forward``, several sessions' steps at once (``forward_many``) and the cache a
session allocates for the block.

A family's block (:class:`~petals_core.models.BloomBlock`, ``FalconBlock``, ``LlamaBlock``, and
``MixtralBlock`` through LLaMA's) subclasses :class:`CachedBlock` and says three things: its
layer's computation given what its attention attends through (:meth:`CachedBlock.layer`), the
never-quantised norm weight whose dtype and device are the block's
(:attr:`CachedBlock.norm_weight`), and, when it is built, its cache's layout
(:attr:`CachedBlock.cache_heads`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from ._batched import check_many_inputs, join_tokens, split_tokens
from ._cache import AttentionCache, CacheBatch, KVCache, attention_cache

__all__ = ["CachedBlock"]


class CachedBlock(nn.Module):
    """A transformer block whose attention goes through an :class:`AttentionCache`."""

    #: The width of the hidden states, a plain int: reading a config (transformers overrides its
    #: attribute access) costs a Python call on every step.
    hidden_size: int
    #: ``(kv_heads, head_dim)``: the layout of this block's :class:`KVCache`.
    cache_heads: tuple[int, int]

    @property
    def norm_weight(self) -> torch.Tensor:
        """The weight of the norm before attention: never quantised, so its dtype and device are
        the block's."""
        raise NotImplementedError

    def check_positions(
        self, hidden_states: torch.Tensor, cache: AttentionCache | None, position: int | None
    ) -> None:
        """Refuse, before anything else, positions of a :meth:`forward` call that the block does
        not implement (none by default)."""

    def layer(self, x: torch.Tensor, attend: AttentionCache) -> torch.Tensor:
        """The layer's computation: ``(B, T, hidden)`` states in and out, the attention going
        through ``attend``."""
        raise NotImplementedError

    def forward(
        self,
        hidden_states: torch.Tensor,
        *,
        cache: AttentionCache | None = None,
        position: int | None = None,
    ) -> torch.Tensor:
        """Run ``T`` new positions: ``(B, T, hidden)`` in, ``(B, T, hidden)`` out.

        With a :class:`KVCache`, the new keys/values are appended to it and the queries attend
        over everything it holds; ``position`` (the absolute position of the first new token)
        defaults to ``cache.length`` and must equal it (roll the cache back to resend from
        earlier).  Without a cache, the ``T`` tokens attend causally among themselves from
        ``position`` (default 0); this is the path for training and supports autograd.  Any other
        :class:`AttentionCache` (several sessions joined, a decode graph's row tables) works as a
        cache does.  Steps through a cache run without autograd (a graph kept through the cache
        would grow for a whole session).
        """
        self.check_positions(hidden_states, cache, position)
        attend = attention_cache(
            hidden_states,
            cache,
            position,
            hidden_size=self.hidden_size,
            weight=self.norm_weight,
        )
        with contextlib.nullcontext() if cache is None else torch.no_grad():
            return self.layer(hidden_states, attend)

    def forward_many(
        self, hidden_states: Sequence[torch.Tensor], caches: Sequence[KVCache]
    ) -> list[torch.Tensor]:
        """Run several sessions' steps through this block at once.

        ``hidden_states[i]`` is ``(B_i, T_i, hidden)`` for the session whose cache for this block
        is ``caches[i]`` (``B_i`` rows, its own length, i.e. position); each cache is appended at
        its own length.  Returns what ``self(hidden_states[i], cache=caches[i])`` would return for
        each ``i``: the items' tokens, joined, go through :meth:`forward` once (one matmul per
        projection instead of one per session), attending through a :class:`CacheBatch`.

        Every item is checked before any cache is written: if one is refused, no cache changes.
        Runs without autograd, like the single-step cache path.
        """
        kv_heads, head_dim = self.cache_heads
        check_many_inputs(
            hidden_states,
            caches,
            hidden_size=self.hidden_size,
            weight=self.norm_weight,
            kv_heads=kv_heads,
            head_dim=head_dim,
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
        """An empty cache for a session of ``batch`` rows of up to ``max_length`` positions; by
        default in the dtype and on the device of :attr:`norm_weight`."""
        kv_heads, head_dim = self.cache_heads
        weight = self.norm_weight
        return KVCache.allocate(
            batch=batch,
            kv_heads=kv_heads,
            max_length=max_length,
            head_dim=head_dim,
            dtype=weight.dtype if dtype is None else dtype,
            device=weight.device if device is None else device,
        )
