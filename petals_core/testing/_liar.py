"""A lying server, for tests and benchmarks of the client's checks: its backend moves every
output of a forward and of an inference step by a share of its scale.  A test double applied to
a running server (:func:`make_liar`); the shipped server has no such mode."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..server import Server

__all__ = ["make_liar"]

#: The backend's methods whose outputs leave the server, by the kind of answer.
_ANSWERING = {
    "forward": ("forward_block", "forward_keeping_graph"),
    "step": ("inference_step", "inference_steps"),
    "backward": ("backward_span", "backward_from_graph"),
}


def make_liar(
    server: Server,
    *,
    by: float = 0.2,
    lies: Collection[str] = ("forward", "step"),
    share: float = 1.0,
    seed: int = 0,
) -> None:
    """From now on, ``server`` answers ``lies`` (``"forward"``, ``"step"``, ``"backward"``: the
    input gradient) off by ``by`` times the mean magnitude of the right answer (added to every
    element): every one of them, or a ``share`` drawn at random (seeded by ``seed``)."""
    unknown = set(lies) - _ANSWERING.keys()
    if unknown:
        raise ValueError(f"no kind of answer {sorted(unknown)}: one of {sorted(_ANSWERING)}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be within (0, 1], got {share}")
    backend = server.backend
    if backend is None:
        raise ValueError("the server has not loaded its blocks yet")
    rng = random.Random(seed)

    def moved(output: torch.Tensor) -> torch.Tensor:
        return output + by * output.detach().abs().mean()

    def lying(method: Callable[..., Any]) -> Callable[..., Any]:
        def lie(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if share < 1.0 and rng.random() >= share:
                return result
            if isinstance(result, list):
                return [moved(output) for output in result]
            if isinstance(result, tuple):
                return (moved(result[0]), *result[1:])
            return moved(result)

        return lie

    for kind in lies:
        for name in _ANSWERING[kind]:
            setattr(backend, name, lying(getattr(backend, name)))
