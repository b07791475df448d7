"""Helpers for running several sessions' steps through one block at once (``forward_many``).

A server with many concurrent sessions gets many small steps for the same block at the same time.
The token-wise parts of a block (norms, projections, MLP) do not care which session a token belongs
to, so the tokens of all sessions go through them as one ``(1, N, hidden)`` matrix; only rotary,
the cache append and attention run per session, each at its own cache length.

Everything is validated before any cache is touched, so a refused batch leaves every cache as it
was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._cache import KVCache, check_block_input

__all__ = ["check_many_inputs", "join_rows", "join_tokens", "split_tokens", "token_counts"]


def check_many_inputs(
    hidden_states: Sequence[torch.Tensor],
    caches: Sequence[KVCache],
    *,
    hidden_size: int,
    weight: torch.Tensor,
    kv_heads: int,
    head_dim: int,
) -> None:
    """Refuse a batch of steps any of which the single-step path would refuse, plus repeated caches.

    Checks, per item: the input's shape, dtype and device, the cache's rows, dtype, device and
    layout (``kv_heads``, ``head_dim``), and that the cache has room for the new positions; across
    items, that no cache (or cache buffer) appears twice.  ``weight`` is a never-quantised weight
    of the block (a norm's), as for :func:`check_block_input`.
    """
    if len(hidden_states) != len(caches):
        raise ValueError(
            f"{len(hidden_states)} hidden states for {len(caches)} caches: "
            "each item needs its own cache"
        )
    seen: dict[int, int] = {}  # id(cache) or keys' address -> index of the first item using it
    for index, (states, cache) in enumerate(zip(hidden_states, caches, strict=True)):
        if not isinstance(cache, KVCache):
            raise TypeError(f"caches[{index}] is a {type(cache).__name__}, not a KVCache")
        try:
            check_block_input(states, hidden_size=hidden_size, weight=weight, cache=cache)
        except ValueError as error:
            raise ValueError(f"item {index}: {error}") from error
        _, cache_heads, max_length, cache_head_dim = cache.keys.shape
        if (cache_heads, cache_head_dim) != (kv_heads, head_dim):
            raise ValueError(
                f"item {index}: the cache holds {cache_heads} heads of {cache_head_dim}, but this "
                f"block has {kv_heads} key/value heads of {head_dim}: allocate it with "
                "allocate_cache()"
            )
        new = states.shape[1]
        if cache.length + new > max_length:
            raise ValueError(
                f"item {index}: the session's cache holds {max_length} positions; "
                f"{cache.length} are used and {new} more do not fit"
            )
        keys = [id(cache)]
        if cache.keys.numel():  # empty tensors may all report address 0
            keys += [cache.keys.data_ptr(), cache.values.data_ptr()]
        for key in keys:
            if key in seen:
                raise ValueError(
                    f"caches[{index}] is (or shares its buffers with) caches[{seen[key]}]: "
                    "each item must be a different session"
                )
        for key in keys:
            seen[key] = index


def join_tokens(hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every token of every item, one after another: ``(1, sum B_i * T_i, hidden)``.

    Item ``i``'s tokens are row-major over its ``(B_i, T_i)``, so a slice of the result views back
    as ``(B_i, T_i, hidden)``.
    """
    hidden = hidden_states[0].shape[-1]
    if len(hidden_states) == 1:  # one session's step (the usual decode): a view, no copy
        return hidden_states[0].reshape(1, -1, hidden)
    return torch.cat([states.reshape(1, -1, hidden) for states in hidden_states], dim=1)


def join_rows(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The items' per-token rows one after another (``torch.cat`` along dim 0); a single
    item's rows as they are, without a copy."""
    return pieces[0] if len(pieces) == 1 else torch.cat(list(pieces))


def token_counts(hidden_states: Sequence[torch.Tensor]) -> list[int]:
    """``B_i * T_i`` for each item: the lengths of the items' slices of :func:`join_tokens`."""
    return [states.shape[0] * states.shape[1] for states in hidden_states]


def split_tokens(x: torch.Tensor, hidden_states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Undo :func:`join_tokens`: ``(1, N, hidden)`` back to one ``(B_i, T_i, hidden)`` per item."""
    pieces = x.split(token_counts(hidden_states), dim=1)
    return [
        piece.view(states.shape[0], states.shape[1], x.shape[-1])
        for piece, states in zip(pieces, hidden_states, strict=True)
    ]
