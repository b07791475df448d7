"""One inference session's state on a server, without I/O or compute.

:class:`SessionState` is fed the session's steps (the client's and pushed ones) and says what to
do with each: drop it (a stale push), refuse it (``ValueError``), or run it as a :class:`StepPlan`
(roll the cache back to ``position``, reorder rows, compute ``tokens`` new positions).  Once the
step is computed it gives the answer for the client and the step to push on to the next server.
The handler (``server/_inference.py``) moves the messages and runs the computation; what depends
on the blocks themselves (hidden size, prompt shapes) it checks with the backend.
"""

from __future__ import annotations

import attrs
import torch

from ..protocol import PushTarget, Step, StepResult, push_granted

__all__ = ["SessionState", "StepPlan"]


@attrs.frozen(kw_only=True, eq=False)
class StepPlan:
    """A step to run: its ``tokens`` new positions start at ``position`` (the cache is rolled
    back there first), after the cache's rows are reordered by ``reorder`` (if given)."""

    hidden: torch.Tensor
    position: int
    reorder: torch.Tensor | None
    prompts: torch.Tensor | None
    step_id: int | None
    push: tuple[PushTarget, ...]

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]


class SessionState:
    """Positions and step ids of one session of ``batch`` rows and at most ``max_length``
    positions."""

    def __init__(self, *, batch: int, max_length: int, push_key: bytes | None = None) -> None:
        self.batch = batch
        self.max_length = max_length
        #: The key of the client's push grants (None: the client opened it without one, and
        #: pushes need no grant).
        self._push_key = push_key
        #: Positions the session's caches hold.
        self.position = 0
        #: The highest step id seen (pushed steps at or below it are stale).
        self.last_step_id = -1

    def granted(self, step: Step, *, pusher: str) -> bool:
        """Whether ``step``, pushed by the server ``pusher``, may run in this session: it
        carries the client's grant of exactly this step from that server (when the session was
        opened with a push key)."""
        return self._push_key is None or push_granted(self._push_key, step, pusher=pusher)

    def plan(self, step: Step, *, pushed: bool) -> StepPlan | None:
        """What to do with ``step``: None for a stale push (drop it), a plan otherwise.

        Raises ``ValueError`` for a step this session cannot take (its rows, a position past
        what the cache holds, or beyond ``max_length``); nothing changes then but the step id
        seen."""
        step_id = step.step_id
        if pushed and (step_id is None or step_id <= self.last_step_id):
            return None
        if step_id is not None:
            self.last_step_id = max(self.last_step_id, step_id)
        hidden = step.hidden_states
        if hidden.shape[0] != self.batch:
            raise ValueError(f"the session has {self.batch} rows; this step has {hidden.shape[0]}")
        position = self.position
        if step.start_from_position is not None:
            if step.start_from_position > position:
                raise ValueError(
                    f"cannot start from position {step.start_from_position}: the cache holds "
                    f"{position}"
                )
            position = step.start_from_position
        if position + hidden.shape[1] > self.max_length:
            raise ValueError(
                f"{position} + {hidden.shape[1]} positions exceed the session's max_length "
                f"{self.max_length}"
            )
        reorder = None
        if step.hypo_ids is not None:
            # As row indices: torch refuses int8 indices and reads uint8 ones as a mask.
            reorder = step.hypo_ids.to(torch.int64)
        return StepPlan(
            hidden=hidden,
            position=position,
            reorder=reorder,
            prompts=step.prompts,
            step_id=step_id,
            push=step.push,
        )

    def rolled_back(self, plan: StepPlan) -> None:
        """The caches were cut back to where ``plan`` starts (before it is computed)."""
        self.position = plan.position

    def completed(self, plan: StepPlan, output: torch.Tensor, *, pushed: bool | None) -> StepResult:
        """``plan`` was computed: the caches hold its positions now.  The answer for the client
        (``pushed``: whether the output went on to the next server, None if the step asked for
        no push)."""
        self.position = plan.position + plan.tokens
        return StepResult(
            hidden_states=output, position=self.position, step_id=plan.step_id, pushed=pushed
        )

    @staticmethod
    def push_step(plan: StepPlan, output: torch.Tensor) -> Step | None:
        """The step that hands ``output`` to the next server of the plan's push chain (its own
        step id and start position; the rest of the chain to push on), or None."""
        if not plan.push:
            return None
        return Step(
            hidden_states=output,
            start_from_position=plan.position,
            step_id=plan.step_id,
            push=plan.push[1:],
            grant=plan.push[0].grant,
        )
