"""The messages of fine-tuning passes: ``petals.forward`` and ``petals.backward``.

Their tensors may be large, so each message is a tensor transfer (see ``_transfer``): a meta
map and named tensors, which ``to_wire`` returns and ``from_wire_untrusted`` takes.  The client
sends one request and ends its side; the server answers with one reply.

A forward whose request says ``keep_for_backward`` may keep its autograd graph for a coming
backward; its reply then carries a token (``kept``).  A backward from the same peer naming that
token, with the same blocks, adapter, hidden states and prompts, takes its gradients from the
kept graph; anything else is recomputed, so the token is only ever a hint.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

import attrs
import torch

from .._errors import LocalProtocolError
from ._receipts import Signature, as_signature
from ._wire import (
    TENSOR_DTYPES,
    TENSOR_EQ,
    WireTransfer,
    as_tuple,
    check_adapter,
    check_blocks,
    check_hidden,
    check_number,
    check_prompts,
    no_empty_adapter,
    present,
    to_float,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "BackwardReply",
    "BackwardRequest",
    "ForwardReply",
    "ForwardRequest",
]

FORWARD: Final = "petals.forward"
BACKWARD: Final = "petals.backward"

Tensors = dict[str, torch.Tensor | None]


@attrs.frozen(kw_only=True)
class _Pass(WireTransfer):
    """What a forward and a backward request both carry: ``hidden_states`` ``(B, T >= 1,
    hidden)`` through blocks ``[start, end)`` (``blocks``), with deep ``prompts`` ``(blocks,
    1 or B, prefix, hidden)`` added before each block if given."""

    blocks: tuple[int, int] = attrs.field(converter=as_tuple)
    hidden_states: torch.Tensor = attrs.field(eq=TENSOR_EQ, hash=False)
    prompts: torch.Tensor | None = attrs.field(default=None, eq=TENSOR_EQ, hash=False)
    #: The adapter the blocks run with (an empty name means none).
    active_adapter: str | None = attrs.field(default=None, converter=no_empty_adapter)
    #: What the client offers for priority among requests; servers ignore it (nobody can check
    #: it), as Petals' do.
    points: float = attrs.field(default=0.0, converter=to_float)

    def __attrs_post_init__(self) -> None:
        check_blocks(self.blocks)
        check_adapter(self.active_adapter)
        check_number("points", self.points)
        check_hidden("hidden_states", self.hidden_states)
        if self.hidden_states.shape[1] < 1:
            raise LocalProtocolError("hidden_states must hold at least one token")
        check_prompts("prompts", self.prompts)

    def _meta(self) -> dict[str, Any]:
        return {
            "blocks": list(self.blocks),
            "active_adapter": self.active_adapter,
            "points": self.points,
        }


@attrs.frozen(kw_only=True)
class ForwardRequest(_Pass):
    """A ``petals.forward`` request; ``keep_for_backward``: a backward follows, and the server
    may keep its graph for it."""

    what: ClassVar[str] = "forward request"

    keep_for_backward: bool = False

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not isinstance(self.keep_for_backward, bool):
            raise LocalProtocolError("keep_for_backward must be true or false")

    def to_wire(self) -> tuple[dict[str, Any], Tensors]:
        meta = self._meta()
        if self.keep_for_backward:
            meta["keep_for_backward"] = True
        return meta, {"hidden_states": self.hidden_states, "prompts": self.prompts}


@attrs.frozen(kw_only=True)
class ForwardReply(WireTransfer):
    """The output of the last block of the request's span; ``kept``: the token of the graph
    the server kept for a backward, if it kept one."""

    what: ClassVar[str] = "forward reply"

    hidden_states: torch.Tensor = attrs.field(eq=TENSOR_EQ, hash=False)
    kept: str | None = None
    #: The server's signature of its receipt (``_receipts``).
    receipt: Signature | None = attrs.field(default=None, converter=as_signature)

    def __attrs_post_init__(self) -> None:
        check_hidden("hidden_states", self.hidden_states)
        _check_token(self.kept)

    def to_wire(self) -> tuple[dict[str, Any], Tensors]:
        meta = present(kept=self.kept, receipt=self.receipt and self.receipt.to_wire())
        return meta, {"hidden_states": self.hidden_states}


@attrs.frozen(kw_only=True)
class BackwardRequest(_Pass):
    """A ``petals.backward`` request: ``grad_outputs``, the gradient of the span's output (the
    shape of ``hidden_states``); ``kept``: the token a forward's reply gave, if any."""

    what: ClassVar[str] = "backward request"

    grad_outputs: torch.Tensor = attrs.field(eq=TENSOR_EQ, hash=False)
    kept: str | None = None

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        grad, shape = self.grad_outputs, tuple(self.hidden_states.shape)
        if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != shape:
            raise LocalProtocolError(f"grad_outputs must have the shape of hidden_states, {shape}")
        if grad.dtype not in TENSOR_DTYPES:
            raise LocalProtocolError(f"grad_outputs must be one of {TENSOR_DTYPES}")
        _check_token(self.kept)

    def to_wire(self) -> tuple[dict[str, Any], Tensors]:
        return {**self._meta(), **present(kept=self.kept)}, {
            "hidden_states": self.hidden_states,
            "grad_outputs": self.grad_outputs,
            "prompts": self.prompts,
        }


@attrs.frozen(kw_only=True)
class BackwardReply(WireTransfer):
    """The gradients of the request's ``hidden_states`` (``grad_inputs``) and, if it had
    prompts, of its prompts."""

    what: ClassVar[str] = "backward reply"

    grad_inputs: torch.Tensor = attrs.field(eq=TENSOR_EQ, hash=False)
    grad_prompts: torch.Tensor | None = attrs.field(default=None, eq=TENSOR_EQ, hash=False)
    #: The server's signature of its receipt (``_receipts``).
    receipt: Signature | None = attrs.field(default=None, converter=as_signature)

    def __attrs_post_init__(self) -> None:
        check_hidden("grad_inputs", self.grad_inputs)
        check_prompts("grad_prompts", self.grad_prompts)

    def to_wire(self) -> tuple[dict[str, Any], Tensors]:
        meta = present(receipt=self.receipt and self.receipt.to_wire())
        return meta, {"grad_inputs": self.grad_inputs, "grad_prompts": self.grad_prompts}

    def tensors(self) -> Tensors:
        """What the receipt's ``answered`` digest covers."""
        return self.to_wire()[1]


def _check_token(token: object) -> None:
    if token is not None and not isinstance(token, str):
        raise LocalProtocolError(f"kept must be a string token, got {type(token).__name__}")
