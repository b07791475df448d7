"""The chaos runner's configuration and what it reports: one outcome per faulted session."""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import attrs

__all__ = ["ChaosConfig", "ChaosReport", "Fault", "Outcome", "Result"]

Fault = Literal["kill", "stall"]
Result = Literal["equal", "petals_error", "mismatch", "unexpected_error"]


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class ChaosConfig:
    """One chaos run: ``generations`` with a kill, ``stalls`` with a stall, ``finetune_steps``
    with a kill between forward and backward.

    ``request_timeout_s`` is the client's (None: the library's default); a dead or stopped
    server is given up on sooner, when the transport finds it silent.
    ``deadline_s`` bounds the whole run (starting the swarm included).  ``family`` is the tiny
    model's: ``"llama"`` (grouped-query attention), ``"falcon"`` (Falcon-7B's layout:
    multi-query attention, attention and MLP in parallel) or ``"mixtral"`` (8 experts, top 2).
    """

    generations: int = attrs.field(default=20, validator=_non_negative)
    stalls: int = attrs.field(default=20, validator=_non_negative)
    finetune_steps: int = attrs.field(default=3, validator=_non_negative)
    max_new_tokens: int = attrs.field(default=16, validator=_positive)
    prompt_tokens: int = attrs.field(default=6, validator=_positive)
    request_timeout_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    seed: int = 0
    family: Literal["llama", "falcon", "mixtral"] = attrs.field(
        default="llama", validator=attrs.validators.in_(("llama", "falcon", "mixtral"))
    )
    deadline_s: float = attrs.field(default=3600.0, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise ValueError("max_new_tokens must be >= 2: a fault needs a step after it")


@attrs.frozen(kw_only=True)
class Outcome:
    """What became of one session: a generation (``step``: the generated token after which the
    fault struck) or a fine-tuning step (``step`` -1: between forward and backward)."""

    kind: Literal["generation", "finetune"]
    index: int
    fault: Fault
    step: int
    victim: str | None
    result: Result
    message: str
    seconds: float
    #: For a generation: from the fault to the next token (the dead or stopped server noticed,
    #: the span rerouted and its history replayed).
    recovery_s: float | None = None

    def line(self) -> str:
        victim = self.victim[-6:] if self.victim else "-"
        where = "between fwd/bwd" if self.step < 0 else f"after token {self.step}"
        recovery = "" if self.recovery_s is None else f", next token {self.recovery_s:.2f} s later"
        text = (
            f"{self.kind} {self.index:3d}: {self.fault} {victim} {where}: {self.result} "
            f"({self.seconds:.1f} s{recovery})"
        )
        return f"{text}: {self.message}" if self.message else text


@attrs.frozen(kw_only=True)
class ChaosReport:
    outcomes: tuple[Outcome, ...]
    #: Fault-free generations (the references) that equal transformers' local generation.
    references_equal_local: int
    references: int
    kills: int
    stalls: int
    restarts: int
    seconds: float

    def count(self, result: Result) -> int:
        return sum(outcome.result == result for outcome in self.outcomes)

    @property
    def lost(self) -> int:
        """Sessions that neither completed correctly nor raised a clear PetalsError."""
        return self.count("mismatch") + self.count("unexpected_error")

    @property
    def all_equal(self) -> bool:
        return self.count("equal") == len(self.outcomes)

    def summary(self) -> str:
        counts = Counter(outcome.result for outcome in self.outcomes)
        return (
            f"{len(self.outcomes)} sessions in {self.seconds:.0f} s: "
            + ", ".join(f"{counts[r]} {r}" for r in ("equal", "petals_error", "mismatch"))
            + f", {counts['unexpected_error']} unexpected_error; lost: {self.lost}; "
            f"kills {self.kills}, stalls {self.stalls}, restarts {self.restarts}; "
            f"references equal to local transformers: "
            f"{self.references_equal_local}/{self.references}"
            + "".join(
                f"; {fault}: next token after {min(times):.2f}-{max(times):.2f} s"
                for fault, times in self.recovery_times().items()
            )
        )

    def recovery_times(self) -> dict[str, list[float]]:
        """The generations' recovery times (fault to next token), by fault."""
        times: dict[str, list[float]] = {}
        for outcome in self.outcomes:
            if outcome.recovery_s is not None:
                times.setdefault(outcome.fault, []).append(outcome.recovery_s)
        return times
