"""The inference session of a distributed model: what ``with model.inference_session(...)`` gives.

It wraps the sync session of the model's :class:`~petals_core.client.RemoteSequential` and adds
what the model needs on top:

- entering it (``with``) makes it the model's *active* session: every forward of the model (and
  every ``generate()``) then runs as steps of this session instead of as full forwards;
- ``prompt_tokens``: how many trainable-prompt positions the model sent at position 0 (p-tuning),
  so that ``token_position`` counts tokens only;
- ``output_ids``: the sequences the last ``generate()`` in this session returned, so that the next
  ``generate()`` continues from them (see ``DistributedCausalLMMixin.generate``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..client import FirstStepTimes, SyncInferenceSession
    from ..routing import RouteSpan
    from ._base import DistributedModelMixin

__all__ = ["RemoteInferenceSession"]


class RemoteInferenceSession:
    """An inference session of a distributed model, over the servers holding its blocks.

    ``max_length`` counts tokens; room for the trainable prompts (``pre_seq_len``) is added to the
    servers' allocation. Use it as a context manager (it is then the model's active session and is
    closed at the end), or pass it as ``generate(..., session=...)`` and :meth:`close` it yourself.
    """

    def __init__(
        self, owner: DistributedModelMixin, inner: SyncInferenceSession, *, max_length: int
    ) -> None:
        self._owner = owner
        self._inner = inner
        self.max_length = max_length
        self.prompt_tokens = 0
        #: The sequences (``(B, T)`` token ids) the last ``generate()`` in this session returned.
        self.output_ids: torch.Tensor | None = None
        self._previous: RemoteInferenceSession | None = None
        self._entered = False

    def __enter__(self) -> RemoteInferenceSession:
        if self._entered:
            raise RuntimeError("this inference session is already entered")
        self._entered = True
        self._previous = self._owner._swap_active_session(self)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._owner._swap_active_session(self._previous)
        self._previous = None
        self._entered = False
        self.close()

    @property
    def position(self) -> int:
        """Positions the servers hold, trainable prompts included; set it lower to roll back."""
        return self._inner.position

    @position.setter
    def position(self, value: int) -> None:
        if 0 < value < self.prompt_tokens:
            raise ValueError(
                f"cannot roll back into the {self.prompt_tokens} trainable-prompt positions: "
                f"go to 0 (prompts are sent again) or to >= {self.prompt_tokens}"
            )
        self._inner.position = value
        if value == 0:
            self.prompt_tokens = 0
        # After a rollback, the next generate() takes its input_ids as the whole sequence.
        self.output_ids = None

    @property
    def route(self) -> list[RouteSpan]:
        """The servers the session goes through now, with the blocks each runs."""
        return self._inner.session.route

    @property
    def first_step(self) -> FirstStepTimes | None:
        """Where the session's first step spent its time (route planning, opening the servers'
        sessions, the step itself); None before it."""
        return self._inner.session.first_step

    @property
    def token_position(self) -> int:
        """Tokens the servers hold (``position`` without the trainable prompts)."""
        return self._inner.position - self.prompt_tokens

    def step(
        self,
        hidden_states: torch.Tensor,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``(B, T, hidden)`` new positions through every remote block (Petals' API);
        ``padding`` (``(B,)``, first step only): left-padding length of each row."""
        return self._inner.step(hidden_states, prompts=prompts, hypo_ids=hypo_ids, padding=padding)

    def close(self) -> None:
        """Release the servers' caches. Idempotent."""
        self._inner.close()
