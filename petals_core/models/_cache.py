"""Where a block's attention writes its new keys and values and reads the ones it attends to.

Every family computes a block one way, whatever holds its keys: its attention projects the
tokens, then hands its queries, keys and values to an :class:`AttentionCache`, which places them
(:class:`PositionEncoding`: rotary angles or ALiBi), stores the keys and values, and attends.
The implementations:

- :class:`KVCache`: one session's cache of one block, a layout we control: preallocated once per
  session, ``(batch, kv_heads, max_length, head_dim)`` for keys and values, so a decode step writes
  one position in place and attention reads a prefix view: no reallocation, no concatenation, and
  the server's memory budget is known when the session opens;
- :class:`CacheBatch`: several sessions' caches, their tokens joined into one sequence so that the
  projections and the MLP run once for all of them (``forward_many``);
- :class:`Uncached`: no cache, the tokens attend causally among themselves (training, with
  autograd);
- the row tables of a decode graph (``petals_core.models._decode_graphs``): one new token per row,
  each row's cache found through a pointer on the device.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from .. import kernels

__all__ = [
    "AttentionCache",
    "CacheBatch",
    "KVCache",
    "PositionEncoding",
    "Uncached",
    "attention_cache",
    "check_block_input",
    "step_position",
]


class Rotary(Protocol):
    def __call__(
        self,
        position: int,
        length: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        padding: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of positions ``position .. position + length - 1``: ``(1 or B, T, head_dim)``
        each (``B`` rows with ``padding``, whose row b counts from its first real token)."""
        ...


#: Falcon's ALiBi: ``key_bias(start, new, keys_from, device, padding)``, the term of each key at
#: positions ``keys_from .. start + new - 1``, ``(1 or B, n_head, S)`` float32.
KeyBias = Callable[[int, int, int, torch.device, "torch.Tensor | None"], torch.Tensor]


class PositionEncoding:
    """How a block's attention tells positions apart; at most one of:

    - ``rotary``: angles by which queries and keys are rotated (LLaMA, Mixtral, rotary Falcon);
    - ``slopes``: BLOOM's ALiBi slopes, ``(n_head,)`` float32 (never cast with the block: a bf16
      slope times a position in the thousands is off by whole logits), which the attention
      kernels multiply by key positions in float32;
    - ``key_bias``: Falcon's ALiBi, whose terms are rounded to bfloat16 (:data:`KeyBias`).
    """

    __slots__ = ("_slopes_by_device", "key_bias", "rotary", "slopes")

    def __init__(
        self,
        *,
        rotary: Rotary | None = None,
        slopes: torch.Tensor | None = None,
        key_bias: KeyBias | None = None,
    ) -> None:
        if sum(part is not None for part in (rotary, slopes, key_bias)) > 1:
            raise ValueError("a block's positions are rotary, ALiBi slopes or a key bias")
        self.rotary = rotary
        self.slopes = slopes
        self.key_bias = key_bias
        self._slopes_by_device: dict[torch.device, torch.Tensor] = {}

    def slopes_on(self, device: torch.device) -> torch.Tensor | None:
        """The ALiBi slopes on ``device`` (copied there once), contiguous; None without."""
        if self.slopes is None:
            return None
        slopes = self._slopes_by_device.get(device)
        if slopes is None:
            with torch.inference_mode(False):
                slopes = self.slopes.to(device).contiguous()
            self._slopes_by_device[device] = slopes
        return slopes


