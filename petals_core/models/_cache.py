"""The attention cache of one block for one session: a layout we control.

Preallocated once per session, ``(batch, kv_heads, max_length, head_dim)`` for keys and values, so a
decode step writes one position in place and attention reads a prefix view: no reallocation, no
concatenation, and the server's memory budget is known when the session opens.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from .. import kernels

__all__ = ["KVCache", "check_block_input", "step_position"]


def check_block_input(
    hidden_states: torch.Tensor, *, hidden_size: int, weight: torch.Tensor, cache: KVCache | None
) -> None:
    """Refuse inputs a block would silently miscompute: shape, dtype, device, cache fit.

    ``weight`` is a weight that is never quantised (a norm's): its dtype is the block's compute
    dtype and its device the block's device.
    """
    if (
        hidden_states.dim() != 3
        or hidden_states.shape[1] < 1
        or hidden_states.shape[2] != hidden_size
    ):
        raise ValueError(
            f"hidden_states must be (batch, T >= 1, {hidden_size}), "
            f"got {tuple(hidden_states.shape)}"
        )
    if hidden_states.dtype != weight.dtype:
        raise ValueError(
            f"hidden_states are {hidden_states.dtype} but this block computes in {weight.dtype}: "
            "cast them first"
        )
    if hidden_states.device != weight.device:
        raise ValueError(
            f"hidden_states are on {hidden_states.device} but this block is on {weight.device}"
        )
    if cache is not None:
        if hidden_states.shape[0] != cache.batch:
            raise ValueError(
                f"{hidden_states.shape[0]} rows of hidden states for a cache of {cache.batch} rows"
            )
        if cache.keys.dtype != weight.dtype or cache.keys.device != weight.device:
            raise ValueError(
                f"the cache holds {cache.keys.dtype} on {cache.keys.device}, but this block "
                f"computes in {weight.dtype} on {weight.device}: allocate it with allocate_cache()"
            )


def step_position(cache: KVCache | None, position: int | None) -> int:
    """The absolute position of a step's first new token, checked.

    With a cache, ``position`` defaults to ``cache.length`` and must equal it (a client resending
    from earlier rolls the cache back first); without one it defaults to 0.  Never negative.
    """
    if cache is None:
        position = 0 if position is None else position
    elif position is None:
        position = cache.length
    elif position != cache.length:
        raise ValueError(
            f"the cache holds {cache.length} positions, so the next one is {cache.length}, "
            f"not {position}; roll the cache back to resend from an earlier position"
        )
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return position


class KVCache:
    """Keys and values of one block for one session; ``length`` positions are filled.

    Every row of the batch has the same length (sessions advance in lock-step, as in
    ``generate()``); beams are rows, reordered with :meth:`reorder`.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(
                f"keys and values must both be (batch, kv_heads, max_length, head_dim), "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        self.keys = keys  # (B, n_kv_head, max_length, head_dim)
        self.values = values  # (B, n_kv_head, max_length, head_dim)
        self.length = 0
        #: (B,) int64 or None: how many leading positions of each row are left padding (hidden
        #: from the row's real tokens; LLaMA counts positions from the first real token).
        self.padding: torch.Tensor | None = None
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # numpy views, on first use

    @classmethod
    def allocate(
        cls,
        *,
        batch: int,
        kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (batch, kv_heads, max_length, head_dim)
        return cls(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def batch(self) -> int:
        return self.keys.shape[0]

    @property
    def max_length(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(batch, kv_heads, T, head_dim)`` new entries after the filled positions.

        Returns views of everything filled so far, ``(batch, kv_heads, length, head_dim)``.
        """
        end = self._check_new(keys, values)
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def append_rotated(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and the new ``keys`` by the rotary angles, and append keys and values.

        One fused kernel on CUDA (:func:`petals_core.kernels.rotary_append`).  Returns the rotated
        queries and views of everything filled so far, like :meth:`append`.
        """
        end = self._check_new(keys, values)
        q = kernels.rotary_append(
            q, keys, values, cos, sin, keys=self.keys, values=self.values, start=self.length
        )
        self.length = end
        return q, self.keys[:, :, :end], self.values[:, :, :end]

    def append_arrays(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`append` for numpy arrays (the CPU decode backend computes in numpy), on a cache
        numpy can view (on the CPU, in a dtype numpy has): writes ``(batch, kv_heads, T,
        head_dim)`` new entries and returns numpy views of everything filled so far."""
        end = self._check_shapes(keys.shape, values.shape)
        if self._arrays is None:
            self._arrays = self.keys.numpy(), self.values.numpy()
        key_array, value_array = self._arrays
        key_array[:, :, self.length : end] = keys
        value_array[:, :, self.length : end] = values
        self.length = end
        return key_array[:, :, :end], value_array[:, :, :end]

    def _check_new(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Validate new entries before anything is written; returns the new length."""
        end = self._check_shapes(keys.shape, values.shape)
        if keys.requires_grad or values.requires_grad:
            # Writing into the preallocated buffer would grow one autograd graph over a whole
            # session; training runs without a cache.
            raise ValueError(
                "the cache does not track gradients: run inference under torch.inference_mode() "
                "or torch.no_grad()"
            )
        return end

    def _check_shapes(self, keys: Sequence[int], values: Sequence[int]) -> int:
        """Validate the shapes of new entries; returns the new length."""
        new = keys[2] if len(keys) == 4 else 0
        end = self.length + new
        if end > self.max_length:
            raise ValueError(
                f"the session's cache holds {self.max_length} positions; "
                f"{self.length} are used and {new} more do not fit"
            )
        batch, kv_heads, _, head_dim = self.keys.shape
        if (
            len(keys) != 4
            or tuple(values) != tuple(keys)
            or (keys[0], keys[1], keys[3]) != (batch, kv_heads, head_dim)
        ):
            raise ValueError(
                f"new keys/values must be ({batch}, {kv_heads}, T, {head_dim}), "
                f"got {tuple(keys)} and {tuple(values)}"
            )
        return end

    def set_padding(self, padding: torch.Tensor | None) -> None:
        """Mark each row's first ``padding[b]`` positions as left padding (None: no padding)."""
        if padding is None:
            self.padding = None
            return
        if (
            padding.dtype.is_floating_point
            or padding.dtype == torch.bool
            or padding.shape != (self.batch,)
        ):
            raise ValueError(
                f"padding must be ({self.batch},) integers, got {tuple(padding.shape)}"
            )
        if not bool(((padding >= 0) & (padding <= self.max_length)).all()):
            raise ValueError(f"padding must lie in [0, {self.max_length}]")
        self.padding = padding.to(device=self.keys.device, dtype=torch.int64)

    def rollback(self, position: int) -> None:
        """Forget every position from ``position`` on (a client resending from there)."""
        position = operator.index(position)
        if not 0 <= position <= self.length:
            raise ValueError(f"cannot roll back to {position}: {self.length} positions are filled")
        self.length = position

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Rows become ``rows[hypo_ids]`` (beam search keeps the surviving hypotheses)."""
        if hypo_ids.dtype.is_floating_point or hypo_ids.dtype == torch.bool:
            raise ValueError(f"hypo_ids must be integers (row indices), got {hypo_ids.dtype}")
        if hypo_ids.dim() != 1 or hypo_ids.shape[0] != self.batch:
            raise ValueError(f"hypo_ids must be ({self.batch},), got {tuple(hypo_ids.shape)}")
        if not bool(((hypo_ids >= 0) & (hypo_ids < self.batch)).all()):
            raise ValueError(f"hypo_ids must lie in [0, {self.batch})")
        index = hypo_ids.to(self.keys.device)
        filled = slice(0, self.length)
        self.keys[:, :, filled] = self.keys[index, :, filled]
        self.values[:, :, filled] = self.values[index, :, filled]
        if self.padding is not None:
            self.padding = self.padding[index]
