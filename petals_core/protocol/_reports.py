"""Fraud reports: a server's signed receipt for a wrong answer, with the tensors it names.

A client that catches a server answering a forward, a backward or an inference step wrongly (two
other servers agree, and not with it) publishes a :class:`FraudReport`: the question and the answer,
as the server decoded and sent them, and the server's :class:`Signature` over their receipt. Anyone
can check that the accused gave this answer to this question (the signature is the accused's, over
the receipt these tensors make), and then whether the answer is wrong by asking other servers the
same question (``petals_core.client._reports``). Nothing in a report is taken on the reporter's
word: a report whose signature does not check is forged, and one whose answer other servers
reproduce is about a correct answer; both are refused.

A step's answer depends on the whole session before it: a report on a step carries every step
of the accused's session up to it (:class:`StepEvidence`: each input as the server received it,
with the server's signature over its receipt), which another server replays in a session of its
own, with the padding the session was opened with (which the receipts sign too).  Each step
receipt names the digest of the session's receipt before it, so the steps make one chain: none
can be left out or put in another order without breaking it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import torch

from .._errors import CodecError
from ._receipts import DIGEST_BYTES, FIRST_STEP, Receipt, Signature, digest_tensors

__all__ = [
    "REPORTED_KINDS",
    "FraudReport",
    "StepEvidence",
]

REPORTED_KINDS: Final = ("forward", "backward", "step")
#: The most steps a report on a step carries (each with its own tensors).
MAX_STEPS: Final = 4096
#: The tensors each kind of report names: asked (required, optional), answered (required,
#: optional).
_NAMES: Final = {
    "forward": (({"hidden_states"}, {"prompts"}), ({"hidden_states"}, set[str]())),
    "backward": (
        ({"hidden_states", "grad_outputs"}, {"prompts"}),
        ({"grad_inputs"}, {"grad_prompts"}),
    ),
    "step": (({"hidden_states"}, {"prompts", "hypo_ids"}), ({"hidden_states"}, set[str]())),
}
_VERSION: Final = 1


def _tensors(value: object, kind: str, what: str, names: tuple[set[str], set[str]]) -> dict:
    if not isinstance(value, dict):
        raise CodecError(f"a report's {what} tensors must be a map")
    required, optional = names
    if not required <= value.keys() <= required | optional:
        raise CodecError(
            f"a {kind} report's {what} tensors are {sorted(required)} "
            f"(and optionally {sorted(optional)}), not {sorted(value)}"
        )
    for name, tensor in value.items():
        if not isinstance(tensor, torch.Tensor):
            raise CodecError(f"a report's {what} {name} must be a tensor")
    return dict(value)


def _floating(tensor: torch.Tensor, name: str, shape: tuple[int, ...] | None = None) -> None:
    if not tensor.dtype.is_floating_point:
        raise CodecError(f"a report's {name} must be floating-point, not {tensor.dtype}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise CodecError(f"a report's {name} must be {shape}, not {tuple(tensor.shape)}")


def _check_asked(asked: Mapping[str, torch.Tensor], blocks: tuple[int, int]) -> None:
    """The shapes a question's tensors must have: hidden states ``(B, T, hidden)``, deep prompts
    ``(blocks, B or 1, P, hidden)``, row indices ``(B,)``, gradients like the hidden states."""
    hidden = asked["hidden_states"]
    _floating(hidden, "hidden_states")
    if hidden.dim() != 3 or hidden.shape[0] < 1 or hidden.shape[2] < 1:
        raise CodecError(
            f"a report's hidden_states must be (B, T, hidden), not {tuple(hidden.shape)}"
        )
    batch, _, size = hidden.shape
    prompts = asked.get("prompts")
    if prompts is not None:
        _floating(prompts, "prompts")
        if (
            prompts.dim() != 4
            or prompts.shape[0] != blocks[1] - blocks[0]
            or prompts.shape[1] not in (1, batch)
            or prompts.shape[3] != size
        ):
            shape = tuple(prompts.shape)
            raise CodecError(f"a report's prompts must be (blocks, B or 1, P, hidden), not {shape}")
    hypo_ids = asked.get("hypo_ids")
    if hypo_ids is not None and (
        hypo_ids.dtype.is_floating_point
        or hypo_ids.dtype == torch.bool
        or tuple(hypo_ids.shape) != (batch,)
        or not bool(((hypo_ids >= 0) & (hypo_ids < batch)).all())
    ):
        raise CodecError(f"a report's hypo_ids must be ({batch},) row indices")
    grad = asked.get("grad_outputs")
    if grad is not None:
        _floating(grad, "grad_outputs", tuple(hidden.shape))


def _check_answered(
    kind: str, asked: Mapping[str, torch.Tensor], answered: Mapping[str, torch.Tensor]
) -> None:
    """An answer's tensors have the shapes of what they answer."""
    hidden = tuple(asked["hidden_states"].shape)
    if kind == "backward":
        _floating(answered["grad_inputs"], "grad_inputs", hidden)
        prompts, grads = asked.get("prompts"), answered.get("grad_prompts")
        if grads is not None:
            _floating(grads, "grad_prompts", None if prompts is None else tuple(prompts.shape))
            if prompts is None:
                raise CodecError("a report's grad_prompts answer no prompts")
    else:
        _floating(answered["hidden_states"], "answer", hidden)


