"""The cache a distributed model hands to transformers' ``generate()``: a length, no tensors.

The keys and values live on the servers, in the inference session; transformers only needs to know
how many tokens are already processed (to send only the new ones), and to reorder rows for beam
search. :class:`RemoteCache` is a transformers ``Cache`` with one layer that tracks exactly that:
``get_seq_length()`` is the number of tokens (not counting trainable prompts) the session holds,
and ``reorder_cache(beam_idx)`` keeps the indices to send as ``hypo_ids`` with the next step.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["RemoteCache"]


class _LengthLayer(CacheLayerMixin):
    """A cache layer that holds no keys or values: only how many tokens were seen."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, seen_tokens: int) -> None:
        super().__init__()
        self.seen_tokens = seen_tokens
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("a RemoteCache holds no keys or values: they live on servers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen_tokens = 0

    def crop(self, tokens_to_remove: int) -> None:
        # transformers' conventions: zero or a negative count removes that many from the end
        # (assisted decoding crops by -rejected, 0 when every draft token was accepted); a
        # positive one (before transformers 5.2x) keeps that many tokens.
        if tokens_to_remove <= 0:
            self.seen_tokens = max(0, self.seen_tokens + tokens_to_remove)
        else:
            self.seen_tokens = min(self.seen_tokens, tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise AssertionError("RemoteCache.reorder_cache handles reordering")


class RemoteCache(Cache):
    """What ``generate()`` carries between steps of a remote inference session.

    ``get_seq_length()`` says how many tokens the servers already hold (their positions come
    first); the model's forward sends only the tokens after them and advances the count.
    ``reorder_cache(beam_idx)`` (beam search) is remembered and sent as ``hypo_ids`` with the next
    step, where the servers reorder their caches' rows; several reorders before a step compose.
    """

    def __init__(self, seen_tokens: int = 0) -> None:
        if seen_tokens < 0:
            raise ValueError(f"seen_tokens must be >= 0, got {seen_tokens}")
        self._layer = _LengthLayer(seen_tokens)
        super().__init__(layers=[self._layer])
        self._hypo_ids: torch.Tensor | None = None  # (B,) rows to take before the next step

    def __repr__(self) -> str:
        return f"RemoteCache(seen_tokens={self._layer.seen_tokens})"

    def advance(self, tokens: int) -> None:
        """Count ``tokens`` more tokens as processed by the servers."""
        self._layer.seen_tokens += tokens

    def set_seq_length(self, tokens: int) -> None:
        """Set the count (after the session was rolled back or resumed elsewhere)."""
        if tokens < 0:
            raise ValueError(f"the sequence length must be >= 0, got {tokens}")
        self._layer.seen_tokens = tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        order = beam_idx.detach().to("cpu", torch.int64)
        self._hypo_ids = order if self._hypo_ids is None else self._hypo_ids[order]

    def take_hypo_ids(self) -> torch.Tensor | None:
        """The pending row order for the next step (``(B,)``), cleared by taking it."""
        hypo_ids, self._hypo_ids = self._hypo_ids, None
        return hypo_ids

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("a remote inference session cannot repeat its rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("a remote inference session cannot drop rows")
