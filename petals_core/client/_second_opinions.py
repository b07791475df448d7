"""Other servers' view of a span's answers, for checking them: a route over the span's blocks
that avoids its server (:func:`other_route`), their answer to a step (:class:`Opinion`), and a
session on one of them that follows the span's session step by step (:class:`Follower`)."""

from __future__ import annotations

import functools
from typing import Literal

import attrs
import torch

from ..dht import ServerInfo
from ..protocol import Signature, Step
from ..routing import MissingBlocksError, RouteSpan
from ._sequence_manager import RemoteSequenceManager
from ._span_call import SpanCall

__all__ = ["Follower", "Opinion", "other_route"]


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
