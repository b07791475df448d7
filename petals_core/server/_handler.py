"""The server's RPCs: inference sessions, forward, backward and info over the blocks it holds.

**Inference** (``petals.inference``, one stream per session).  The client opens with
``{"session_id", "blocks": [start, end], "max_length", "batch_size", "alloc_timeout",
"active_adapter", "points", "left_padding"?}`` (``left_padding``: per row, leading positions
that are padding, hidden from the row's real tokens); the server reserves
``batch_size x max_length x (end - start)`` cache tokens (waiting up to ``alloc_timeout``,
capped by ``--max_alloc_timeout``; refusing at once what can never fit) and answers
``{"ready": true, "position": 0}``.  Each step is
``{"hidden_states": (B, T, hidden), "start_from_position"?, "hypo_ids"?, "prompts"?}`` with any
``T >= 0``; the answer is ``{"hidden_states": (B, T, hidden), "position": p}``, ``p`` the number
of positions the cache holds.  ``start_from_position`` rolls the cache back first (a client
resending from there), ``hypo_ids`` reorders its rows (beam search), ``prompts`` are deep
prompts added to the step's first positions.  A step may carry a ``step_id`` (an integer the
client increases from step to step), which its answer repeats.  The session ends when the client
ends its side; the cache is freed then.  Any error ends the session with a message naming the
cause: the server checks a step fully before touching the cache, so nothing of another session,
nor of this one before the failed step, is changed.

**Server-to-server** (``petals.push``): a step with no prompts and no ``hypo_ids`` may carry
``"push": [{"peer", "session_id"}, ...]``, the sessions of the next servers of the client's
route.  After computing it, this server sends its output, as the next step of the first of them
(same ``step_id``, ``start_from_position`` the step's own, the rest of the list as its
``push``), over a ``petals.push`` stream to that peer — dialled at the address the peer table
gives (read from the DHT if the table lacks it), never one a client names — and answers the
client with ``"pushed": true``.  The stream is dialled in the background on the first step that
names that session: until it is open, and if it cannot be, the answer says ``"pushed": false``
and the client sends the step on itself, so that a dial never delays a step.  The receiving
server takes pushed steps in its session's order beside the client's own: the session id, known
to the client and the servers it chose only, is the capability.  A pushed step whose
``step_id`` is not above every id the session has seen is stale (its client has resent that
step itself since) and is dropped.

Scheduling: single-step work of different sessions over the same blocks and adapter is batched
(:meth:`BlockBackend.inference_steps`); steps longer than ``max_batch_tokens`` tokens are
processed in chunks, each a separate job, so that a long prefill never holds up other sessions.

**Forward / backward** (``petals.forward`` / ``petals.backward``): tensors sent in parts (see
:mod:`petals_core.protocol`): meta ``{"blocks", "active_adapter", "points"}`` with
``hidden_states`` (and ``grad_outputs`` for backward, ``prompts`` optionally), below inference
steps in priority.  A forward runs each block as its own job.  A backward recomputes its span's
forward with autograd, in groups of blocks whose graphs fit ``backward_activation_bytes`` (one
group: no extra forward), then returns ``grad_inputs`` (and ``grad_prompts``).

A forward whose meta says ``"keep_for_backward": true`` may instead run with autograd and keep
its graph (estimated bytes within ``backward_activation_bytes`` and, with the other kept graphs,
``kept_forward_bytes``; the oldest are dropped to make room, and any after
``kept_forward_timeout_s``); its answer's meta then holds ``"kept": <token>``.  A backward from
the same peer naming that token in its meta, with the same blocks, adapter, hidden states and
prompts, takes the gradients from the kept graph without recomputing; anything else (an unknown,
used or expired token, other inputs) is recomputed as usual, so the token is only ever a hint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final

import attrs
import torch
import trio

from .._errors import AdapterError, CallEnded, CodecError, ServerError, TransportError
from ..models import KVCache
from ..protocol import BACKWARD, FORWARD, INFERENCE, INFO, PUSH, receive_tensors, send_tensors
from ..transport import Call, Connection, Handlers, ServerCall, open_call
from ._backend import BlockBackend, Graph
from ._memory_cache import MemoryCache
from ._task_pool import Priority, TaskPool

__all__ = ["BlockServer", "ServingLimits"]

logger = logging.getLogger(__name__)

_MAX_SESSION_ID_CHARS: Final = 128
#: Servers after this one that a pushed step may name.
_MAX_PUSH_CHAIN: Final = 64
#: Steps (the client's and pushed ones) waiting in a session's inbox.
_INBOX_SIZE: Final = 8
#: Longest wait to hand the next server a pushed step.
_PUSH_TIMEOUT_S: Final = 2.0
#: Longest wait to dial the next server and open the push stream (once per session, meanwhile
#: the client sends the steps on itself).
_DIAL_TIMEOUT_S: Final = 10.0
#: How long a server that could not be dialled for a push is not dialled again.
_UNREACHABLE_S: Final = 60.0
_MAX_UNREACHABLE: Final = 4096
_ALLOWED_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not value > 0:
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not 0 <= value < float("inf"):
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class ServingLimits:
    """What one request may ask of the server."""

    #: Longest session (positions), the ``--inference_max_length`` flag.
    inference_max_length: int = attrs.field(default=8192, validator=_positive)
    #: Tokens (rows x positions) one inference job processes at most: longer steps go in
    #: chunks.  The ``--max_batch_size`` flag.
    max_batch_tokens: int = attrs.field(default=2048, validator=_positive)
    #: Cap of a session's wait for cache (``--max_alloc_timeout``).
    max_alloc_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    #: Longest life of a session (``--session_timeout``).
    session_timeout_s: float = attrs.field(default=1800.0, validator=_positive)
    #: Longest wait for a session's next step (``--step_timeout``).
    step_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    #: Longest forward / backward call (``--request_timeout``).
    request_timeout_s: float = attrs.field(default=180.0, validator=_positive)
    #: Elements a forward / backward request may carry in all.
    max_request_elements: int = attrs.field(default=1 << 28, validator=_positive)
    #: Open sessions one peer may hold at once.
    max_sessions_per_peer: int = attrs.field(default=64, validator=_positive)
    #: Run concurrent sessions' steps over the same blocks as one batch (off: one by one, for
    #: comparison in benchmarks).
    batch_steps: bool = True
    #: Autograd graph (estimated bytes) one backward job may hold: a backward recomputes that
    #: many blocks at once with their activations kept, the rest in further groups.
    backward_activation_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    #: Forward graphs kept for a coming backward, in estimated bytes in all (0: none kept).
    kept_forward_bytes: int = attrs.field(default=1 << 30, validator=_non_negative)
    #: How long a kept forward graph waits for its backward.
    kept_forward_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    #: Inference jobs expected to compute in less than this many seconds run on the event loop's
    #: thread, without the hand-off to a worker thread (``--inline_compute_ms``; 0: never).
    inline_compute_s: float = attrs.field(default=0.025, validator=_non_negative)


class _Dialling:
    """A push stream being opened."""


_DIALLING: Final = _Dialling()

#: What a session's inbox holds: a step and whether it was pushed, None when the client ended its
#: side, or the exception the client's stream failed with.
_InboxItem = tuple[dict[str, Any], bool] | None | Exception


@attrs.frozen(kw_only=True, eq=False)
class _Kept:
    """A forward's graph kept for its backward."""

    peer: str
    start: int
    end: int
    adapter: str | None
    hidden: torch.Tensor
    prompts: torch.Tensor | None
    graph: Graph
    nbytes: int
    expires_at: float

    def matches(
        self,
        start: int,
        end: int,
        adapter: str | None,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
    ) -> bool:
        if (self.start, self.end, self.adapter) != (start, end, adapter):
            return False
        if not _same(self.hidden, hidden):
            return False
        if self.prompts is None or prompts is None:
            return self.prompts is None and prompts is None
        return _same(self.prompts, prompts)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