def _count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise CodecError(f"a report's {what} must be an integer within [0, 2**63)")
    return value


@attrs.frozen(kw_only=True)
class StepEvidence:
    """One earlier step of a reported session: the position after it, its input as the server
    received it, the digest of its answer, and the server's signature over its receipt."""

    position: int
    signature: Signature
    asked: Mapping[str, torch.Tensor] = attrs.field(eq=False)
    answered: bytes

    def to_wire(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "signature": self.signature.to_wire(),
            "asked": dict(self.asked),
            "answered": self.answered,
        }

    @classmethod
    def from_wire_untrusted(cls, value: object) -> StepEvidence:
        if not isinstance(value, dict):
            raise CodecError("a report's step must be a map")
        answered = value.get("answered")
        if not isinstance(answered, bytes) or len(answered) != DIGEST_BYTES:
            raise CodecError(f"a report's step answer digest must be {DIGEST_BYTES} bytes")
        return cls(
            position=_count(value.get("position"), "step position"),
            signature=Signature.from_wire_untrusted(value.get("signature")),
            asked=_tensors(value.get("asked"), "step", "asked", _NAMES["step"][0]),
            answered=answered,
        )

    def check_shapes(self, blocks: tuple[int, int]) -> None:
        _check_asked(self.asked, blocks)


