"""The blocks a server hosts and the blocking computations on them.

Everything here is plain torch and runs in the task pool's worker threads; the RPC layer
(``_inference``, ``_training``) validates requests, schedules these calls and owns the sessions.

Conventions of every call:

- ``start, end`` are absolute block indices inside the hosted span ``[backend.start,
  backend.end)``; a request may use any contiguous part of it;
- hidden states are ``(B, T, hidden)``; they are cast to the blocks' dtype on the way in and the
  outputs back to the caller's dtype on the way out;
- deep prompts are ``(end - start, B or 1, P, hidden)``: before block ``i`` the prompt of that block
  is added to the first ``P`` positions (the trainable prefix of p-tuning v2);
- the active adapter (a LoRA name, or None) is set inside the worker thread, per call.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from typing import get_args

import attrs
import torch
from torch import nn

from .. import kernels
from .._errors import AdapterError
from ..models import (
    Block,
    CpuDecode,
    CpuDecodeChoice,
    DecodeGraphs,
    DecodeGraphsConfig,
    DecodeGraphsStatistics,
    EagerSteps,
    KVCache,
    MixtralSparseMoE,
    SpanSteps,
    using_adapter,
)
from ..protocol import prompts_fit

__all__ = ["BlockBackend", "Graph"]

logger = logging.getLogger("petals_core.server")


@attrs.frozen(kw_only=True, eq=False)
class Graph:
    """A forward's autograd graph: its input and prompt leaves and its output."""

    inputs: torch.Tensor
    prompts: torch.Tensor | None
    output: torch.Tensor


