"""Steps through our blocks as a CPU server computes them by default (``--cpu_decode numpy``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from petals_core.models import Block, CpuDecode, EagerSteps, KVCache

__all__ = ["ServerSteps", "server_steps"]

#: ``(start, end, hidden_states, caches)`` as :meth:`SpanSteps.step`, never declining.
ServerSteps = Callable[[int, int, Sequence[torch.Tensor], Sequence[Sequence[KVCache]]], list]


def server_steps(blocks: Sequence[Block]) -> ServerSteps:
    """The CPU decode backend's step where it takes the step, the eager one elsewhere."""
    eager = EagerSteps(blocks)
    fast = CpuDecode(blocks) if CpuDecode.unsupported_reason(blocks) is None else None

    def step(
        start: int,
        end: int,
        hidden_states: Sequence[torch.Tensor],
        caches: Sequence[Sequence[KVCache]],
    ) -> list[torch.Tensor]:
        stepped = None if fast is None else fast.step(start, end, hidden_states, caches)
        return eager.step(start, end, hidden_states, caches) if stepped is None else stepped

    return step
