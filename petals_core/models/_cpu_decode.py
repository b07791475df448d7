"""Decode steps of fp32 CPU blocks computed with numpy: the CPU backend of a span of blocks.

A decode step pushes one or two rows of activations through a block: some twenty small array
operations around seven matrix-vector products.  With torch, each small operation costs a few
microseconds of dispatch, more than its arithmetic; numpy's cost per operation is a fraction of
that.  :class:`CpuDecode` computes the steps of at most :data:`MAX_ROWS` rows in all, without left
padding, with the array operations of :mod:`._numpy_ops`: over numpy views of the blocks' weights,
taken once when it is made, carrying the rows from block to block as one array, and appending to
the caches through :meth:`KVCache.append_arrays`.  It declines every other step (see
:class:`SpanSteps`).

Which blocks compute here is decided per block when the backend is made, from what is public: a
block must be exactly a :class:`LlamaBlock` or :class:`BloomBlock` made of the library's own
layers (``nn.Linear``, its norms: not quantised, not wrapped by an adapter), in float32 on the
CPU, with no LoRA adapter, and (LLaMA) a SiLU MLP.  Other blocks of the span take their torch path
(``forward_many``) inside the same step.

The numpy step calls no module, so no forward hook runs.  The blocks' owner makes the backend
once the blocks are final (loaded, quantised, given their adapters), for blocks it has not
hooked, and makes a new one if it changes them: the views are of the weights it saw.

Results differ from the torch path in rounding only (fp32: relative differences around 1e-6).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import torch
from torch import nn

from ..kernels import alibi_slopes, sync_openblas_threads
from . import _numpy_ops as ops
from ._batched import check_many_inputs
from ._cache import KVCache
from ._families import Block
from ._lora import adapter_names
from ._span_steps import Sessions, States
from .bloom import BloomAttention, BloomBlock, BloomMLP
from .llama import LlamaAttention, LlamaBlock, LlamaMLP, LlamaRMSNorm, LlamaRotary

__all__ = ["MAX_ROWS", "CpuDecode", "CpuDecodeChoice"]

#: How a server computes fp32 decode steps on the CPU: with :class:`CpuDecode` where the blocks
#: allow it, or always with the blocks' torch path.
CpuDecodeChoice = Literal["numpy", "torch"]

#: Most rows (batch x new tokens, summed over the sessions of a step) computed here.
MAX_ROWS = 2
#: Positions in the smallest rotary table; tables grow by doubling.
_MIN_ROTARY_POSITIONS = 256

#: The blocks whose steps numpy computes.
NumpyBlock = LlamaBlock | BloomBlock
#: A linear layer's weight and bias (or None), as numpy views.
Weights = tuple[np.ndarray, np.ndarray | None]
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
_CPU = torch.device("cpu")


def block_unsupported_reason(block: nn.Module) -> str | None:
    """Why ``block`` cannot take the numpy step (None if it can)."""
    if type(block) not in (LlamaBlock, BloomBlock):
        return f"a {type(block).__name__}, not a LlamaBlock or BloomBlock"
    if adapter_names(block):
        return "it holds LoRA adapters"
    if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in block.parameters()):
        return "its weights are not float32 on the CPU"
    layers: tuple[nn.Module, ...]
    if isinstance(block, LlamaBlock):
        attn, mlp = block.self_attn, block.mlp
        if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return "its attention or MLP is replaced"
        if not mlp.silu:
            return "its MLP's activation is not SiLU"
        if any(
            type(norm) is not LlamaRMSNorm
            for norm in (block.input_layernorm, block.post_attention_layernorm)
        ):
            return "its norms are replaced"
        layers = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        layers += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    else:
        attention, feed_forward = block.self_attention, block.mlp
        if type(attention) is not BloomAttention or type(feed_forward) is not BloomMLP:
            return "its attention or MLP is replaced"
        for norm in (block.input_layernorm, block.post_attention_layernorm):
            if type(norm) is not nn.LayerNorm or norm.bias is None:
                return "its norms are replaced"
        layers = (attention.query_key_value, attention.dense)
        layers += (feed_forward.dense_h_to_4h, feed_forward.dense_4h_to_h)
    if any(type(layer) is not nn.Linear for layer in layers):
        return "its linear layers are replaced (quantised or wrapped)"
    return None


def _unsupported_reason(blocks: Sequence[nn.Module]) -> str | None:
    if not blocks:
        return "no blocks"
    if not sync_openblas_threads():
        return "numpy has no OpenBLAS (to which the backend gives torch's thread count)"
    reasons = [block_unsupported_reason(block) for block in blocks]
    if all(reasons):
        return f"block 0: {reasons[0]}"
    return None


class CpuDecode:
    """Decode steps of at most :data:`MAX_ROWS` rows through ``blocks`` (a span), computed with
    numpy for the blocks that can (see the module's documentation), with their torch path for
    the others.  Steps of different sessions may run in several threads at once."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        reason = _unsupported_reason(blocks)
        if reason is not None:
            raise ValueError(f"these blocks cannot take the CPU decode step: {reason}")
        self.blocks = list(blocks)
        rotaries: list[_RotaryTable] = []
        alibis: dict[int, ops.AlibiTable] = {}
        self._steps: list[_LlamaStep | _BloomStep | None] = []
        for block in self.blocks:
            if block_unsupported_reason(block) is not None:
                self._steps.append(None)
            elif isinstance(block, LlamaBlock):
                self._steps.append(_LlamaStep(block, _rotary_table(rotaries, block.rotary)))
            elif isinstance(block, BloomBlock):
                if block.n_head not in alibis:
                    alibis[block.n_head] = ops.AlibiTable(alibi_slopes(block.n_head).numpy())
                self._steps.append(_BloomStep(block, alibis[block.n_head]))

    @staticmethod
    def unsupported_reason(blocks: Sequence[nn.Module]) -> str | None:
        """Why no block of ``blocks`` can take the numpy step (None if one can)."""
        return _unsupported_reason(blocks)

    @property
    def numpy_blocks(self) -> int:
        """How many of the blocks compute their steps with numpy."""
        return sum(step is not None for step in self._steps)

    def step(
        self, start: int, end: int, hidden_states: States, caches: Sessions
    ) -> list[torch.Tensor] | None:
        """:meth:`SpanSteps.step`: computed here when the step is decode-sized, in float32 on
        the CPU, without left padding; None otherwise.  Each block checks its caches as its
        ``forward_many`` does before it writes them."""
        if not self._takes(start, end, hidden_states, caches):
            return None
        sync_openblas_threads()
        shapes = [(states.shape[0], states.shape[1]) for states in hidden_states]
        xs: list[torch.Tensor] | None = list(hidden_states)
        x: np.ndarray | None = None  # the rows, (N, hidden), while numpy computes them
        for offset in range(end - start):
            block_caches = [items[offset] for items in caches]
            numpy_step = self._steps[start + offset]
            if numpy_step is None:
                if xs is None:
                    assert x is not None
                    xs = _split_rows(x, shapes)
                xs, x = self.blocks[start + offset].forward_many(xs, block_caches), None
                continue
            numpy_step.check(hidden_states, block_caches)
            if x is None:
                assert xs is not None
                x = _rows(xs)
            x, xs = numpy_step(x, shapes, block_caches), None
        if xs is not None:
            return xs
        assert x is not None
        return _split_rows(x, shapes)

    def _takes(self, start: int, end: int, hidden_states: States, caches: Sessions) -> bool:
        if not 0 <= start < end <= len(self.blocks) or len(hidden_states) != len(caches):
            return False
        rows = 0
        for states, items in zip(hidden_states, caches, strict=True):
            if (
                type(states) not in _PLAIN_TENSORS
                or states.dtype != torch.float32
                or states.device.type != "cpu"
                or states.dim() != 3
                or len(items) != end - start
                or any(
                    not isinstance(cache, KVCache) or cache.padding is not None for cache in items
                )
            ):
                return False
            rows += states.shape[0] * states.shape[1]
        return 0 < rows <= MAX_ROWS


def _rows(hidden_states: Sequence[torch.Tensor]) -> np.ndarray:
    """Every item's rows, one after another: ``(N, hidden)``; a single item's as a view."""
    if len(hidden_states) == 1:
        states = hidden_states[0]
        return states.detach().numpy().reshape(-1, states.shape[-1])
    return np.concatenate(
        [states.detach().numpy().reshape(-1, states.shape[-1]) for states in hidden_states]
    )


def _split_rows(x: np.ndarray, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Undo :func:`_rows`: one ``(B_i, T_i, hidden)`` tensor per item (views of ``x``)."""
    out = []
    start = 0
    for batch, new in shapes:
        end = start + batch * new
        out.append(torch.from_numpy(x[start:end]).view(batch, new, x.shape[-1]))
        start = end
    return out


def _weights(layer: nn.Module) -> Weights:
    assert isinstance(layer, nn.Linear)
    bias = None if layer.bias is None else layer.bias.detach().numpy()
    return layer.weight.detach().numpy(), bias


class _RotaryTable:
    """cos and sin of a :class:`LlamaRotary` for every position so far, ``(positions,
    head_dim)`` float32, grown by doubling: a step then takes a slice.  Frequencies that depend
    on the length (dynamic NTK scaling) are computed for each step instead."""

    def __init__(self, rotary: LlamaRotary) -> None:
        self.rotary = rotary
        self._table: tuple[np.ndarray, np.ndarray] | None = None

    def __call__(self, position: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of positions ``position .. position + length - 1``: ``(1, 1, T, head_dim)``
        each."""
        if self.rotary.rope_type == "dynamic":
            cos, sin = self.rotary(position, length, device=_CPU, dtype=torch.float32)
            return cos.numpy()[:, None], sin.numpy()[:, None]
        end = position + length
        table = self._table
        if table is None or table[0].shape[0] < end:
            size = max(_MIN_ROTARY_POSITIONS, 1 << (end - 1).bit_length())
            cos, sin = self.rotary(0, size, device=_CPU, dtype=torch.float32)
            table = cos[0].numpy(), sin[0].numpy()
            self._table = table  # one store: safe for readers in other threads
        return table[0][None, None, position:end], table[1][None, None, position:end]


def _rotary_table(tables: list[_RotaryTable], rotary: LlamaRotary) -> _RotaryTable:
    """The table in ``tables`` with ``rotary``'s angles, added if there is none."""
    for table in tables:
        if table.rotary.same_angles(rotary):
            return table
    tables.append(_RotaryTable(rotary))
    return tables[-1]


def _checker(
    block: NumpyBlock, kv_heads: int, head_dim: int
) -> Callable[[States, Sequence[KVCache]], None]:
    """What checks a step's items for ``block`` as its ``forward_many`` does, before anything
    is written."""
    return functools.partial(
        check_many_inputs,
        hidden_size=block.hidden_size,
        weight=block.input_layernorm.weight,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )


class _LlamaStep:
    """A :class:`LlamaBlock`'s step over numpy views of its weights."""

    def __init__(self, block: LlamaBlock, angles: _RotaryTable) -> None:
        attn, mlp = block.self_attn, block.mlp
        self.q, self.k, self.v, self.o = map(
            _weights, (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        )
        self.gate, self.up, self.down = map(_weights, (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        norm1, norm2 = block.input_layernorm, block.post_attention_layernorm
        self.norm1, self.eps1 = norm1.weight.detach().numpy(), norm1.eps
        self.norm2, self.eps2 = norm2.weight.detach().numpy(), norm2.eps
        self.n_head, self.n_kv_head, self.head_dim = attn.n_head, attn.n_kv_head, attn.head_dim
        self.angles = angles
        self.check = _checker(block, attn.n_kv_head, attn.head_dim)

    def __call__(
        self, x: np.ndarray, shapes: Sequence[tuple[int, int]], caches: Sequence[KVCache]
    ) -> np.ndarray:
        """``x`` (N, hidden) rows of the items ``shapes`` in, the block's output rows out."""
        n_head, n_kv_head, head_dim = self.n_head, self.n_kv_head, self.head_dim
        h = ops.rms_norm(x, self.norm1, self.eps1)
        q_all, k_all, v_all = (
            ops.project(h, *self.q),
            ops.project(h, *self.k),
            ops.project(h, *self.v),
        )
        outputs = []
        start = 0
        for (batch, new), cache in zip(shapes, caches, strict=True):
            end = start + batch * new
            position = cache.length
            cos, sin = self.angles(position, new)  # (1, 1, T, head_dim) each
            keys, values = cache.append_arrays(
                ops.rotate(k_all[start:end], batch, n_kv_head, cos, sin),
                v_all[start:end].reshape(batch, new, n_kv_head, head_dim).transpose(0, 2, 1, 3),
            )  # (B, n_kv_head, position + T, head_dim) each
            y = ops.attend(
                ops.rotate(q_all[start:end], batch, n_head, cos, sin),
                keys,
                values,
                start=position,
                scale=head_dim**-0.5,
            )
            outputs.append(y.reshape(batch * new, -1))
            start = end
        y = outputs[0] if len(outputs) == 1 else np.concatenate(outputs)
        x = x + ops.project(y, *self.o)
        h = ops.rms_norm(x, self.norm2, self.eps2)
        gate = ops.silu(ops.project(h, *self.gate))
        gate *= ops.project(h, *self.up)
        x += ops.project(gate, *self.down)
        return x


class _BloomStep:
    """A :class:`BloomBlock`'s step over numpy views of its weights."""

    def __init__(self, block: BloomBlock, alibi: ops.AlibiTable) -> None:
        attention, mlp = block.self_attention, block.mlp
        self.qkv, self.dense = _weights(attention.query_key_value), _weights(attention.dense)
        self.h_to_4h, self.to_h = _weights(mlp.dense_h_to_4h), _weights(mlp.dense_4h_to_h)
        norm1, norm2 = block.input_layernorm, block.post_attention_layernorm
        assert norm1.bias is not None and norm2.bias is not None  # block_unsupported_reason
        self.norm1 = norm1.weight.detach().numpy(), norm1.bias.detach().numpy(), norm1.eps
        self.norm2 = norm2.weight.detach().numpy(), norm2.bias.detach().numpy(), norm2.eps
        self.n_head, self.head_dim = block.n_head, block.head_dim
        self.residual_after_norm = block.residual_after_norm
        self.alibi = alibi
        self.check = _checker(block, block.n_head, block.head_dim)

    def __call__(
        self, x: np.ndarray, shapes: Sequence[tuple[int, int]], caches: Sequence[KVCache]
    ) -> np.ndarray:
        """As :meth:`_LlamaStep.__call__`."""
        n_head, head_dim = self.n_head, self.head_dim
        normed = ops.layer_norm(x, *self.norm1)  # (N, hidden)
        qkv_all = ops.project(normed, *self.qkv)  # (N, 3 * hidden), per head [q_h, k_h, v_h]
        outputs = []
        start = 0
        for (batch, new), cache in zip(shapes, caches, strict=True):
            end = start + batch * new
            qkv = qkv_all[start:end].reshape(batch, new, n_head, 3, head_dim)
            position = cache.length
            keys, values = cache.append_arrays(
                qkv[..., 1, :].transpose(0, 2, 1, 3), qkv[..., 2, :].transpose(0, 2, 1, 3)
            )  # (B, n_head, position + T, head_dim) each
            y = ops.attend(
                qkv[..., 0, :].transpose(0, 2, 1, 3),  # (B, n_head, T, head_dim)
                keys,
                values,
                start=position,
                scale=head_dim**-0.5,
                alibi=self.alibi.upto(position + new),
            )
            outputs.append(y.reshape(batch * new, -1))
            start = end
        y = outputs[0] if len(outputs) == 1 else np.concatenate(outputs)
        x = (normed if self.residual_after_norm else x) + ops.project(y, *self.dense)
        normed = ops.layer_norm(x, *self.norm2)
        out = ops.project(ops.gelu_tanh(ops.project(normed, *self.h_to_4h)), *self.to_h)
        out += normed if self.residual_after_norm else x
        return out