@attrs.frozen(kw_only=True)
class FraudReport:
    """The evidence that ``accused`` answered ``asked`` with ``answered`` (see the module)."""

    accused: str
    kind: str
    model: str
    blocks: tuple[int, int]
    adapter: str | None
    signature: Signature
    asked: Mapping[str, torch.Tensor] = attrs.field(eq=False)
    answered: Mapping[str, torch.Tensor] = attrs.field(eq=False)
    #: A step's: its session, the padding it was opened with, the position after the step, and
    #: every earlier step of the session on the accused's server, in order.
    session: str | None = None
    padding: tuple[int, ...] | None = None
    position: int | None = None
    steps: tuple[StepEvidence, ...] = ()

    @property
    def receipt(self) -> Receipt:
        """The receipt these tensors make: what the accused's signature must cover."""
        return self._receipt(
            self.position, self.signature, self.asked, digest_tensors(self.answered)
        )

    def step_receipts(self) -> list[tuple[Receipt, Signature]]:
        """A step report's earlier steps: each one's receipt and signature."""
        return [
            (
                self._receipt(step.position, step.signature, step.asked, step.answered),
                step.signature,
            )
            for step in self.steps
        ]

    def chained(self, receipts: Sequence[Receipt] | None = None) -> bool:
        """Whether a step report's receipts (``receipts``, if the caller has them: its steps'
        and its own, in order) make one unbroken chain from its session's first step to the
        reported one (each names the digest of the one before it)."""
        if receipts is None:
            receipts = [*(receipt for receipt, _ in self.step_receipts()), self.receipt]
        expected = FIRST_STEP
        for receipt in receipts:
            if receipt.previous != expected:
                return False
            expected = receipt.digest()
        return True

    def _receipt(
        self,
        position: int | None,
        signature: Signature,
        asked: Mapping[str, torch.Tensor],
        answered: bytes,
    ) -> Receipt:
        return Receipt(
            kind=self.kind,  # type: ignore[arg-type]
            model=self.model,
            blocks=self.blocks,
            adapter=self.adapter,
            session=self.session,
            padding=self.padding,
            step=position,
            previous=signature.previous,
            compression=signature.compression,
            torch_dtype=signature.torch_dtype,
            quant_type=signature.quant_type,
            issued=signature.issued,
            asked=digest_tensors(asked),
            answered=answered,
        )

    def to_wire(self) -> dict[str, Any]:
        session: dict[str, Any] = {}
        if self.kind == "step":
            session = {
                "session": self.session,
                "padding": None if self.padding is None else list(self.padding),
                "position": self.position,
                "steps": [step.to_wire() for step in self.steps],
            }
        return {
            **session,
            "version": _VERSION,
            "accused": self.accused,
            "kind": self.kind,
            "model": self.model,
            "blocks": list(self.blocks),
            "adapter": self.adapter,
            "signature": self.signature.to_wire(),
            "asked": dict(self.asked),
            "answered": dict(self.answered),
        }

    @classmethod
    def from_wire_untrusted(cls, value: object) -> FraudReport:
        """Parse a report (its shape only, not what it claims)."""
        if not isinstance(value, dict):
            raise CodecError("a report must be a map")
        if value.get("version") != _VERSION:
            raise CodecError(f"a report's version must be {_VERSION}")
        kind, model, accused = value.get("kind"), value.get("model"), value.get("accused")
        if kind not in _NAMES:
            raise CodecError(f"only {', '.join(REPORTED_KINDS)} answers are reported")
        if not isinstance(model, str) or not isinstance(accused, str):
            raise CodecError("a report's model and accused must be text")
        blocks = value.get("blocks")
        if (
            not isinstance(blocks, list)
            or len(blocks) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
            or not 0 <= blocks[0] < blocks[1]
        ):
            raise CodecError("a report's blocks must be [start, end) with 0 <= start < end")
        adapter = value.get("adapter")
        if adapter is not None and not isinstance(adapter, str):
            raise CodecError("a report's adapter must be text or null")
        asked_names, answered_names = _NAMES[kind]
        session: dict[str, Any] = {}
        if kind == "step":
            session_id, padding, steps = (
                value.get("session"),
                value.get("padding"),
                value.get("steps"),
            )
            if not isinstance(session_id, str):
                raise CodecError("a step report's session must be text")
            if padding is not None and (
                not isinstance(padding, list)
                or not padding
                or not all(_count(row, "padding") >= 0 for row in padding)
            ):
                raise CodecError("a step report's padding must be a list of integers or null")
            if not isinstance(steps, list) or len(steps) >= MAX_STEPS:
                raise CodecError(f"a step report's steps must be a list of fewer than {MAX_STEPS}")
            session = {
                "session": session_id,
                "padding": None if padding is None else tuple(padding),
                "position": _count(value.get("position"), "position"),
                "steps": tuple(StepEvidence.from_wire_untrusted(step) for step in steps),
            }
        asked = _tensors(value.get("asked"), kind, "asked", asked_names)
        answered = _tensors(value.get("answered"), kind, "answered", answered_names)
        span = (blocks[0], blocks[1])
        _check_asked(asked, span)
        _check_answered(kind, asked, answered)
        for step in session.get("steps", ()):
            step.check_shapes(span)
        return cls(
            **session,
            accused=accused,
            kind=kind,
            model=model,
            blocks=(blocks[0], blocks[1]),
            adapter=adapter,
            signature=Signature.from_wire_untrusted(value.get("signature")),
            asked=asked,
            answered=answered,
        )
