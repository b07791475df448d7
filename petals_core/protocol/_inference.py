"""The messages of inference sessions (``petals.inference``) and of server-to-server pushes
(``petals.push``).

**A session** is one ``petals.inference`` stream.  The client sends :class:`OpenSession`; the
server answers :class:`SessionReady` once it has reserved the session's cache.  Then each
:class:`Step` is answered by a :class:`StepResult`, in order.  The session ends when the client
ends its side (the server then frees the cache), or with an error frame naming the cause.

**A push** is one ``petals.push`` stream from a server to the next server of a client's route:
:class:`OpenPush` names the session there, then each message is a :class:`Step` of that
session, which the receiving server takes beside the client's own and answers to the client.
A step asks for its output to be pushed on by naming the next servers' sessions
(:class:`PushTarget`) in its ``push``.  A pushed step is the output of such a step, so it never
carries ``prompts`` nor ``hypo_ids``; a server refuses a push stream's step that does.

**Push grants.**  The servers before a session on the route learn its id, so the id alone must
not let them steer it (roll it back, or run a step the client never sent).  A client opens each
session with a secret ``push_key``, and gives each push target a ``grant``: a MAC under that
session's key of the one pushed step it allows (its step id, start position, positions and
rows, and the server to push it: the one before on the route; :func:`push_grant`).  The pushing
server passes the grant on with the step, and a server takes a pushed step into a session
opened with a key only if the grant checks.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping
from typing import Any, ClassVar, Final

import attrs
import torch

from .._errors import LocalProtocolError
from ._receipts import Signature, as_signature
from ._wire import (
    TENSOR_EQ,
    WireMessage,
    as_tuple,
    check_adapter,
    check_blocks,
    check_hidden,
    check_integer,
    check_number,
    check_optional_bytes,
    check_optional_integer,
    check_prompts,
    check_text,
    is_integer,
    no_empty_adapter,
    present,
    to_float,
    untrusted,
    wire_fields,
)

__all__ = [
    "INFERENCE",
    "MAX_PUSH_CHAIN",
    "PUSH",
    "PUSH_GRANTS",
    "PUSH_KEY_BYTES",
    "OpenPush",
    "OpenSession",
    "PushTarget",
    "SessionReady",
    "Step",
    "StepResult",
    "push_grant",
    "push_granted",
]

INFERENCE: Final = "petals.inference"
PUSH: Final = "petals.push"

#: The most servers after the receiving one that a step may name to push on to.
MAX_PUSH_CHAIN: Final = 64

#: The form of push grants this version makes and checks (servers announce it, see
#: ``dht.ServerInfo.push_grants``).
PUSH_GRANTS: Final = 1
#: Sizes of a session's push key and of a grant (a truncated HMAC-SHA256).
PUSH_KEY_BYTES: Final = 32
_GRANT_BYTES: Final = 16
_GRANTED: Final = struct.Struct(">QQQQ")


def push_grant(
    key: bytes, *, pusher: str, step_id: int, position: int, tokens: int, batch: int
) -> bytes:
    """The grant, under a session's ``key``, of the pushed step ``step_id`` of ``tokens`` new
    positions from ``position`` on, for ``batch`` rows, pushed by the server ``pusher`` (its
    PeerID: the server before that session on the route)."""
    sender = pusher.encode()
    message = b"petals.push-grant.%d\0%d:%b" % (PUSH_GRANTS, len(sender), sender)
    message += _GRANTED.pack(step_id, position, tokens, batch)
    return hmac.new(key, message, hashlib.sha256).digest()[:_GRANT_BYTES]


def push_granted(key: bytes, step: Step, *, pusher: str) -> bool:
    """Whether ``step``, pushed by ``pusher`` into a session of ``key``, carries that session's
    grant of exactly this step from exactly that server."""
    hidden = step.hidden_states
    if step.grant is None or step.step_id is None or step.start_from_position is None:
        return False
    if max(step.step_id, step.start_from_position) >= 2**64:
        return False
    expected = push_grant(
        key,
        pusher=pusher,
        step_id=step.step_id,
        position=step.start_from_position,
        tokens=hidden.shape[1],
        batch=hidden.shape[0],
    )
    return hmac.compare_digest(expected, step.grant)


@attrs.frozen(kw_only=True)
class OpenSession(WireMessage):
    """The first message of a session: the server reserves ``batch_size x max_length x
    (end - start)`` cache tokens for blocks ``[start, end)`` (``blocks``), waiting up to
    ``alloc_timeout`` seconds for them (capped by its own limit)."""

    what: ClassVar[str] = "session opening"

    #: Names the session, also in the previous servers' pushes (which need grants, see the
    #: module, when ``push_key`` is given).
    session_id: str
    blocks: tuple[int, int] = attrs.field(converter=as_tuple)
    #: Positions the session holds at most.
    max_length: int
    batch_size: int = 1
    #: Seconds the server may wait for cache to free up (0: refuse at once what does not fit).
    alloc_timeout: float = attrs.field(default=0.0, converter=to_float)
    #: The adapter the blocks run with (an empty name means none).
    active_adapter: str | None = attrs.field(default=None, converter=no_empty_adapter)
    #: What the client offers for priority among requests; servers ignore it (nobody can check
    #: it), as Petals' do.
    points: float = attrs.field(default=0.0, converter=to_float)
    #: Per row, how many leading positions are padding, hidden from the row's real tokens.
    left_padding: tuple[int, ...] | None = attrs.field(default=None, converter=as_tuple)
    #: The key of the session's push grants (see the module); None: pushes need none.
    push_key: bytes | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        check_text("session_id", self.session_id)
        check_optional_bytes("push_key", self.push_key, low=16, high=64)
        check_blocks(self.blocks)
        check_integer("max_length", self.max_length, 1)
        check_integer("batch_size", self.batch_size, 1)
        check_number("alloc_timeout", self.alloc_timeout, low=0)
        check_adapter(self.active_adapter)
        check_number("points", self.points)
        padding = self.left_padding
        if padding is not None and (
            not isinstance(padding, tuple)
            or len(padding) != self.batch_size
            or not all(is_integer(p) and 0 <= p <= self.max_length for p in padding)
        ):
            raise LocalProtocolError(
                f"left_padding must be {self.batch_size} integers in [0, {self.max_length}]"
            )

    def to_wire(self) -> dict[str, Any]:
        padding = None if self.left_padding is None else list(self.left_padding)
        return {
            "session_id": self.session_id,
            "blocks": list(self.blocks),
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "alloc_timeout": self.alloc_timeout,
            "active_adapter": self.active_adapter,
            "points": self.points,
            **present(left_padding=padding, push_key=self.push_key),
        }


@attrs.frozen(kw_only=True)
class SessionReady(WireMessage):
    """The server's answer to :class:`OpenSession`: the session is open, its cache empty."""

    what: ClassVar[str] = "session answer"

    position: int = 0

    def __attrs_post_init__(self) -> None:
        check_integer("position", self.position, 0)

    def to_wire(self) -> dict[str, Any]:
        return {"ready": True, "position": self.position}

    @classmethod
    def from_wire_untrusted(cls, message: Mapping[str, Any]) -> SessionReady:
        """Raises :class:`CodecError` only."""

        def build() -> SessionReady:
            if message.get("ready") is not True:
                raise LocalProtocolError("an open session is answered with {'ready': true, ...}")
            return cls(**wire_fields(cls, message))

        return untrusted(cls.what, build, message)


