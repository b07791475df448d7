"""The parts of ``python -m bench trust`` that need no swarm, at small sizes."""

from __future__ import annotations

from bench import trust
from petals_core.client._checks import TOLERANCE


def test_a_server_lying_on_every_answer_is_caught_on_its_first() -> None:
    answers, passed = trust.caught_after(20, 1.0)
    assert answers == [1] * 20 and passed == [0] * 20


def test_rare_lies_pass_until_one_is_checked() -> None:
    answers, passed = trust.caught_after(200, 0.05)
    assert min(answers) >= 1 and max(passed) > 0
    assert all(lies < count for lies, count in zip(passed, answers, strict=True))


def test_honest_answers_stay_within_the_bound() -> None:
    found = trust.honest_disagreement("float32", 2)
    assert len(found) == 2 * (1 + trust.DECODE_STEPS)
    assert max(found) <= TOLERANCE["float32"] / 100
