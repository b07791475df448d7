"""How a span of blocks computes sessions' inference steps: one small interface, three backends.

A server holds a span of blocks and steps many sessions through parts of it.  Whoever owns the
blocks picks, once (when they are loaded, quantised and given their adapters), a backend for
decode steps beside the eager one:

- :class:`EagerSteps`: the blocks' own ``forward_many``, block after block; takes every step;
- :class:`~petals_core.models.CpuDecode`: fp32 CPU steps of a row or two, computed with numpy;
- :class:`~petals_core.models.DecodeGraphs`: one new token per row, replayed from CUDA graphs.

Each offers :meth:`SpanSteps.step`, which either computes a step or declines it (None) before
changing anything; the owner then takes the eager path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ._cache import KVCache
from ._families import Block

__all__ = ["EagerSteps", "Sessions", "SpanSteps", "States"]

#: Each session's hidden states, ``(B_i, T_i, hidden)``.
States = Sequence[torch.Tensor]
#: Each session's caches of the blocks of a step, in order.
Sessions = Sequence[Sequence[KVCache]]


class SpanSteps(Protocol):
    def step(
        self, start: int, end: int, hidden_states: States, caches: Sessions
    ) -> list[torch.Tensor] | None:
        """Sessions' steps through blocks ``start .. end - 1`` (indices into the backend's
        blocks): ``hidden_states[i]`` is ``(B_i, T_i, hidden)`` in the blocks' dtype on their
        device, ``caches[i]`` that session's caches of those blocks.  Returns each item's output
        and advances its caches, as the blocks' ``forward_many`` would, or None, having changed
        nothing, when this backend leaves the step to the eager path."""
        ...


class EagerSteps:
    """The blocks' ``forward_many``, block after block: every step, with every check."""

    def __init__(self, blocks: Sequence[Block]) -> None:
        self.blocks = list(blocks)

    def step(
        self, start: int, end: int, hidden_states: States, caches: Sessions
    ) -> list[torch.Tensor]:
        """:meth:`SpanSteps.step`, never declining: bad input raises what ``forward_many``
        raises."""
        if not 0 <= start < end <= len(self.blocks):
            raise ValueError(f"blocks [{start}, {end}) are not among the {len(self.blocks)} held")
        if len(hidden_states) != len(caches):
            raise ValueError(f"{len(hidden_states)} hidden states for {len(caches)} sessions")
        if any(len(items) != end - start for items in caches):
            raise ValueError(f"each session needs a cache for each of the {end - start} blocks")
        xs = list(hidden_states)
        for offset, block in enumerate(self.blocks[start:end]):
            xs = block.forward_many(xs, [items[offset] for items in caches])
        return xs