@attrs.frozen(kw_only=True)
class PushTarget:
    """A session on another server that a step's output is to be pushed to."""

    peer: str
    session_id: str
    #: The client's grant of the step pushed there (see the module).
    grant: bytes | None = None

    def __attrs_post_init__(self) -> None:
        check_text("peer", self.peer)
        check_text("session_id", self.session_id)
        check_optional_bytes("grant", self.grant, low=1, high=64)

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer, "session_id": self.session_id, **present(grant=self.grant)}


def _push_targets(value: object) -> Any:
    """A step's ``push`` from the wire (a list of ``{"peer", "session_id"}``; null: none) as
    targets; a tuple is taken as it is, anything else left for the check to refuse."""
    if value is None:
        return ()
    if not isinstance(value, list):
        return value
    if not 0 < len(value) <= MAX_PUSH_CHAIN or not all(isinstance(e, dict) for e in value):
        raise _push_error()
    try:
        return tuple(
            PushTarget(
                peer=entry.get("peer"),
                session_id=entry.get("session_id"),
                grant=entry.get("grant"),
            )
            for entry in value
        )
    except LocalProtocolError:
        raise _push_error() from None


def _push_error() -> LocalProtocolError:
    return LocalProtocolError(
        f"push must be a list of 1..{MAX_PUSH_CHAIN} {{'peer', 'session_id'[, 'grant']}} entries"
    )


