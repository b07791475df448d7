"""The array operations of a block's decode step in numpy, for the CPU decode backend.

Each is the mathematics of the blocks' torch path (:mod:`petals_core.kernels`' references) over
float32 arrays: norms, activations, projections, rotary, causal attention with ALiBi.  They run
on ``(N, hidden)`` rows (N tokens of every session in a step, one after another).  The activations
work in place on the product they are given; everything else allocates its result.  Results differ
from torch's in rounding only (the order in which a dot product is summed).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "AlibiTable",
    "attend",
    "gelu_tanh",
    "layer_norm",
    "project",
    "rms_norm",
    "rotate",
    "silu",
]

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715 * _SQRT_2_OVER_PI


def project(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x @ weight.T + bias``: ``(N, in)`` by an ``(out, in)`` weight."""
    y = np.matmul(x, weight.T)
    if bias is not None:
        y += bias
    return y


def rotate(
    rows: np.ndarray, batch: int, heads: int, cos: np.ndarray, sin: np.ndarray
) -> np.ndarray:
    """``(B * T, heads * head_dim)`` projections to ``(B, heads, T, head_dim)``, rotated by
    ``cos``, ``sin`` (``(1, 1, T, head_dim)`` each): :func:`kernels.rotary_reference`."""
    new, head_dim = cos.shape[2], cos.shape[3]
    half = head_dim // 2
    x = rows.reshape(batch, new, heads, head_dim).transpose(0, 2, 1, 3)
    rotated = np.concatenate((-x[..., half:], x[..., :half]), axis=-1)
    rotated *= sin
    rotated += x * cos
    return rotated


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """LLaMA's RMSNorm over the last dimension (as ``kernels.rms_norm_reference``)."""
    # ufunc reductions: ndarray.mean is Python code, three times the cost on a decode row.
    scale = np.add.reduce(np.square(x), axis=-1, keepdims=True)
    scale *= 1.0 / x.shape[-1]
    scale += eps
    np.sqrt(scale, out=scale)
    y = x / scale
    y *= weight
    return y


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last dimension (biased variance, as torch's)."""
    inverse_size = 1.0 / x.shape[-1]
    mean = np.add.reduce(x, axis=-1, keepdims=True)
    mean *= inverse_size
    y = x - mean
    scale = np.add.reduce(np.square(y), axis=-1, keepdims=True)
    scale *= inverse_size
    scale += eps
    np.sqrt(scale, out=scale)
    y /= scale
    y *= weight
    y += bias
    return y


def silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``, in place, written with tanh (which cannot overflow)."""
    half = x * 0.5
    np.tanh(half, out=x)
    x += 1.0
    x *= half
    return x


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """The tanh-approximated GELU (BLOOM's), in place:
    ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, the constants folded."""
    inner = np.square(x)
    inner *= _GELU_CUBIC
    inner += _SQRT_2_OVER_PI
    inner *= x
    np.tanh(inner, out=inner)
    inner *= 0.5
    inner += 0.5
    x *= inner
    return x


def attend(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    *,
    start: int,
    scale: float,
    alibi: np.ndarray | None = None,
) -> np.ndarray:
    """Causal attention of ``q`` (B, n_head, T, head_dim), positions ``start .. start + T - 1``,
    over ``keys``/``values`` (B, n_kv_head, start + T, head_dim); with ``alibi``
    ((n_head, >= start + T): ``slope * key_position``, see :class:`AlibiTable`) added to the
    scores.  Returns (B, T, n_head * head_dim).  The semantics of
    :func:`petals_core.kernels.attention_reference` without padding."""
    batch, n_head, new, head_dim = q.shape
    n_kv_head, length = keys.shape[1], keys.shape[2]
    group = n_head // n_kv_head
    # Query heads h*group .. h*group + group - 1 share key/value head h.
    scores = np.matmul(
        q.reshape(batch, n_kv_head, group * new, head_dim), keys.transpose(0, 1, 3, 2)
    )  # (B, n_kv_head, group * T, S)
    scores *= scale
    if alibi is not None or new > 1:
        scores = scores.reshape(batch, n_kv_head, group, new, length)
        if alibi is not None:
            scores += alibi[:, :length].reshape(n_kv_head, group, 1, length)
        if new > 1:
            hidden = np.arange(length) > (start + np.arange(new))[:, None]  # (T, S)
            scores[..., hidden] = -np.inf
        scores = scores.reshape(batch, n_kv_head, group * new, length)
    scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= np.add.reduce(scores, axis=-1, keepdims=True)
    y = np.matmul(scores, values)  # (B, n_kv_head, group * T, head_dim)
    return (
        y.reshape(batch, n_head, new, head_dim)
        .transpose(0, 2, 1, 3)
        .reshape(batch, new, n_head * head_dim)
    )


class AlibiTable:
    """ALiBi's score terms ``slope[h] * j`` for key positions ``j`` so far, ``(n_head, L)``
    float32 (one rounding, as the reference's float32 product), grown by doubling: a step
    then adds a slice instead of building them."""

    def __init__(self, slopes: np.ndarray) -> None:
        self._slopes = slopes.astype(np.float32).reshape(-1, 1)
        self._table: np.ndarray = np.zeros((self._slopes.shape[0], 0), dtype=np.float32)

    def upto(self, length: int) -> np.ndarray:
        """The terms of key positions ``0 .. length - 1`` (a view)."""
        table = self._table
        if table.shape[1] < length:
            size = max(_MIN_ALIBI_POSITIONS, 1 << (length - 1).bit_length())
            table = self._slopes * np.arange(size, dtype=np.float32)
            self._table = table  # one store: safe for readers in other threads
        return table[:, :length]


#: Key positions in the smallest :class:`AlibiTable`.
_MIN_ALIBI_POSITIONS = 256