class AttentionCache(Protocol):
    """Where a block's attention stores new keys and values and finds the ones it attends to."""

    #: Whether the step runs in a CUDA graph (or as one would): nothing in it may wait for the
    #: device or change shape with the data (Mixtral's experts then run on every row).
    static: bool

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: PositionEncoding
    ) -> torch.Tensor:
        """Attention of the new tokens: q ``(B, T, n_head, head_dim)``, k and v ``(B, T,
        n_kv_head, head_dim)``, as the projections lay them out (any strides with the last one
        1); returns ``(B, T, n_head * head_dim)``, for the output projection."""
        ...


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

    static = False

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

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: PositionEncoding
    ) -> torch.Tensor:
        """:meth:`AttentionCache.attend`: the new tokens at positions ``length ..`` (each row
        counted from its first real token where there is left padding), appended; the queries
        attend over everything filled."""
        batch, new, heads, head_dim = q.shape
        position = self.length
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, d)
        if positions.rotary is not None:
            cos, sin = positions.rotary(
                position, new, device=q.device, dtype=q.dtype, padding=self.padding
            )
            # Rotate q and k, and write k and v into the cache: one kernel on CUDA.
            q, keys, values = self.append_rotated(q, k, v, cos, sin)
        else:
            keys, values = self.append(k, v)
        bias = None
        if positions.key_bias is not None:
            bias = positions.key_bias(position, new, 0, q.device, self.padding)
        y = kernels.attention(
            q,
            keys,
            values,
            query_offset=position,
            alibi_slopes=positions.slopes_on(q.device),
            key_padding=self.padding,
            key_bias=bias,
        )  # (B, heads, T, head_dim)
        return y.transpose(1, 2).reshape(batch, new, heads * head_dim)

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


class CacheBatch:
    """Several sessions' caches, their steps' tokens joined into one sequence: ``q``, ``k`` and
    ``v`` of :meth:`attend` are ``(1, N, heads, head_dim)``, N = sum B_i * T_i, item ``i`` being
    ``shapes[i] = (B_i, T_i)`` tokens of the session whose cache is ``caches[i]``.  Each item is
    attended in its own cache at its own length; the caller has validated every item."""

    static = False

    def __init__(self, caches: Sequence[KVCache], shapes: Sequence[tuple[int, int]]) -> None:
        self.caches = caches
        self.shapes = shapes

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: PositionEncoding
    ) -> torch.Tensor:
        _, _, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        outputs = []
        start = 0
        for (batch, new), cache in zip(self.shapes, self.caches, strict=True):
            end = start + batch * new
            y = cache.attend(
                q[0, start:end].view(batch, new, heads, head_dim),
                k[0, start:end].view(batch, new, kv_heads, head_dim),
                v[0, start:end].view(batch, new, kv_heads, head_dim),
                positions,
            )  # (B_i, T_i, heads * head_dim)
            outputs.append(y.view(batch * new, heads * head_dim))
            start = end
        # A single item's rows as they are, without a copy.
        joined = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return joined.unsqueeze(0)


class Uncached:
    """No cache: the new tokens attend causally among themselves, placed at positions
    ``position ..`` (which sets rotary angles and Falcon's rounded ALiBi terms; BLOOM's ALiBi
    depends on distances only).  Autograd flows through it: training takes this path."""

    static = False

    def __init__(self, position: int = 0) -> None:
        self.position = position

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: PositionEncoding
    ) -> torch.Tensor:
        batch, new, heads, head_dim = q.shape
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, d)
        if positions.rotary is not None:
            cos, sin = positions.rotary(self.position, new, device=q.device, dtype=q.dtype)
            q = kernels.rotary(q, cos, sin)
            k = kernels.rotary(k, cos, sin)
        bias = None
        if positions.key_bias is not None:
            bias = positions.key_bias(self.position, new, self.position, q.device, None)
        y = kernels.attention(
            q, k, v, query_offset=0, alibi_slopes=positions.slopes_on(q.device), key_bias=bias
        )
        return y.transpose(1, 2).reshape(batch, new, heads * head_dim)


def attention_cache(
    hidden_states: torch.Tensor,
    cache: AttentionCache | None,
    position: int | None,
    *,
    hidden_size: int,
    weight: torch.Tensor,
) -> AttentionCache:
    """What a block's ``forward(hidden_states, cache=..., position=...)`` attends through,
    after refusing what the block would silently miscompute (see :func:`check_block_input`):
    ``cache`` itself (a :class:`KVCache` at ``position``, if given), or, without one,
    :class:`Uncached` at ``position`` (default 0)."""
    check_block_input(
        hidden_states,
        hidden_size=hidden_size,
        weight=weight,
        cache=cache if isinstance(cache, KVCache) else None,
    )
    if cache is None:
        return Uncached(step_position(None, position))
    if isinstance(cache, KVCache):
        step_position(cache, position)
    elif position is not None:
        raise ValueError("position is that of a KVCache's next token, or of a step without one")
    return cache
