"""Other servers' view of a span's answers, for checking them: a route over the span's blocks
that avoids its server (:func:`other_route`), their answer to a step (:class:`Opinion`,
:func:`opinion_of`), and a session on one of them that follows the span's session step by step
(:class:`Follower`)."""

from __future__ import annotations

import functools
from typing import Literal

import attrs
import torch
import trio

from ..dht import ServerInfo
from ..protocol import Signature, SignedReceipt, Step
from ..routing import MissingBlocksError, RouteSpan
from ._checks import hops_allowance, slice_allowance
from ._sequence_manager import RemoteSequenceManager
from ._session_core import SessionCore, SpanState
from ._span_call import SpanCall

__all__ = ["Follower", "Opinion", "opinion_of", "other_route"]


async def other_route(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    exclude: set[str],
    like: ServerInfo | None,
    *,
    wait: bool,
    whole_only: bool = False,
    max_length: int = 0,
) -> list[RouteSpan]:
    """A route over ``span``'s blocks through servers not in ``exclude`` (of ``like``'s dtype and
    quantisation), drawn impartially (``mode="impartial"`` of
    :meth:`RemoteSequenceManager.make_sequence`: a checker drawn by the throughput servers
    announce could be any server that claims enough): one server holding every block if there is
    one, so that the others stay free to decide a disagreement (a chain of several servers leaves
    fewer), else (unless ``whole_only``) a chain; of servers that take ``max_length``
    positions, as far as they announce."""
    route = functools.partial(
        manager.make_sequence,
        span.start,
        span.end,
        mode="impartial",
        exclude=exclude,
        like=like,
        max_length=max_length,
    )
    if whole_only:
        return await route(wait=wait, whole=True)
    try:
        return await route(wait=False, whole=True)
    except MissingBlocksError:
        return await route(wait=wait)


@attrs.frozen
class Opinion:
    """Other servers' answer to a step: its last positions, the signature of the last server's
    answer, who computed it, and what compression between them (or of a larger answer than
    the part compared) may have changed in it."""

    answer: torch.Tensor
    signature: Signature | None
    checkers: set[str]
    allowance: float


async def opinion_of(
    manager: RemoteSequenceManager,
    core: SessionCore,
    route: list[RouteSpan],
    inputs: torch.Tensor,
    tokens: int,
    calls: list[SpanCall],
    *,
    receipts: list[SignedReceipt],
    alloc_timeout: float,
) -> Opinion:
    """The last ``tokens`` outputs of ``inputs`` (a span's inputs from position 0, in the
    session ``core``) through ``route``, in sessions of their own closed at once.  The calls
    it opens are added to ``calls``: where one fails (``RETRIABLE``), the last is its.

    Each opening gets the time an opening may take, and each step the time a step of the
    session that size gets (``answer_timeout``): a long history is given as long as its pieces
    need, and a checker slower than it claims is given up on as a server of the session is."""
    signatures: list[Signature | None] = []
    y = inputs
    try:
        for other in route:
            call = SpanCall(SpanState(other), receipts)
            calls.append(call)
            adapter = manager.config.active_adapter
            opening = core.opening(call.state, alloc_timeout=alloc_timeout, active_adapter=adapter)
            # (A long prefill's first pieces may be shorter than its left padding.)
            length = max([y.shape[1], *(opening.left_padding or ())])
            with trio.fail_after(manager.config.request_timeout_s):
                await call.open(manager, attrs.evolve(opening, max_length=length))
            outputs = []
            for step in core.checking_steps(other, y):
                with trio.fail_after(
                    manager.answer_timeout(other, step.hidden_states, call.unconfirmed)
                ):
                    await call.send(step, manager.config.compression)
                    answered = await call.result(manager)
                outputs.append(core.checked_answer(call.state, step, answered))
            y = torch.cat(outputs, dim=1)
            signatures.append(answered.receipt)
    finally:
        with trio.CancelScope(shield=True):
            for call in calls:
                await call.close()
    allowance = hops_allowance(signatures)
    if y.shape[1] > tokens:
        allowance += slice_allowance(signatures[-1])
    return Opinion(
        y[:, y.shape[1] - tokens :],  # (none for a step of none)
        signatures[-1],
        {other.peer_id for other in route},
        allowance,
    )


@attrs.define(eq=False)
class Follower:
    """A session on another server holding a span's blocks, fed the span's inputs step by step
    to check its answers (``until``: ``"first"``, until the span's server has its first answers
    checked; ``"session"``: for the whole session)."""

    call: SpanCall
    until: Literal["first", "session"]
    opened_now: bool = True
    #: The step sent for the step now running, and how many positions of its answer are ours.
    sent: Step | None = None
    tokens: int = 0

    @property
    def peer(self) -> str:
        return self.call.state.peer