@attrs.define(eq=False)
class _Session:
    session_id: str
    peer: str
    start: int
    end: int
    batch: int
    max_length: int
    adapter: str | None
    points: float
    caches: list[KVCache]
    scope: trio.CancelScope
    closed_because: str | None = None
    #: The client's steps and pushed ones, in arrival order: (message, pushed).
    inbox: trio.MemorySendChannel[_InboxItem] | None = None
    #: The highest step_id seen (pushed steps at or below it are stale).
    last_step_id: int = -1
    #: Push streams to the next servers' sessions, by (peer, session id); None: that push failed
    #: (not tried again in this session), _DIALLING: being opened.
    pushes: dict[tuple[str, str], Call | _Dialling | None] = attrs.field(factory=dict)
    exits: contextlib.AsyncExitStack = attrs.field(factory=contextlib.AsyncExitStack)
    #: Where the session's background tasks run (the client reader, push dials).
    nursery: trio.Nursery | None = None

    @property
    def position(self) -> int:
        return self.caches[0].length


@attrs.frozen(kw_only=True)
class BlockServerStatistics:
    sessions: int
    steps: int
    batched_steps: int
    #: Steps that came from the previous server (server-to-server), and stale ones dropped.
    pushed_steps: int
    stale_pushes: int
    #: Push streams this server opened to the next servers' sessions, and dials that failed.
    push_streams: int
    push_dial_failures: int
    forwards: int
    backwards: int
    #: Backwards that took their gradients from a kept forward graph.
    kept_backwards: int
    failures: int
    #: Forward graphs kept now, and their estimated bytes.
    kept_forwards: int
    kept_forward_bytes: int


