"""The server's I/O-free session state: which steps run, where, and what is answered and pushed."""

from __future__ import annotations

import re

import attrs
import pytest
import torch

from petals_core.protocol import PushTarget, Step, push_grant
from petals_core.server._session_state import SessionState


def _step(tokens: int, *, batch: int = 1, **fields: object) -> Step:
    return Step(hidden_states=torch.zeros(batch, tokens, 4), **fields)  # type: ignore[arg-type]


def _run(state: SessionState, step: Step, *, pushed: bool = False) -> int:
    """Feed ``step`` through plan / rolled_back / completed; the position answered."""
    plan = state.plan(step, pushed=pushed)
    assert plan is not None
    state.rolled_back(plan)
    return state.completed(plan, plan.hidden, pushed=None).position


def test_steps_append_positions_and_answer_them() -> None:
    state = SessionState(batch=1, max_length=16)
    assert _run(state, _step(5, step_id=0)) == 5
    assert _run(state, _step(1, step_id=1)) == 6
    result_plan = state.plan(_step(2, step_id=2), pushed=False)
    assert result_plan is not None and result_plan.position == 6 and result_plan.tokens == 2
    result = state.completed(result_plan, result_plan.hidden, pushed=True)
    assert (result.position, result.step_id, result.pushed) == (8, 2, True)


def test_start_from_position_rolls_back() -> None:
    state = SessionState(batch=1, max_length=16)
    _run(state, _step(6))
    plan = state.plan(_step(2, start_from_position=3), pushed=False)
    assert plan is not None and plan.position == 3
    state.rolled_back(plan)
    assert state.position == 3
    assert state.completed(plan, plan.hidden, pushed=None).position == 5


@pytest.mark.parametrize(
    ("step", "message"),
    [
        (_step(1, batch=2), "the session has 1 rows; this step has 2"),
        (_step(1, start_from_position=5), "cannot start from position 5: the cache holds 4"),
        (_step(5), "4 + 5 positions exceed the session's max_length 8"),
    ],
)
def test_refused_steps_change_nothing(step: Step, message: str) -> None:
    state = SessionState(batch=1, max_length=8)
    _run(state, _step(4, step_id=0))
    with pytest.raises(ValueError, match=re.escape(message)):
        state.plan(step, pushed=False)
    assert state.position == 4
    assert _run(state, _step(1)) == 5


def test_stale_and_unnumbered_pushes_are_dropped() -> None:
    state = SessionState(batch=1, max_length=16)
    _run(state, _step(3, step_id=4))
    assert state.plan(_step(1, step_id=4), pushed=True) is None  # the client's copy came first
    assert state.plan(_step(1, step_id=2), pushed=True) is None
    assert state.plan(_step(1), pushed=True) is None
    assert state.position == 3
    # The client's own steps are never stale, even when the push arrived first.
    assert state.plan(_step(1, step_id=5), pushed=True) is not None
    assert state.plan(_step(1, step_id=5), pushed=False) is not None


def test_hypo_ids_become_row_indices() -> None:
    state = SessionState(batch=3, max_length=16)
    plan = state.plan(
        _step(1, batch=3, hypo_ids=torch.tensor([2, 0, 0], dtype=torch.uint8)), pushed=False
    )
    assert plan is not None and plan.reorder is not None
    assert plan.reorder.dtype == torch.int64 and plan.reorder.tolist() == [2, 0, 0]


def test_push_step_hands_the_output_down_the_chain() -> None:
    chain = (
        PushTarget(peer="b", session_id="s-b", grant=b"grant of b"),
        PushTarget(peer="c", session_id="s-c", grant=b"grant of c"),
    )
    state = SessionState(batch=1, max_length=16)
    _run(state, _step(3))
    plan = state.plan(_step(2, step_id=7, start_from_position=1, push=chain), pushed=False)
    assert plan is not None
    output = torch.ones(1, 2, 4)
    pushed = SessionState.push_step(plan, output)
    assert pushed is not None
    assert pushed.hidden_states is output
    assert (pushed.start_from_position, pushed.step_id, pushed.push) == (1, 7, chain[1:])
    assert pushed.grant == chain[0].grant
    last = state.plan(_step(1, push=()), pushed=False)
    assert last is not None and SessionState.push_step(last, output) is None


def test_a_session_with_a_push_key_takes_only_pushes_granted_for_exactly_them() -> None:
    """A grant is of one step: its id, start position, positions, rows and the server pushing
    it, under the session's key.  A session opened without a key takes any push (as before
    grants)."""
    key = bytes(range(32))
    state = SessionState(batch=2, max_length=16, push_key=key)
    at = {"pusher": "server-a", "step_id": 4, "position": 3, "tokens": 2, "batch": 2}
    granted = push_grant(key, **at)  # type: ignore[arg-type]
    step = _step(2, batch=2, step_id=4, start_from_position=3, grant=granted)
    assert state.granted(step, pusher="server-a")
    assert not state.granted(step, pusher="server-b")
    anyone = SessionState(batch=2, max_length=16)
    assert anyone.granted(attrs.evolve(step, grant=None), pusher="server-b")
    for other in (
        attrs.evolve(step, grant=None),
        attrs.evolve(step, step_id=5),
        attrs.evolve(step, start_from_position=0),
        attrs.evolve(step, start_from_position=None),
        attrs.evolve(step, hidden_states=torch.zeros(2, 3, 4)),
        attrs.evolve(step, hidden_states=torch.zeros(1, 2, 4)),
        attrs.evolve(step, grant=push_grant(bytes(32), **at)),  # type: ignore[arg-type]
        attrs.evolve(step, step_id=2**64),
    ):
        assert not state.granted(other, pusher="server-a")