@attrs.frozen(kw_only=True)
class Step(WireMessage):
    """New positions for a session: ``hidden_states`` ``(B, T, hidden)``, any ``T >= 0``.

    ``start_from_position`` rolls the server's cache back to there first (a client resending
    from there), ``hypo_ids`` ``(B,)`` reorders its rows (beam search), ``prompts`` are deep
    prompts added to the step's first positions.  ``step_id`` (the client increases it from
    step to step) is repeated in the answer.  ``push`` names the sessions of the next servers
    of the client's route: the server pushes its output on to the first of them, as that
    session's next step (a step with prompts or ``hypo_ids`` cannot be pushed on), with the
    ``grant`` the client gave that target."""

    what: ClassVar[str] = "step"

    hidden_states: torch.Tensor = attrs.field(eq=TENSOR_EQ, hash=False)
    start_from_position: int | None = None
    step_id: int | None = None
    hypo_ids: torch.Tensor | None = attrs.field(default=None, eq=TENSOR_EQ, hash=False)
    prompts: torch.Tensor | None = attrs.field(default=None, eq=TENSOR_EQ, hash=False)
    push: tuple[PushTarget, ...] = attrs.field(default=(), converter=_push_targets)
    grant: bytes | None = None

    def __attrs_post_init__(self) -> None:
        check_hidden("hidden_states", self.hidden_states)
        check_optional_bytes("grant", self.grant, low=1, high=64)
        check_optional_integer("start_from_position", self.start_from_position, 0)
        check_optional_integer("step_id", self.step_id, 0)
        _check_hypo_ids(self.hypo_ids, self.hidden_states.shape[0])
        check_prompts("prompts", self.prompts)
        if (
            not isinstance(self.push, tuple)
            or len(self.push) > MAX_PUSH_CHAIN
            or not all(isinstance(target, PushTarget) for target in self.push)
        ):
            raise _push_error()
        if self.push:
            if self.prompts is not None or self.hypo_ids is not None:
                raise LocalProtocolError("a step with prompts or hypo_ids cannot be pushed on")
            if self.step_id is None:
                raise LocalProtocolError("a step to push on needs a step_id")

    def to_wire(self) -> dict[str, Any]:
        push = [target.to_wire() for target in self.push] or None
        return {
            "hidden_states": self.hidden_states,
            **present(
                start_from_position=self.start_from_position,
                step_id=self.step_id,
                prompts=self.prompts,
                hypo_ids=self.hypo_ids,
                push=push,
                grant=self.grant,
            ),
        }


def _check_hypo_ids(hypo_ids: object, batch: int) -> None:
    if hypo_ids is None:
        return
    if (
        not isinstance(hypo_ids, torch.Tensor)
        or hypo_ids.dtype.is_floating_point
        or hypo_ids.dtype == torch.bool
        or hypo_ids.shape != (batch,)
        or not bool(((hypo_ids >= 0) & (hypo_ids < batch)).all())
    ):
        raise LocalProtocolError(f"hypo_ids must be ({batch},) integers in [0, batch)")


@attrs.frozen(kw_only=True)
class StepResult(WireMessage):
    """The answer to a :class:`Step`: its output, and the positions the cache holds since.

    ``step_id`` repeats the step's; ``pushed`` (for a step that asked for a push) says whether
    the output went on to the next server (if not, the client sends it there itself)."""

    what: ClassVar[str] = "step result"

    hidden_states: torch.Tensor = attrs.field(eq=TENSOR_EQ, hash=False)
    position: int
    step_id: int | None = None
    pushed: bool | None = None
    #: The server's signature of its receipt (``_receipts``), with the digest of its input.
    receipt: Signature | None = attrs.field(default=None, converter=as_signature)

    def __attrs_post_init__(self) -> None:
        check_hidden("hidden_states", self.hidden_states)
        check_integer("position", self.position, 0)
        check_optional_integer("step_id", self.step_id, 0)
        if self.pushed is not None and not isinstance(self.pushed, bool):
            raise LocalProtocolError(f"pushed must be true or false, got {self.pushed!r}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "hidden_states": self.hidden_states,
            "position": self.position,
            **present(
                step_id=self.step_id,
                pushed=self.pushed,
                receipt=self.receipt and self.receipt.to_wire(),
            ),
        }


@attrs.frozen(kw_only=True)
class OpenPush(WireMessage):
    """The first message of a ``petals.push`` stream: the session of the receiving server that
    the stream's steps belong to."""

    what: ClassVar[str] = "push opening"

    session_id: str

    def __attrs_post_init__(self) -> None:
        check_text("session_id", self.session_id)

    def to_wire(self) -> dict[str, Any]:
        return {"session_id": self.session_id}
