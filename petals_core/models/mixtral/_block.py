"""One Mixtral decoder layer, numerically equal to transformers' ``MixtralDecoderLayer``.

Attention, norms and positions are LLaMA's (:class:`~petals_core.models.LlamaBlock`: grouped-query
attention, rotary embeddings with the config's ``rope_theta``, RMSNorm); the MLP is a sparse
mixture of experts.  A router (``gate``) scores each token against ``num_local_experts`` experts;
the softmax of the scores, in float32, picks the ``num_experts_per_tok`` best, whose weights are
renormalised to sum to one; each expert is a SwiGLU MLP (``w2(silu(w1 x) * w3 x)``), and a token's
output is the weighted sum of its experts' outputs.

Parameter names are those of the original checkpoints (``block_sparse_moe.gate.weight``,
``block_sparse_moe.experts.E.w1.weight`` ...), which is also how transformers saves Mixtral: a
layer of ``model.layers.N.`` in a ``model.safetensors`` shard loads as it is.  (transformers
holds the experts in memory as fused 3-D tensors; the values are the same.)

Tokens are grouped by expert: each expert runs once per step on every token routed to it, across
all rows, and across all sessions in :meth:`~petals_core.models.LlamaBlock.forward_many`, whose
feed-forward runs on the sessions' tokens joined.

``sliding_window``: attention over at most that many positions.  Positions past the window are
refused with :class:`ValueError` (no cache of ours drops old keys); Mixtral's released configs set
none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.activations import ACT2FN

from .._cache import AttentionCache, KVCache, step_position
from ..llama._block import LlamaBlock

if TYPE_CHECKING:
    from transformers import MixtralConfig, PretrainedConfig

__all__ = ["MixtralBlock", "MixtralExpert", "MixtralSparseMoE", "state_from_transformers"]


def state_from_transformers(layer: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict of a transformers ``MixtralDecoderLayer`` as it is in memory (``mlp.gate``,
    the experts fused in ``mlp.experts.gate_up_proj`` and ``down_proj``) under the original
    checkpoints' names, which :class:`MixtralBlock` has (views, no copies)."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in layer.items():
        if name == "mlp.gate.weight":
            state["block_sparse_moe.gate.weight"] = tensor
        elif name == "mlp.experts.gate_up_proj":  # (experts, 2 * inner, hidden): w1 then w3
            inner = tensor.shape[1] // 2
            for index, fused in enumerate(tensor):
                state[f"block_sparse_moe.experts.{index}.w1.weight"] = fused[:inner]
                state[f"block_sparse_moe.experts.{index}.w3.weight"] = fused[inner:]
        elif name == "mlp.experts.down_proj":  # (experts, hidden, inner)
            for index, down in enumerate(tensor):
                state[f"block_sparse_moe.experts.{index}.w2.weight"] = down
        else:
            state[name] = tensor
    return state


class MixtralExpert(nn.Module):
    """One expert: a SwiGLU MLP, ``w2(act(w1 x) * w3 x)``."""

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class MixtralSparseMoE(nn.Module):
    """The router and the experts; ``(..., hidden)`` in and out."""

    def __init__(self, config: MixtralConfig) -> None:
        super().__init__()
        self.hidden_size: int = config.hidden_size
        self.num_experts: int = config.num_local_experts
        self.top_k: int = config.num_experts_per_tok
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..{self.num_experts} "
                f"(num_local_experts), got {self.top_k}"
            )
        self.gate = nn.Linear(self.hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(MixtralExpert(config) for _ in range(self.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights: ``(N, hidden)`` -> ``(N, top_k)`` indices and
        ``(N, top_k)`` float32 weights summing to one per token."""
        probabilities = torch.softmax(self.gate(x).float(), dim=-1)  # (N, num_experts)
        weights, experts = torch.topk(probabilities, self.top_k, dim=-1)
        return experts, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor, *, static: bool = False) -> torch.Tensor:
        """``(..., hidden)`` in and out.  ``static``: nothing waits for the device and no shape
        depends on the routing (a CUDA graph captures it): every expert runs on every token, its
        output weighted by zero where the token did not choose it, and added in the same order
        as the eager path adds the chosen ones.  That reads every expert's weights each step,
        which a step of a few rows does anyway (each row picks its own experts)."""
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)  # (N, hidden)
        experts, weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        if static:
            # (N, num_experts): each token's weight for each expert, and whether it chose it.
            shape_dense = (tokens.shape[0], self.num_experts)
            dense = weights.new_zeros(shape_dense).scatter_(1, experts, weights)
            chosen = torch.zeros(shape_dense, dtype=torch.bool, device=tokens.device)
            chosen.scatter_(1, experts, True)
            for index, expert in enumerate(self.experts):
                # Where not chosen, exactly 0: not 0 times the output (an expert a token did not
                # choose may overflow on it, and inf * 0 is NaN).
                y = torch.where(chosen[:, index, None], expert(tokens) * dense[:, index, None], 0)
                out += y.to(out.dtype)
            return out.view(shape)
        # Which experts have tokens: one look at the routing, then one pass per expert over the
        # tokens routed to it, in expert order (the order of the sums, as transformers').
        counts = torch.bincount(experts.flatten(), minlength=self.num_experts)
        for index in counts.nonzero().flatten().tolist():
            token, slot = torch.where(experts == index)  # (M,) each
            y = self.experts[index](tokens[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.view(shape)


class MixtralBlock(LlamaBlock):
    """A Mixtral decoder layer; ``state_dict()`` keys are the original checkpoints' per-layer
    keys."""

    #: Left in the block's dtype by :func:`~petals_core.models.quantize_block`: the router.
    keep_unquantized = ("block_sparse_moe.gate",)

    def __init__(self, config: MixtralConfig, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)  # type: ignore[arg-type]
        window = getattr(config, "sliding_window", None)
        self.sliding_window: int | None = None if window is None else int(window)

    def init_feed_forward(self, config: PretrainedConfig) -> None:
        self.block_sparse_moe = MixtralSparseMoE(config)  # type: ignore[arg-type]

    def feed_forward(self, x: torch.Tensor, *, static: bool = False) -> torch.Tensor:
        return self.block_sparse_moe(x, static=static)

    def _check_window(self, end: int) -> None:
        if self.sliding_window is not None and end > self.sliding_window:
            raise ValueError(
                f"position {end - 1} is past the sliding window of {self.sliding_window} "
                "positions, which this block does not implement"
            )

    def check_positions(
        self, hidden_states: torch.Tensor, cache: AttentionCache | None, position: int | None
    ) -> None:
        """Positions past the sliding window are refused (a :class:`CacheBatch` has had its
        items checked by :meth:`forward_many`)."""
        if (
            self.sliding_window is not None
            and _is_step(hidden_states)
            and (cache is None or isinstance(cache, KVCache))
        ):
            self._check_window(step_position(cache, position) + hidden_states.shape[1])

    def forward_many(
        self, hidden_states: Sequence[torch.Tensor], caches: Sequence[KVCache]
    ) -> list[torch.Tensor]:
        """As :meth:`LlamaBlock.forward_many`; the experts run once over every session's tokens."""
        if self.sliding_window is not None:
            for states, cache in zip(hidden_states, caches, strict=False):
                if _is_step(states) and isinstance(cache, KVCache):
                    self._check_window(cache.length + states.shape[1])
        return super().forward_many(hidden_states, caches)


def _is_step(hidden_states: object) -> bool:
    """Whether ``hidden_states`` is shaped like a step, ``(B, T, hidden)`` (anything else is
    refused by LlamaBlock's own checks, with their messages)."""
    return isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3
