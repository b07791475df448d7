"""Decode steps of fp32 CPU blocks, computed with numpy.

A decode step pushes one or two rows of activations through a block: some twenty small array
operations around seven matrix-vector products.  With torch, each small operation costs a few
microseconds of dispatch, more than its arithmetic; numpy's cost per operation is a fraction of
that, and its products run on OpenBLAS, which streams weights faster on some CPUs (see
:func:`petals_core.kernels.linear`).  So when a step is decode-sized (at most :data:`MAX_ROWS`
rows in all), fp32, on the CPU, and the block is plain — its layers are the library's own, none
hooked, none wrapped by an adapter or quantised — the LLaMA and BLOOM blocks compute it here: the
mathematics of their torch path, over numpy views of the same weights and of the session's cache,
which is written in place.  Everything else takes the torch path.  Results differ from it in
rounding only (fp32: relative differences around 1e-6), as the BLAS products already do.

Measured (``bench blocks`` prints it): a one-token step through a span of tiny LLaMA blocks takes
about 40% less time than the torch path, most of which was per-operation overhead.

The switch is the CPU BLAS switch: ``PETALS_CORE_CPU_BLAS=0`` or ``kernels.set_cpu_blas(False)``
keeps every step on torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as _module_state

from ..kernels import cpu_blas_enabled
from ..kernels._cpu_blas import MAX_BLAS_ROWS
from ._cache import KVCache
from ._linear import Linear

__all__ = [
    "MAX_ROWS",
    "array",
    "AlibiTable",
    "attend",
    "gelu_tanh",
    "layer_norm",
    "linear_weights",
    "plain",
    "rms_norm",
    "silu",
]

#: Most rows (batch x new tokens, summed over the items of a step) computed here.
MAX_ROWS = MAX_BLAS_ROWS

_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)

#: A module's weight and bias (or None) as numpy arrays.
WeightArrays = tuple[np.ndarray, np.ndarray | None]
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715 * _SQRT_2_OVER_PI


def usable(hidden_states: Sequence[torch.Tensor], caches: Sequence[KVCache]) -> bool:
    """Whether a step of these items may run here, as far as the inputs and the process go:
    decode-sized, fp32 CPU tensors, no left padding, room in each cache (the torch path raises
    the errors), no global module hooks, the switch on."""
    rows = 0
    for states, cache in zip(hidden_states, caches, strict=True):
        if (
            type(states) not in _PLAIN_TENSORS
            or states.dtype != torch.float32
            or states.device.type != "cpu"
            or cache.padding is not None
            or cache.length + states.shape[1] > cache.max_length
        ):
            return False
        rows += states.shape[0] * states.shape[1]
    return (
        0 < rows <= MAX_ROWS
        and not _module_state._global_forward_hooks
        and not _module_state._global_forward_pre_hooks
        and cpu_blas_enabled()
    )


def plain(kind: type, *modules: nn.Module | None) -> bool:
    """Each module is exactly a ``kind`` and has no forward hooks (which a step computed here
    would not call)."""
    for module in modules:
        if type(module) is not kind:
            return False
        assert module is not None  # no kind is NoneType
        if module._forward_hooks or module._forward_pre_hooks:
            return False
    return True


def array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of an fp32 CPU tensor; None if it is anything else."""
    if (
        type(tensor) not in _PLAIN_TENSORS
        or tensor.dtype != torch.float32
        or tensor.device.type != "cpu"
    ):
        return None
    return tensor.detach().numpy()


def weight_arrays(modules: Iterable[nn.Module]) -> list[WeightArrays] | None:
    """Each module's ``weight`` and ``bias`` (or None) as numpy views (linear layers,
    LayerNorms); None if any is not fp32 on the CPU."""
    out: list[WeightArrays] = []
    for module in modules:
        parameters = module._parameters
        weight = array(parameters["weight"])  # type: ignore[arg-type]
        if weight is None:
            return None
        bias = parameters["bias"]
        if bias is None:
            out.append((weight, None))
            continue
        bias_array = array(bias)
        if bias_array is None:
            return None
        out.append((weight, bias_array))
    return out


def linear_weights(
    block: nn.Module, containers: Sequence[tuple[str, type, Sequence[str]]]
) -> list[WeightArrays] | None:
    """The weights and biases (numpy views) of ``block``'s linear layers, in order: for each
    ``(name, kind, layers)``, the block's module ``name`` must be exactly a ``kind`` and its
    ``layers`` exactly our :class:`Linear`, none hooked (see :func:`plain`); None otherwise, or
    if a parameter is not fp32 on the CPU.  Modules are read from their dicts (nn.Module's
    ``__getattr__`` is a Python call, and this runs for every block of every step)."""
    linears: list[nn.Module] = []
    modules = block._modules
    for name, kind, layers in containers:
        container = modules[name]
        if not plain(kind, container):
            return None
        assert container is not None  # plain() saw its kind
        inner = container._modules
        linears.extend(inner[layer] for layer in layers)  # type: ignore[misc]
    if not plain(Linear, *linears):
        return None
    return weight_arrays(linears)


def rows_of(hidden_states: Sequence[torch.Tensor]) -> np.ndarray:
    """Every item's rows, one after another: ``(N, hidden)``; a single item's as a view."""
    if len(hidden_states) == 1:
        states = hidden_states[0]
        return states.detach().numpy().reshape(-1, states.shape[-1])
    return np.concatenate(
        [states.detach().numpy().reshape(-1, states.shape[-1]) for states in hidden_states]
    )


def split_rows(x: np.ndarray, hidden_states: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Undo :func:`rows_of`: one ``(B_i, T_i, hidden)`` tensor per item (views of ``x``)."""
    out = []
    start = 0
    for states in hidden_states:
        end = start + states.shape[0] * states.shape[1]
        out.append(torch.from_numpy(x[start:end]).view(states.shape))
        start = end
    return out


def project(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``x @ weight.T + bias``: ``(N, in)`` by an ``(out, in)`` weight."""
    y = np.matmul(x, weight.T)
    if bias is not None:
        y += bias
    return y


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