class BlockServer:
    """The RPC side of a server; :meth:`handlers` go to ``serve_rpc`` (or ``open_dht_node``).

    Until :meth:`attach` gives it a backend, every call is refused as "still loading".
    """

    def __init__(
        self,
        limits: ServingLimits,
        *,
        version: str,
        connect_peer: Callable[[str], Awaitable[Connection]] | None = None,
    ) -> None:
        self.limits = limits
        self.version = version
        #: Dials another server by its PeerID (at the address the peer table gives); pushes to
        #: the next server need it.
        self.connect_peer = connect_peer
        self._backend: BlockBackend | None = None
        self._pool: TaskPool | None = None
        self._cache: MemoryCache | None = None
        self._sessions: dict[str, _Session] = {}
        self._refusing: str | None = "the server is still loading its blocks"
        self._counts = dict.fromkeys(
            [
                "steps",
                "batched_steps",
                "pushed_steps",
                "stale_pushes",
                "push_streams",
                "push_dial_failures",
                "forwards",
                "backwards",
                "kept_backwards",
                "failures",
            ],
            0,
        )
        #: Set (and dropped) at the next count; made by a waiter.
        self._counted: trio.Event | None = None
        #: Servers a push could not dial, until when they are not tried again.
        self._unreachable: dict[str, float] = {}
        #: Token -> kept forward graph, oldest first.
        self._kept: dict[str, _Kept] = {}
        self._kept_bytes = 0

    # -- life cycle ------------------------------------------------------------------------------

    def attach(self, backend: BlockBackend, pool: TaskPool, cache: MemoryCache) -> None:
        self._backend, self._pool, self._cache = backend, pool, cache
        self._refusing = None

    def detach(self, reason: str) -> None:
        """Refuse new calls with ``reason`` and end the open sessions with it."""
        self._refusing = reason
        for session in list(self._sessions.values()):
            session.closed_because = reason
            session.scope.cancel()
        self._kept.clear()
        self._kept_bytes = 0
        self._backend = self._pool = self._cache = None

    @property
    def cache_tokens_left(self) -> int:
        """Free cache, in positions of one row of one block (a session takes batch x
        max_length x blocks)."""
        if self._cache is None or self._backend is None:
            return 0
        return self._cache.bytes_left // self._backend.cache_bytes_per_token

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    async def wait_statistics(
        self, predicate: Callable[[BlockServerStatistics], bool]
    ) -> BlockServerStatistics:
        """Wait until the statistics satisfy ``predicate`` (checked whenever a count changes);
        returns them.  Bound it with a trio deadline."""
        while True:
            statistics = self.statistics()
            if predicate(statistics):
                return statistics
            if self._counted is None:
                self._counted = trio.Event()
            await self._counted.wait()

    def _count(self, name: str) -> None:
        self._counts[name] += 1
        # An event only while someone waits: counting sits on every step's path.
        counted, self._counted = self._counted, None
        if counted is not None:
            counted.set()

    def statistics(self) -> BlockServerStatistics:
        self._drop_expired()
        return BlockServerStatistics(
            sessions=len(self._sessions),
            kept_forwards=len(self._kept),
            kept_forward_bytes=self._kept_bytes,
            **self._counts,
        )

    def _parts(self) -> tuple[BlockBackend, TaskPool, MemoryCache]:
        if self._refusing is not None or self._backend is None:
            raise ServerError(self._refusing or "the server is not serving")
        assert self._pool is not None and self._cache is not None
        return self._backend, self._pool, self._cache

    # -- handlers --------------------------------------------------------------------------------

    def handlers(self) -> Handlers:
        handlers = Handlers()
        handlers.add_unary(INFO, self._info)
        handlers.add_stream(INFERENCE, self._inference)
        handlers.add_stream(PUSH, self._push_stream)
        handlers.add_stream(FORWARD, self._forward)
        handlers.add_stream(BACKWARD, self._backward)
        return handlers

    async def _info(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        backend, _, _ = self._parts()
        return {
            "version": self.version,
            "start_block": backend.start,
            "end_block": backend.end,
            "hidden_size": backend.hidden_size,
            "torch_dtype": str(backend.dtype).removeprefix("torch."),
            "accepted_dtypes": [str(d).removeprefix("torch.") for d in _ALLOWED_DTYPES],
            "adapters": sorted(backend.adapters),
            "cache_tokens_left": self.cache_tokens_left,
            "inference_max_length": self.limits.inference_max_length,
            "max_batch_tokens": self.limits.max_batch_tokens,
            "open_sessions": len(self._sessions),
            "device": str(backend.device),
            "device_memory_reserved_bytes": backend.device_memory_reserved_bytes(),
            "decode_graphs": backend.decode_graphs_info(),
        }

    # -- inference -------------------------------------------------------------------------------

    async def _inference(self, call: ServerCall) -> None:
        backend, pool, cache = self._parts()
        with trio.move_on_after(self.limits.step_timeout_s) as waited:
            opening = await call.receive()
        if waited.cancelled_caught:
            raise ServerError("no session request arrived in time")
        session_id, start, end, batch, max_length, alloc_timeout, adapter, points = self._opening(
            opening, backend
        )
        padding = _left_padding(opening, batch, max_length)
        peer = str(call.peer_id)
        self._check_peer_quota(peer)
        nbytes = backend.cache_bytes_per_token * batch * max_length * (end - start)
        async with cache.allocate(nbytes, timeout_s=alloc_timeout):
            caches = await pool.run(
                lambda: backend.allocate_caches(start, end, batch, max_length, padding=padding),
                priority=Priority.INFERENCE,
                points=points,
            )
            # Checked again with no await before the session is registered: another opening
            # with the same id (or of the same peer) may have registered while we waited.
            if session_id in self._sessions:
                raise ServerError(f"session id {session_id!r} is already in use")
            self._check_peer_quota(peer)
            session = _Session(
                session_id=session_id,
                peer=peer,
                start=start,
                end=end,
                batch=batch,
                max_length=max_length,
                adapter=adapter,
                points=points,
                caches=caches,
                scope=trio.CancelScope(),
            )
            inbox, steps = trio.open_memory_channel[_InboxItem](_INBOX_SIZE)
            session.inbox = inbox
            self._sessions[session_id] = session
            try:
                with session.scope:
                    session.scope.deadline = trio.current_time() + self.limits.session_timeout_s
                    await call.send({"ready": True, "position": 0})
                    await self._run_session(call, session, steps, backend, pool)
                    return
                if session.closed_because is not None:
                    raise ServerError(session.closed_because)
                raise ServerError(
                    f"the session exceeded this server's session timeout "
                    f"({self.limits.session_timeout_s} s)"
                )
            finally:
                del self._sessions[session_id]
                inbox.close()
                session.caches.clear()

    def _check_peer_quota(self, peer: str) -> None:
        if sum(1 for s in self._sessions.values() if s.peer == peer) >= (
            self.limits.max_sessions_per_peer
        ):
            raise ServerError(
                f"this peer already holds {self.limits.max_sessions_per_peer} sessions here"
            )

    def _opening(
        self, request: dict[str, Any], backend: BlockBackend
    ) -> tuple[str, int, int, int, int, float, str | None, float]:
        session_id = request.get("session_id")
        if not isinstance(session_id, str) or not 0 < len(session_id) <= _MAX_SESSION_ID_CHARS:
            raise CodecError(f"session_id must be a string of 1..{_MAX_SESSION_ID_CHARS} chars")
        if session_id in self._sessions:
            raise ServerError(f"session id {session_id!r} is already in use")
        start, end = _blocks(request, backend)
        max_length = _integer(request, "max_length", 1, self.limits.inference_max_length)
        batch = _integer(request, "batch_size", 1, self.limits.max_batch_tokens, default=1)
        alloc_timeout = _number(request, "alloc_timeout", default=0.0)
        if alloc_timeout < 0:
            raise CodecError("alloc_timeout must be >= 0")
        adapter = _adapter(request, backend)
        points = _number(request, "points", default=0.0)
        return session_id, start, end, batch, max_length, alloc_timeout, adapter, points

    async def _run_session(
        self,
        call: ServerCall,
        session: _Session,
        steps: trio.MemoryReceiveChannel[_InboxItem],
        backend: BlockBackend,
        pool: TaskPool,
    ) -> None:
        """The session's steps, with a task reading the client's into the inbox beside pushes.

        Whatever ends the steps is raised as it is (not in an exception group), so that the RPC
        layer tells the client, or sees its stream fail, as with any other handler."""
        assert session.inbox is not None
        failure: BaseException | None = None
        async with session.exits, trio.open_nursery() as nursery:
            session.nursery = nursery
            nursery.start_soon(_read_client, call, session.inbox)
            try:
                await self._steps(call, session, steps, backend, pool)
            except BaseException as exc:
                failure = exc
            finally:
                nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _steps(
        self,
        call: ServerCall,
        session: _Session,
        steps: trio.MemoryReceiveChannel[_InboxItem],
        backend: BlockBackend,
        pool: TaskPool,
    ) -> None:
        while True:
            with trio.move_on_after(self.limits.step_timeout_s) as waited:
                item = await steps.receive()
            if waited.cancelled_caught:
                raise ServerError(
                    f"no step arrived within this server's step timeout "
                    f"({self.limits.step_timeout_s} s): the session is closed"
                )
            if item is None:
                return  # the client ended its side
            if isinstance(item, BaseException):
                raise item  # the client's stream failed
            step, pushed = item
            try:
                step_id = _step_id(step)
                if pushed and (step_id is None or step_id <= session.last_step_id):
                    self._count("stale_pushes")
                    continue
                if step_id is not None:
                    session.last_step_id = max(session.last_step_id, step_id)
                chain = _push_chain(step)
                if chain and step_id is None:
                    raise ValueError("a step to push on needs a step_id")
                output = await self._step(step, session, backend, pool)
            except (ValueError, CodecError) as exc:
                self._count("failures")
                raise ServerError(f"step refused: {exc}") from None
            answer: dict[str, Any] = {"hidden_states": output, "position": session.position}
            if step_id is not None:
                answer["step_id"] = step_id
            if chain:
                start = session.position - output.shape[1]  # where this step began
                answer["pushed"] = await self._push(session, chain, output, start, step_id)
            if pushed:
                self._count("pushed_steps")
            await call.send(answer)

    async def _push(
        self,
        session: _Session,
        chain: list[dict[str, str]],
        output: torch.Tensor,
        start: int,
        step_id: int | None,
    ) -> bool:
        """Hand ``output`` to the next server's session as its step; whether it was sent."""
        target = chain[0]
        key = (target["peer"], target["session_id"])
        if key not in session.pushes:
            self._start_dial(session, key)
        push_call = session.pushes[key]
        if not isinstance(push_call, Call):
            return False  # being dialled, or it failed
        message: dict[str, Any] = {
            "hidden_states": output,
            "start_from_position": start,
            "step_id": step_id,
        }
        if len(chain) > 1:
            message["push"] = chain[1:]
        with trio.move_on_after(_PUSH_TIMEOUT_S):
            try:
                await push_call.send(message)
                return True
            except TransportError as exc:
                logger.info("cannot push to %s: %r", target["peer"], exc)
        session.pushes[key] = None
        return False

    def _start_dial(self, session: _Session, key: tuple[str, str]) -> None:
        peer = key[0]
        if (
            self.connect_peer is None
            or session.nursery is None
            or trio.current_time() < self._unreachable.get(peer, -math.inf)
        ):
            session.pushes[key] = None
            return
        session.pushes[key] = _DIALLING
        session.nursery.start_soon(self._dial, session, key, self.connect_peer)

    async def _dial(
        self,
        session: _Session,
        key: tuple[str, str],
        connect_peer: Callable[[str], Awaitable[Connection]],
    ) -> None:
        """Open the push stream to ``key``'s session (in the session's nursery)."""
        peer, session_id = key
        with trio.move_on_after(_DIAL_TIMEOUT_S):
            try:
                connection = await connect_peer(peer)
                opened = await session.exits.enter_async_context(open_call(connection, PUSH))
                await opened.send({"session_id": session_id})
            except TransportError as exc:
                logger.info("cannot push to %s: %r", peer, exc)
            else:
                self._unreachable.pop(peer, None)
                session.pushes[key] = opened
                self._count("push_streams")
                return
        self._mark_unreachable(peer)
        self._count("push_dial_failures")
        session.pushes[key] = None

    def _mark_unreachable(self, peer: str) -> None:
        """Until proven otherwise (the dial succeeds); at most a few thousand remembered."""
        now = trio.current_time()
        if len(self._unreachable) >= _MAX_UNREACHABLE:
            for other in [p for p, until in self._unreachable.items() if until <= now]:
                del self._unreachable[other]
            while len(self._unreachable) >= _MAX_UNREACHABLE:
                del self._unreachable[next(iter(self._unreachable))]
        self._unreachable[peer] = now + _UNREACHABLE_S

    async def _push_stream(self, call: ServerCall) -> None:
        """Another server's outputs, as steps of one of our sessions."""
        with trio.move_on_after(self.limits.step_timeout_s) as waited:
            header = await call.receive()
        if waited.cancelled_caught:
            raise ServerError("no push header arrived in time")
        session_id = header.get("session_id")
        session = self._sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None or session.inbox is None:
            raise ServerError(f"unknown session {session_id!r}")
        inbox = session.inbox
        while True:
            try:
                step = await call.receive()
            except CallEnded:
                return
            try:
                await inbox.send((step, True))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return  # the session ended

    async def _step(
        self, step: dict[str, Any], session: _Session, backend: BlockBackend, pool: TaskPool
    ) -> torch.Tensor:
        hidden = backend.check_hidden(step.get("hidden_states"))
        if hidden.dtype not in _ALLOWED_DTYPES:
            raise ValueError(f"hidden_states must be one of {_ALLOWED_DTYPES}, not {hidden.dtype}")
        if hidden.shape[0] != session.batch:
            raise ValueError(
                f"the session has {session.batch} rows; this step has {hidden.shape[0]}"
            )
        position = session.position
        start_from = step.get("start_from_position")
        if start_from is not None:
            if isinstance(start_from, bool) or not isinstance(start_from, int):
                raise ValueError("start_from_position must be an integer")
            if not 0 <= start_from <= position:
                raise ValueError(
                    f"cannot start from position {start_from}: the cache holds {position}"
                )
            position = start_from
        tokens = hidden.shape[1]
        if position + tokens > session.max_length:
            raise ValueError(
                f"{position} + {tokens} positions exceed the session's max_length "
                f"{session.max_length}"
            )
        hypo_ids = step.get("hypo_ids")
        if hypo_ids is not None and (
            not isinstance(hypo_ids, torch.Tensor)
            or hypo_ids.dtype.is_floating_point
            or hypo_ids.dtype == torch.bool
            or hypo_ids.shape != (session.batch,)
            or not bool(((hypo_ids >= 0) & (hypo_ids < session.batch)).all())
        ):
            raise ValueError(f"hypo_ids must be ({session.batch},) integers in [0, batch)")
        prompts = step.get("prompts")
        backend.check_prompts(prompts, session.start, session.end, hidden)
        # Checked: from here on the step runs (and rolls back what it wrote if it fails).
        for cache in session.caches:
            cache.rollback(position)
        self._count("steps")
        if hypo_ids is not None:
            # As row indices: torch refuses int8 indices and reads uint8 ones as a mask.
            reorder = hypo_ids.to(torch.int64)

            def reorder_all() -> None:
                for cache in session.caches:
                    cache.reorder(reorder)

            await pool.run(reorder_all, priority=Priority.INFERENCE, points=session.points)
        if tokens == 0:
            return hidden
        chunk = max(1, self.limits.max_batch_tokens // session.batch)
        if prompts is None and tokens <= chunk and self.limits.batch_steps:
            self._count("batched_steps")
            key = ("step", session.start, session.end, session.adapter)
            adapter, start, end = session.adapter, session.start, session.end

            def run_batch(
                items: list[tuple[torch.Tensor, list[KVCache]]],
            ) -> list[torch.Tensor]:
                return backend.inference_steps(start, end, items, adapter=adapter)

            return await pool.run_batched(
                key,
                (hidden, session.caches),
                run_batch,
                priority=Priority.INFERENCE,
                points=session.points,
                size=session.batch * tokens,
            )
        outputs = []
        for offset in range(0, tokens, chunk):
            part = hidden[:, offset : offset + chunk]
            part_prompts = None
            if prompts is not None and offset < prompts.shape[2]:
                part_prompts = prompts[:, :, offset : offset + chunk]
            outputs.append(
                await pool.run(
                    functools.partial(
                        backend.inference_step,
                        session.start,
                        session.end,
                        part,
                        session.caches,
                        prompts=part_prompts,
                        adapter=session.adapter,
                    ),
                    priority=Priority.INFERENCE,
                    points=session.points,
                    cost_key=(
                        "chunk",
                        session.start,
                        session.end,
                        session.adapter,
                        part_prompts is not None,
                    ),
                    size=session.batch * part.shape[1],
                )
            )
        return torch.cat(outputs, dim=1)

    # -- forward / backward ----------------------------------------------------------------------

    async def _forward(self, call: ServerCall) -> None:
        backend, pool, _ = self._parts()
        with self._request_deadline():
            meta, tensors = await receive_tensors(
                call.receive, max_elements=self.limits.max_request_elements
            )
            start, end, adapter, points, hidden, prompts = self._pass(meta, tensors, backend)
            keep = meta.get("keep_for_backward") is True
            nbytes = backend.activation_bytes(hidden.shape[0], hidden.shape[1]) * (end - start)
            reply: dict[str, Any] = {}
            if keep and nbytes <= min(
                self.limits.backward_activation_bytes, self.limits.kept_forward_bytes
            ):
                output, graph = await pool.run(
                    functools.partial(
                        backend.forward_keeping_graph,
                        start,
                        end,
                        hidden,
                        prompts=prompts,
                        adapter=adapter,
                    ),
                    priority=Priority.FORWARD,
                    points=points,
                )
                reply["kept"] = self._keep(
                    _Kept(
                        peer=str(call.peer_id),
                        start=start,
                        end=end,
                        adapter=adapter,
                        hidden=hidden,
                        prompts=prompts,
                        graph=graph,
                        nbytes=nbytes,
                        expires_at=trio.current_time() + self.limits.kept_forward_timeout_s,
                    )
                )
            else:
                output = (
                    await self._run_forward(
                        backend, pool, start, end, hidden, prompts, adapter, points
                    )
                )[-1]
            self._count("forwards")
            await send_tensors(call.send, reply, {"hidden_states": output.to(hidden.dtype)})

    def _keep(self, kept: _Kept) -> str:
        """Store ``kept`` (dropping expired graphs, then the oldest, to make room); its token."""
        self._drop_expired()
        while self._kept and self._kept_bytes + kept.nbytes > self.limits.kept_forward_bytes:
            self._forget(next(iter(self._kept)))
        token = secrets.token_hex(16)
        self._kept[token] = kept
        self._kept_bytes += kept.nbytes
        return token

    def _forget(self, token: str) -> _Kept | None:
        kept = self._kept.pop(token, None)
        if kept is not None:
            self._kept_bytes -= kept.nbytes
        return kept

    def _drop_expired(self) -> None:
        now = trio.current_time()
        for token in [t for t, kept in self._kept.items() if kept.expires_at <= now]:
            self._forget(token)

    async def _backward(self, call: ServerCall) -> None:
        backend, pool, _ = self._parts()
        with self._request_deadline():
            meta, tensors = await receive_tensors(
                call.receive, max_elements=self.limits.max_request_elements
            )
            start, end, adapter, points, hidden, prompts = self._pass(meta, tensors, backend)
            grad_outputs = tensors.get("grad_outputs")
            if not isinstance(grad_outputs, torch.Tensor) or grad_outputs.shape != hidden.shape:
                raise ServerError(
                    f"grad_outputs must have the shape of hidden_states, {tuple(hidden.shape)}"
                )
            if grad_outputs.dtype not in _ALLOWED_DTYPES:
                raise ServerError(f"grad_outputs must be one of {_ALLOWED_DTYPES}")
            kept = self._take_kept(meta.get("kept"), str(call.peer_id))
            if kept is not None and kept.matches(start, end, adapter, hidden, prompts):
                grad, grad_prompts = await pool.run(
                    functools.partial(backend.backward_from_graph, kept.graph, grad_outputs),
                    priority=Priority.BACKWARD,
                    points=points,
                )
                self._count("kept_backwards")
            else:
                grad, grad_prompts = await self._recompute_backward(
                    backend, pool, start, end, hidden, grad_outputs, prompts, adapter, points
                )
            self._count("backwards")
            await send_tensors(
                call.send,
                {},
                {
                    "grad_inputs": grad.to(hidden.dtype),
                    "grad_prompts": None
                    if grad_prompts is None or prompts is None
                    else grad_prompts.to(prompts.dtype),
                },
            )

    def _take_kept(self, token: object, peer: str) -> _Kept | None:
        """The graph ``token`` names, if ``peer`` kept it; it serves one backward (or none)."""
        kept = self._kept.get(token) if isinstance(token, str) else None
        if kept is None or kept.peer != peer:
            return None  # unknown, or another peer's: not this caller's to spend
        self._forget(str(token))
        return kept

    async def _recompute_backward(
        self,
        backend: BlockBackend,
        pool: TaskPool,
        start: int,
        end: int,
        hidden: torch.Tensor,
        grad_outputs: torch.Tensor,
        prompts: torch.Tensor | None,
        adapter: str | None,
        points: float,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the input (and prompts) of blocks ``[start, end)``, each group of blocks
        recomputed with its graph."""
        groups = self._backward_groups(backend, start, end, hidden)
        # Each group's input: the request's for the first, a forward (no graph) for the others.
        group_inputs = [hidden]
        if len(groups) > 1:
            outputs = await self._run_forward(
                backend, pool, start, groups[-1][0], hidden, prompts, adapter, points
            )
            group_inputs += [outputs[group_start - start - 1] for group_start, _ in groups[1:]]
        grad = grad_outputs
        prompt_grads: list[torch.Tensor] = []
        for (group_start, group_end), group_input in zip(
            reversed(groups), reversed(group_inputs), strict=True
        ):
            group_prompts = (
                None if prompts is None else prompts[group_start - start : group_end - start]
            )
            grad, prompt_grad = await pool.run(
                functools.partial(
                    backend.backward_span,
                    group_start,
                    group_end,
                    group_input,
                    grad,
                    prompts=group_prompts,
                    adapter=adapter,
                ),
                priority=Priority.BACKWARD,
                points=points,
            )
            if prompt_grad is not None:
                prompt_grads.append(prompt_grad)
        grad_prompts = torch.cat(prompt_grads[::-1]) if prompt_grads else None
        return grad, grad_prompts

    def _backward_groups(
        self, backend: BlockBackend, start: int, end: int, hidden: torch.Tensor
    ) -> list[tuple[int, int]]:
        """Blocks ``[start, end)`` in consecutive groups whose autograd graphs fit the backward
        memory budget (``ServingLimits.backward_activation_bytes``), at least one block each: a
        group is recomputed with its graph in one job; the fewer groups, the less recomputed."""
        per_block = backend.activation_bytes(hidden.shape[0], hidden.shape[1])
        size = max(1, self.limits.backward_activation_bytes // max(1, per_block))
        return [(g, min(g + size, end)) for g in range(start, end, size)]

    @contextlib.contextmanager
    def _request_deadline(self) -> Iterator[None]:
        with trio.move_on_after(self.limits.request_timeout_s) as scope:
            yield
        if scope.cancelled_caught:
            raise ServerError(
                f"the request exceeded this server's request timeout "
                f"({self.limits.request_timeout_s} s)"
            )

    def _pass(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], backend: BlockBackend
    ) -> tuple[int, int, str | None, float, torch.Tensor, torch.Tensor | None]:
        try:
            start, end = _blocks(meta, backend)
            adapter = _adapter(meta, backend)
            points = _number(meta, "points", default=0.0)
            hidden = backend.check_hidden(tensors.get("hidden_states"))
            if hidden.dtype not in _ALLOWED_DTYPES:
                raise ValueError(f"hidden_states must be one of {_ALLOWED_DTYPES}")
            if hidden.shape[1] < 1:
                raise ValueError("hidden_states must hold at least one token")
            if hidden.shape[1] > self.limits.inference_max_length:
                raise ValueError(
                    f"{hidden.shape[1]} tokens exceed this server's longest sequence, "
                    f"{self.limits.inference_max_length} (--inference_max_length)"
                )
            prompts = tensors.get("prompts")
            backend.check_prompts(prompts, start, end, hidden)
        except AdapterError:
            self._count("failures")
            raise
        except (ValueError, CodecError) as exc:
            self._count("failures")
            raise ServerError(f"request refused: {exc}") from None
        return start, end, adapter, points, hidden, prompts

    async def _run_forward(
        self,
        backend: BlockBackend,
        pool: TaskPool,
        start: int,
        end: int,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        adapter: str | None,
        points: float,
    ) -> list[torch.Tensor]:
        """Every block's output, each block a job of its own."""
        outputs = []
        x = hidden
        for index in range(start, end):
            prompt = None if prompts is None else prompts[index - start]
            x = await pool.run(
                functools.partial(backend.forward_block, index, x, prompt=prompt, adapter=adapter),
                priority=Priority.FORWARD,
                points=points,
            )
            outputs.append(x)
        return outputs


def _integer(
    request: dict[str, Any], name: str, low: int, high: int, *, default: int | None = None
) -> int:
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CodecError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _number(request: dict[str, Any], name: str, *, default: float) -> float:
    value = request.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CodecError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _blocks(request: dict[str, Any], backend: BlockBackend) -> tuple[int, int]:
    blocks = request.get("blocks")
    if (
        not isinstance(blocks, list)
        or len(blocks) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)
    ):
        raise CodecError("blocks must be [start, end]")
    start, end = blocks
    if not backend.start <= start < end <= backend.end:
        raise CodecError(
            f"blocks [{start}, {end}) are not inside the blocks this server holds, "
            f"[{backend.start}, {backend.end})"
        )
    return start, end


def _left_padding(request: dict[str, Any], batch: int, max_length: int) -> torch.Tensor | None:
    """The opening's ``left_padding``: per row, how many leading positions are padding."""
    padding = request.get("left_padding")
    if padding is None:
        return None
    if (
        not isinstance(padding, list)
        or len(padding) != batch
        or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= max_length for p in padding
        )
    ):
        raise CodecError(f"left_padding must be {batch} integers in [0, {max_length}]")
    return torch.tensor(padding, dtype=torch.int64)


def _adapter(request: dict[str, Any], backend: BlockBackend) -> str | None:
    adapter = request.get("active_adapter")
    if adapter is not None and not isinstance(adapter, str):
        raise CodecError("active_adapter must be a string or null")
    if adapter == "":
        adapter = None
    backend.check_adapter(adapter)
    return adapter


async def _read_client(call: ServerCall, inbox: trio.MemorySendChannel[_InboxItem]) -> None:
    """The client's steps into the session's inbox: then None once the client ended its side,
    or the error its stream failed with (raised by the session's own task)."""
    while True:
        try:
            step = await call.receive()
        except CallEnded:
            await inbox.send(None)
            return
        except Exception as exc:
            await inbox.send(exc)
            return
        await inbox.send((step, False))


def _step_id(step: dict[str, Any]) -> int | None:
    step_id = step.get("step_id")
    if step_id is None:
        return None
    if isinstance(step_id, bool) or not isinstance(step_id, int) or step_id < 0:
        raise ValueError("step_id must be an integer >= 0")
    return step_id


def _push_chain(step: dict[str, Any]) -> list[dict[str, str]]:
    chain = step.get("push")
    if chain is None:
        return []
    if (
        not isinstance(chain, list)
        or not 0 < len(chain) <= _MAX_PUSH_CHAIN
        or not all(
            isinstance(entry, dict)
            and isinstance(entry.get("peer"), str)
            and isinstance(entry.get("session_id"), str)
            and 0 < len(entry["session_id"]) <= _MAX_SESSION_ID_CHARS
            and 0 < len(entry["peer"]) <= _MAX_SESSION_ID_CHARS
            for entry in chain
        )
    ):
        raise ValueError(
            f"push must be a list of 1..{_MAX_PUSH_CHAIN} {{'peer', 'session_id'}} entries"
        )
    if step.get("prompts") is not None or step.get("hypo_ids") is not None:
        raise ValueError("a step with prompts or hypo_ids cannot be pushed on")
    return [{"peer": entry["peer"], "session_id": entry["session_id"]} for entry in chain]
