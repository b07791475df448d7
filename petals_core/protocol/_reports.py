"""Fraud reports: a server's signed receipt for a wrong answer, with the tensors it names.

A client that catches a server answering a forward or a backward wrongly (two other servers
agree, and not with it) publishes a :class:`FraudReport`: the question and the answer, as the
server decoded and sent them, and the server's :class:`Signature` over their receipt.  Anyone can
check that the accused gave this answer to this question (the signature is the accused's, over
the receipt these tensors make), and then whether the answer is wrong by asking other servers the
same question (``petals_core.client._reports``).  Nothing in a report is taken on the
reporter's word: a report whose signature does not check is forged, and one whose answer other
servers reproduce is about a correct answer; both are refused.

Inference steps are not reported: a step's answer depends on the whole session before it, and
its receipt names only the step's own input.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import attrs
import torch

from .._errors import CodecError
from ._receipts import Receipt, Signature, digest_tensors

__all__ = [
    "REPORTED_KINDS",
    "FraudReport",
]

REPORTED_KINDS: Final = ("forward", "backward")
#: The tensors each kind of report names: asked (required, optional), answered (required,
#: optional).
_NAMES: Final = {
    "forward": (({"hidden_states"}, {"prompts"}), ({"hidden_states"}, set[str]())),
    "backward": (
        ({"hidden_states", "grad_outputs"}, {"prompts"}),
        ({"grad_inputs"}, {"grad_prompts"}),
    ),
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

    @property
    def receipt(self) -> Receipt:
        """The receipt these tensors make: what the accused's signature must cover."""
        return Receipt(
            kind=self.kind,  # type: ignore[arg-type]
            model=self.model,
            blocks=self.blocks,
            adapter=self.adapter,
            issued=self.signature.issued,
            asked=digest_tensors(self.asked),
            answered=digest_tensors(self.answered),
        )

    def to_wire(self) -> dict[str, Any]:
        return {
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
            raise CodecError(f"only {' and '.join(REPORTED_KINDS)} answers are reported")
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
        return cls(
            accused=accused,
            kind=kind,
            model=model,
            blocks=(blocks[0], blocks[1]),
            adapter=adapter,
            signature=Signature.from_wire_untrusted(value.get("signature")),
            asked=_tensors(value.get("asked"), kind, "asked", asked_names),
            answered=_tensors(value.get("answered"), kind, "answered", answered_names),
        )