class BlockBackend:
    """Blocks ``start .. start + len(blocks) - 1`` of a model, in ``dtype`` on ``device``."""

    def __init__(
        self,
        blocks: Sequence[Block],
        *,
        start: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        adapters: Sequence[str] = (),
        decode_graphs: DecodeGraphsConfig | None = None,
        cpu_decode: CpuDecodeChoice = "numpy",
    ) -> None:
        """``blocks`` are final: loaded, quantised and given their adapters (the backend of
        decode steps is chosen for them as they are).

        ``decode_graphs``: on CUDA, run decode steps (one new token per row, any number of
        sessions) as replays of CUDA graphs (see :class:`DecodeGraphs`); None keeps every step
        eager.  ``cpu_decode``: on the CPU, ``"numpy"`` computes fp32 steps of a row or two
        with numpy (see :class:`CpuDecode`) where the blocks allow it; ``"torch"`` keeps every
        step on the blocks' torch path."""
        if not blocks:
            raise ValueError("a backend holds at least one block")
        if cpu_decode not in get_args(CpuDecodeChoice):
            raise ValueError(
                f"cpu_decode must be one of {', '.join(get_args(CpuDecodeChoice))}, "
                f"not {cpu_decode!r}"
            )
        self.blocks = list(blocks)
        self.start = start
        self.end = start + len(self.blocks)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.adapters = frozenset(adapters)
        for block in self.blocks:
            block.requires_grad_(False)
            block.eval()
        # One position of one row of one block's cache: the unit of the cache budget.
        self.cache_bytes_per_token = self.blocks[0].allocate_cache(1, 1).nbytes
        # What a backward keeps per token and block (an estimate): each projection's output, a
        # few hidden-sized intermediates (norms, residuals), and attention scores per key.
        first = self.blocks[0]
        self._activation_elements_per_token = _linear_outputs_per_token(first) + 6 * hidden_size
        self._attention_heads = max(
            (h for m in first.modules() if isinstance(h := getattr(m, "n_head", None), int)),
            default=1,
        )
        self._graphs: DecodeGraphs | None = None
        self._eager = EagerSteps(self.blocks)
        #: Tried before the eager path; chosen once, for the blocks as they are now.
        self._decode: SpanSteps | None = self._choose_decode(decode_graphs, cpu_decode)

    def _choose_decode(
        self, decode_graphs: DecodeGraphsConfig | None, cpu_decode: CpuDecodeChoice
    ) -> SpanSteps | None:
        if self.device.type == "cuda" and decode_graphs is not None:
            reason = (
                None if kernels.triton_usable(self.device) else "Triton cannot run on this GPU"
            ) or DecodeGraphs.unsupported_reason(self.blocks)
            if reason is not None:
                logger.info("decode steps: eager (%s)", reason)
                return None
            graphs = self._graphs = DecodeGraphs(self.blocks, config=decode_graphs)
            started = time.perf_counter()
            if not graphs.warm_up():  # logged; petals.info shows why
                return None
            made = graphs.capture_ahead()
            if graphs.disabled_reason is not None:
                return None
            logger.info(
                "decode steps: CUDA graphs, %d captured at load in %.1f s (the whole span, rows "
                "buckets up to %d, lengths up to %s; pool %s), others on first use",
                made,
                time.perf_counter() - started,
                decode_graphs.max_rows,
                decode_graphs.ahead_max_length,
                f"{graphs.statistics().pool_bytes / 2**20:.0f} MiB",
            )
            return graphs
        if self.device.type == "cpu" and cpu_decode == "numpy":
            reason = CpuDecode.unsupported_reason(self.blocks)
            if reason is not None:
                logger.info("decode steps: torch (%s)", reason)
                return None
            steps = CpuDecode(self.blocks)
            logger.info(
                "decode steps of fp32 rows: numpy for %d of %d blocks",
                steps.numpy_blocks,
                len(self.blocks),
            )
            return steps
        return None

    @property
    def decode_steps(self) -> SpanSteps | None:
        """What inference steps are offered before the eager path (None: nothing)."""
        return self._decode

    def decode_graphs_statistics(self) -> DecodeGraphsStatistics | None:
        """The decode graphs' counters, or None when steps run eagerly."""
        return None if self._graphs is None else self._graphs.statistics()

    def decode_graphs_info(self) -> dict[str, int | str | None] | None:
        """:meth:`decode_graphs_statistics` as a plain dict (what ``petals.info`` reports), with
        ``disabled``: why steps went back to the eager path, if they did."""
        if self._graphs is None:
            return None
        info: dict[str, int | str | None] = attrs.asdict(self._graphs.statistics())
        info["disabled"] = self._graphs.disabled_reason
        return info

    def device_memory_reserved_bytes(self) -> int | None:
        """What torch's allocator holds on the blocks' CUDA device (None on other devices)."""
        if self.device.type != "cuda":
            return None
        return int(torch.cuda.memory_reserved(self.device))

    def activation_bytes(self, batch: int, tokens: int) -> int:
        """Estimated bytes one block's autograd graph holds for a ``(batch, tokens)`` input."""
        per_token = self._activation_elements_per_token + 2 * self._attention_heads * tokens
        itemsize = max(self.dtype.itemsize, 4)  # at least fp32: norms and softmax upcast
        return batch * tokens * per_token * itemsize

    # -- checks (on the event loop, before anything is scheduled) --------------------------------

    def span(self, start: int, end: int) -> list[Block]:
        if not self.start <= start < end <= self.end:
            raise ValueError(
                f"blocks [{start}, {end}) are not inside the blocks this server holds, "
                f"[{self.start}, {self.end})"
            )
        return self.blocks[start - self.start : end - self.start]

    def check_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise AdapterError(f"unknown adapter {adapter!r}; this server holds: {known}")

    def check_hidden(self, hidden: object, *, what: str = "hidden_states") -> torch.Tensor:
        if not isinstance(hidden, torch.Tensor):
            raise ValueError(f"{what} must be a tensor, got {type(hidden).__name__}")
        if not hidden.dtype.is_floating_point:
            raise ValueError(f"{what} must be floating point, got {hidden.dtype}")
        if hidden.dim() != 3 or hidden.shape[0] < 1 or hidden.shape[2] != self.hidden_size:
            raise ValueError(
                f"{what} must be (batch >= 1, tokens, {self.hidden_size}), "
                f"got {tuple(hidden.shape)}"
            )
        return hidden

    def check_prompts(self, prompts: object, start: int, end: int, hidden: torch.Tensor) -> None:
        if prompts is None:
            return
        if not isinstance(prompts, torch.Tensor) or not prompts.dtype.is_floating_point:
            raise ValueError("prompts must be a floating-point tensor")
        batch, tokens, _ = hidden.shape
        if not prompts_fit(
            prompts, blocks=end - start, batch=batch, tokens=tokens, hidden_size=self.hidden_size
        ):
            raise ValueError(
                f"prompts must be ({end - start} blocks, 1 or {batch}, prefix <= {tokens} "
                f"tokens, {self.hidden_size}), got {tuple(prompts.shape)}"
            )

    # -- sessions --------------------------------------------------------------------------------

    def allocate_caches(
        self,
        start: int,
        end: int,
        batch: int,
        max_length: int,
        *,
        padding: torch.Tensor | None = None,
    ) -> list[KVCache]:
        caches = [block.allocate_cache(batch, max_length) for block in self.span(start, end)]
        for cache in caches:
            cache.set_padding(padding)
        return caches

    def inference_step(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        caches: Sequence[KVCache],
        *,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> torch.Tensor:
        """Run new positions of one session through blocks ``[start, end)``, appending to its
        caches.  On failure the caches are rolled back to where they were."""
        lengths = [cache.length for cache in caches]
        try:
            with using_adapter(adapter), torch.inference_mode():
                blocks = self.span(start, end)
                x = hidden.to(self.device, self.dtype)
                if self._decode is not None and (prompts is None or prompts.shape[2] == 0):
                    stepped = self._decode.step(start - self.start, end - self.start, [x], [caches])
                    if stepped is not None:
                        return stepped[0].to(hidden.dtype)
                for index, (block, cache) in enumerate(zip(blocks, caches, strict=True)):
                    x = _with_prompt(x, prompts, index)
                    x = block(x, cache=cache)
                return x.to(hidden.dtype)
        except BaseException:
            _restore(caches, lengths)
            raise

    def inference_steps(
        self,
        start: int,
        end: int,
        items: Sequence[tuple[torch.Tensor, Sequence[KVCache]]],
        *,
        adapter: str | None = None,
    ) -> list[torch.Tensor]:
        """Several sessions' steps at once: the decode backend's step, or block by block
        (:meth:`LlamaBlock.forward_many`) where it declines; the same results as
        :meth:`inference_step` for each.  On failure every cache is rolled back."""
        lengths = [[cache.length for cache in caches] for _, caches in items]
        try:
            with using_adapter(adapter), torch.inference_mode():
                self.span(start, end)
                xs = [hidden.to(self.device, self.dtype) for hidden, _ in items]
                sessions = [caches for _, caches in items]
                first, last = start - self.start, end - self.start
                stepped = (
                    None if self._decode is None else self._decode.step(first, last, xs, sessions)
                )
                if stepped is None:
                    stepped = self._eager.step(first, last, xs, sessions)
                return [x.to(hidden.dtype) for x, (hidden, _) in zip(stepped, items, strict=True)]
        except BaseException:
            for (_, caches), saved in zip(items, lengths, strict=True):
                _restore(caches, saved)
            raise

    # -- fine-tuning (stateless) -----------------------------------------------------------------

    def forward_block(
        self,
        index: int,
        hidden: torch.Tensor,
        *,
        prompt: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> torch.Tensor:
        """One block (absolute ``index``) without a cache, without autograd; blocks' dtype out."""
        block = self.span(index, index + 1)[0]
        with using_adapter(adapter), torch.inference_mode():
            x = hidden.to(self.device, self.dtype)
            if prompt is not None:
                x = _add_prompt(x, prompt.to(self.device, self.dtype))
            return block(x)

    def forward_keeping_graph(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        *,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> tuple[torch.Tensor, Graph]:
        """Blocks ``[start, end)`` on ``hidden`` with autograd: the output (blocks' dtype,
        detached) and the graph, from which :meth:`backward_from_graph` takes the gradients
        once without recomputing anything."""
        blocks = self.span(start, end)
        with using_adapter(adapter), torch.enable_grad():
            x = hidden.to(self.device, self.dtype).clone().detach().requires_grad_(True)
            p = None
            if prompts is not None:
                p = prompts.to(self.device, self.dtype).clone().detach().requires_grad_(True)
            y = x
            for index, block in enumerate(blocks):
                y = block(y if p is None else _add_prompt(y, p[index]))
        return y.detach(), Graph(inputs=x, prompts=p, output=y)

    def backward_from_graph(
        self, graph: Graph, grad_output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradients of a kept forward's input and prompts (the graph is freed)."""
        inputs = (graph.inputs,) if graph.prompts is None else (graph.inputs, graph.prompts)
        # materialize_grads: prompts of no positions (P = 0) are not in the graph; their
        # gradient is an empty tensor, not an error.
        grads = torch.autograd.grad(
            graph.output,
            inputs,
            grad_output.to(self.device, self.dtype),
            allow_unused=True,
            materialize_grads=True,
        )
        return grads[0], (grads[1] if graph.prompts is not None else None)

    def backward_span(
        self,
        start: int,
        end: int,
        hidden: torch.Tensor,
        grad_output: torch.Tensor,
        *,
        prompts: torch.Tensor | None = None,
        adapter: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Recompute blocks ``[start, end)`` on their input with autograd, keeping every block's
        activations (one forward for the whole span instead of one per block), and return the
        gradients of the input and of the span's deep prompts (None without prompts), in the
        blocks' dtype."""
        _, graph = self.forward_keeping_graph(start, end, hidden, prompts=prompts, adapter=adapter)
        return self.backward_from_graph(graph, grad_output)


def _with_prompt(x: torch.Tensor, prompts: torch.Tensor | None, index: int) -> torch.Tensor:
    if prompts is None or prompts.shape[2] == 0:
        return x
    return _add_prompt(x, prompts[index].to(x.device, x.dtype))


def _add_prompt(x: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
    """``x`` with ``prompt`` ``(B or 1, P, hidden)`` added to its first ``P`` positions."""
    length = prompt.shape[1]
    if length == 0:
        return x
    head = x[:, :length] + prompt
    return torch.cat([head, x[:, length:]], dim=1)


def _restore(caches: Sequence[KVCache], lengths: Sequence[int]) -> None:
    for cache, length in zip(caches, lengths, strict=True):
        if cache.length > length:
            cache.rollback(length)


def _linear_outputs_per_token(block: nn.Module) -> int:
    """The outputs of the block's linear layers that one token goes through: all of them, but
    of a mixture of experts only the share of experts a token is routed to."""
    total = 0.0
    experts: set[nn.Module] = set()
    for module in block.modules():
        if isinstance(module, MixtralSparseMoE):
            share = module.top_k / module.num_experts
            for expert in module.experts:
                experts.update(expert.modules())
                total += share * sum(
                    m.out_features for m in expert.modules() if isinstance(m, nn.Linear)
                )
    total += sum(
        m.out_features for m in block.modules() if isinstance(m, nn.Linear) and m not in experts
    )
    return math.ceil(total)
