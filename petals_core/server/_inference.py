"""Inference sessions (``petals.inference``) and server-to-server pushes (``petals.push``).

The messages are :mod:`petals_core.protocol`'s.  A session's opening reserves its cache
(waiting up to its ``alloc_timeout``, capped by ``--max_alloc_timeout``; refusing at once what
can never fit); the cache is freed when the client ends its side.  A session counts against its
peer's ``max_sessions_per_peer`` from its opening on, while it waits for cache too.  Any error
of a client's step ends the session with a message naming the cause: a step is checked fully
before the cache is touched, so nothing of another session, nor of this one before the failed
step, is changed.  (Pushed steps that fail are refused or dropped instead, below.)

**Pushes.** After computing a step that names the next servers' sessions (``push``), this
server sends its output, as the next step of the first of them (same ``step_id``,
``start_from_position`` the step's own, the rest of the list as its ``push``), over a
``petals.push`` stream to that peer -- dialled at the address the peer table gives (read from
the DHT if the table lacks it), never one a client names -- and answers the client with
``pushed: true``. The stream is dialled in the background on the first step that names that
session: until it is open, and if it cannot be, the answer says ``pushed: false`` and the
client sends the step on itself, so that a dial never delays a step. A session pushes to at
most a few next sessions at once (:data:`_MAX_PUSH_TARGETS`: streams open or being opened,
those whose sends failed included; not those that could not be dialled) and tries a few more in
all (:data:`_MAX_PUSH_TRIES`); a step naming another is not pushed. A push not sent within
:func:`_push_timeout` (a fixed wait plus its bytes over a slow link) is answered
``pushed: false`` and ends the session's pushes to that next session. The receiving server takes
pushed steps in its session's order beside the client's own. A session opened with a push key
takes a pushed step only with its client's grant of exactly that step (see
``protocol._inference``): the previous servers of a route learn the session's id, but cannot
steer it.  A pushed step that does not parse, carries deep prompts or ``hypo_ids`` (no honest
push does: the previous server makes it of a step that could be pushed on), or lacks its grant
is refused: the push stream ends with the fault named, the session is untouched.  One that is
granted but fails (its hidden size is not the blocks') is dropped, its step id counted as seen:
the client's next step, which always names its start, goes on from there.
Its ``start_from_position`` is honoured, as every push carries the previous server's start (a
client's rollback reaches the later servers that way).  A pushed step whose ``step_id`` is not
above every id the session has seen is stale (its client has resent that step itself since) and
is dropped. A push stream ends (cleanly) when the session it feeds does.

**Scheduling.**  Single-step work of different sessions over the same blocks and adapter is
batched (:meth:`BlockBackend.inference_steps`), up to ``max_batch_tokens`` tokens (rows x
positions) in one batch; steps longer than that are processed in chunks, each a separate job,
so that a long prefill never holds up other sessions.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final, Literal

import attrs
import torch
import trio

from .._errors import CallEnded, CodecError, ServerError, SessionTooLarge, TransportError
from ..models import KVCache
from ..protocol import (
    FIRST_STEP,
    PUSH,
    OpenPush,
    OpenSession,
    PushTarget,
    SessionReady,
    Step,
)
from ..transport import Call, Connection, ServerCall, compress_floats, open_call
from ._backend import BlockBackend
from ._memory_cache import MemoryCache
from ._serving import Serving, check_blocks_held
from ._session_state import SessionState, StepPlan
from ._task_pool import Priority, TaskPool

__all__ = ["InferenceHandlers"]

logger = logging.getLogger(__name__)

#: Steps (the client's and pushed ones) waiting in a session's inbox.
_INBOX_SIZE: Final = 8
#: Longest wait to hand the next server a pushed step: this, plus its tensors' bytes at
#: :data:`_PUSH_SLOW_LINK_BYTES_PER_S`.
_PUSH_TIMEOUT_S: Final = 2.0
#: The slowest link a push allows for (2 Mbit/s).  A client waits for a step's answer at least
#: ten times its bytes both ways at 1 MB/s, so a push that is this slow still ends before the
#: client gives up on the step.
_PUSH_SLOW_LINK_BYTES_PER_S: Final = 256 << 10
#: Longest wait to dial the next server and open the push stream (once per session, meanwhile
#: the client sends the steps on itself).
_DIAL_TIMEOUT_S: Final = 10.0
#: Push streams one session may hold open or be opening at once (one per next session), those
#: whose sends failed included: normally one, a few more after the client's failovers.  Each is
#: kept until the session ends; a step naming yet another is answered but not pushed (its
#: client sends it on itself).
_MAX_PUSH_TARGETS: Final = 4
#: A push stream whose send failed: reset, not used again, and counted among the session's push
#: streams until it ends.
_FAILED: Final = "failed"
#: Distinct next sessions one session may ever try to push to, failed tries included: each costs
#: a dial, so that a client cannot make a server dial without end.
_MAX_PUSH_TRIES: Final = 16
#: What a pushed step never carries: the previous server makes it (SessionState.push_step) of
#: a step that could be pushed on, which has neither (see protocol.Step).
_NEVER_PUSHED: Final = ("prompts", "hypo_ids")
#: How long a server that could not be dialled for a push is not dialled again.
_UNREACHABLE_S: Final = 60.0
_MAX_UNREACHABLE: Final = 4096


#: How long a step's push waits for its stream while it is being opened (the dial starts as the
#: step arrives, so it runs beside the step's compute): enough for a stream on a connection
#: already open, next to nothing beside a fresh dial's round trips (meanwhile the client sends
#: the step on itself).
_DIAL_WAIT_S: Final = 0.02


def _push_timeout(step: Step) -> float:
    """How long a push of ``step`` may take to be sent: a fixed wait (the next server's inbox
    may be full for a moment) plus its hidden states' bytes (all a pushed step carries) over the
    slowest link a push allows for."""
    return _PUSH_TIMEOUT_S + step.hidden_states.nbytes / _PUSH_SLOW_LINK_BYTES_PER_S


@attrs.define(eq=False)
class _Dialling:
    """A push stream being opened; ``done`` is set once it is (or could not be)."""

    done: trio.Event = attrs.field(factory=trio.Event)


#: What a session's inbox holds: a step of the client's as it came, or a pushed one (parsed and
#: granted), and whether it was pushed; None when the client ended its side, or the exception
#: the client's stream failed with.
_InboxItem = tuple[dict[str, Any] | Step, bool] | None | Exception


@attrs.define(eq=False)
class _Session:
    #: What the client asked for: blocks, batch, length, adapter, left padding (step receipts
    #: sign the padding as opened).
    opening: OpenSession
    caches: list[KVCache]
    scope: trio.CancelScope
    #: Positions and step ids: what each step does (see SessionState).
    state: SessionState
    closed_because: str | None = None
    #: The digest of the last step receipt signed (:data:`FIRST_STEP` before any): the next one
    #: names it, so the session's receipts make one unbroken chain.
    chain: bytes = FIRST_STEP
    #: The client's steps and pushed ones, in arrival order: (message, pushed).
    inbox: trio.MemorySendChannel[_InboxItem] | None = None
    #: Push streams to the next servers' sessions, by (peer, session id); a _Dialling: being
    #: opened; _FAILED: its send failed, None: it could not be opened (neither is tried again in
    #: this session).  At most _MAX_PUSH_TARGETS entries that are not None, and _MAX_PUSH_TRIES
    #: in all.
    pushes: dict[tuple[str, str], Call | _Dialling | Literal["failed"] | None] = attrs.field(
        factory=dict
    )
    exits: contextlib.AsyncExitStack = attrs.field(factory=contextlib.AsyncExitStack)
    #: Where the session's background tasks run (the client reader, push dials).
    nursery: trio.Nursery | None = None
    #: The push streams feeding the session (their handlers' scopes): ended with it.
    feeds: set[trio.CancelScope] = attrs.field(factory=set)


class InferenceHandlers:
    """The ``petals.inference`` and ``petals.push`` handlers, and the open sessions."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        self.limits = serving.limits
        #: Dials another server by its PeerID (at the address the peer table gives); pushes to
        #: the next server need it.
        self.connect_peer: Callable[[str], Awaitable[Connection]] | None = None
        self._sessions: dict[str, _Session] = {}
        #: Sessions open or being opened, by peer (what ``max_sessions_per_peer`` bounds).
        self._held: dict[str, int] = {}
        #: The scopes of the openings not registered yet (waiting for cache, or allocating it).
        self._waiting_openings: set[trio.CancelScope] = set()
        #: The session ids of those openings (as many times as they are under way).
        self._opening_ids: collections.Counter[str] = collections.Counter()
        #: Set (and replaced) each time a session registers, or an opening ends without: pushes
        #: that came first wait on it.
        self._registered = trio.Event()
        #: Servers a push could not dial, until when they are not tried again.
        self._unreachable: dict[str, float] = {}

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def openings(self) -> int:
        """Sessions being opened: waiting for cache, or allocating it."""
        return sum(self._held.values()) - len(self._sessions)

    def close_all(self, reason: str) -> None:
        """End every open session with ``reason``, and every opening still waiting for its
        cache (each holds the blocks it was opened on)."""
        for session in list(self._sessions.values()):
            session.closed_because = reason
            session.scope.cancel()
        for opening in list(self._waiting_openings):
            opening.cancel()

    # -- sessions --------------------------------------------------------------------------------

    async def serve_session(self, call: ServerCall) -> None:
        self._serving.parts()  # refused at once while the server does not serve
        with trio.move_on_after(self.limits.step_timeout_s) as waited:
            message = await call.receive()
        if waited.cancelled_caught:
            raise ServerError("no session request arrived in time")
        # Taken now, not before the wait: the server may have moved to other blocks meanwhile.
        backend, pool, cache = self._serving.parts()
        opening = self._opening(message, backend)
        with self._held_by(str(call.peer_id)), trio.CancelScope() as waiting:
            self._waiting_openings.add(waiting)
            self._opening_ids[opening.session_id] += 1
            try:
                await self._open(call, opening, backend, pool, cache, waiting)
            finally:
                self._waiting_openings.discard(waiting)
                self._opening_ids[opening.session_id] -= 1
                if not self._opening_ids[opening.session_id]:
                    del self._opening_ids[opening.session_id]
                self._registered.set()
                self._registered = trio.Event()
        if waiting.cancelled_caught:  # the server stopped serving these blocks (close_all)
            raise ServerError(self._serving.refusing or "the server stopped serving")

    async def _open(
        self,
        call: ServerCall,
        opening: OpenSession,
        backend: BlockBackend,
        pool: TaskPool,
        cache: MemoryCache,
        waiting: trio.CancelScope,
    ) -> None:
        """The session, once its opening is checked and counted against its peer's share;
        ``waiting`` is cancelled by :meth:`close_all` until the session is registered."""
        session_id, (start, end) = opening.session_id, opening.blocks
        batch, max_length = opening.batch_size, opening.max_length
        padding = None
        if opening.left_padding is not None:
            padding = torch.tensor(opening.left_padding, dtype=torch.int64)
        nbytes = backend.cache_bytes_per_token * batch * max_length * (end - start)
        async with cache.allocate(nbytes, timeout_s=opening.alloc_timeout):
            caches = await pool.run(
                lambda: backend.allocate_caches(start, end, batch, max_length, padding=padding),
                priority=Priority.INFERENCE,
            )
            # Checked again with no await before the session is registered: another opening
            # with the same id may have registered while we waited.
            if session_id in self._sessions:
                raise ServerError(f"session id {session_id!r} is already in use")
            session = _Session(
                opening=opening,
                caches=caches,
                scope=trio.CancelScope(),
                state=SessionState(batch=batch, max_length=max_length, push_key=opening.push_key),
            )
            inbox, steps = trio.open_memory_channel[_InboxItem](_INBOX_SIZE)
            session.inbox = inbox
            self._sessions[session_id] = session
            self._waiting_openings.discard(waiting)  # close_all ends it as a session now
            self._registered.set()
            self._registered = trio.Event()
            self._serving.changed()
            try:
                with session.scope:
                    session.scope.deadline = trio.current_time() + self.limits.session_timeout_s
                    await call.send(SessionReady(position=0).to_wire())
                    await self._run_session(
                        call,
                        session,
                        functools.partial(self._steps, call, session, steps, backend, pool),
                    )
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
                for feed in session.feeds:
                    feed.cancel()
                session.caches.clear()

    @contextlib.contextmanager
    def _held_by(self, peer: str) -> Iterator[None]:
        """Count a session against ``peer``'s ``max_sessions_per_peer`` from its opening on
        (while it waits for cache too) until it ends; :class:`ServerError` if the peer holds
        that many already."""
        held = self._held.get(peer, 0)
        if held >= self.limits.max_sessions_per_peer:
            raise ServerError(
                f"this peer already holds {self.limits.max_sessions_per_peer} sessions here "
                f"(open or opening)"
            )
        self._held[peer] = held + 1
        self._serving.changed()
        try:
            yield
        finally:
            self._held[peer] -= 1
            if not self._held[peer]:
                del self._held[peer]
            self._serving.changed()

    def _opening(self, message: dict[str, Any], backend: BlockBackend) -> OpenSession:
        """The opening, checked against what this server holds and allows."""
        opening = OpenSession.from_wire_untrusted(message)
        if opening.session_id in self._sessions:
            raise ServerError(f"session id {opening.session_id!r} is already in use")
        check_blocks_held(opening.blocks, backend)
        for name, value, limit, flag in (
            ("max_length", opening.max_length, self.limits.session_length, "inference_max_length"),
            ("batch_size", opening.batch_size, self.limits.max_batch_tokens, "max_batch_tokens"),
        ):
            if value > limit:
                raise SessionTooLarge(
                    f"{name} {value} is more than this server takes, {limit} (--{flag})"
                )
        backend.check_adapter(opening.active_adapter)
        return opening

    @staticmethod
    async def _run_session(
        call: ServerCall, session: _Session, run_steps: Callable[[], Awaitable[None]]
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
                await run_steps()
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
            message, pushed = item
            try:
                step = message if isinstance(message, Step) else Step.from_wire_untrusted(message)
                plan = session.state.plan(step, pushed=pushed)
                if plan is None:
                    self._serving.count("stale_pushes")
                    continue
                if plan.push:
                    # The push stream opens while the step computes.
                    self._start_dial(session, (plan.push[0].peer, plan.push[0].session_id))
                output = await self._step(plan, session, backend, pool)
            except (ValueError, CodecError) as exc:
                if pushed:
                    # Granted, so sent on by the server before this one, but not fitting: the
                    # client's next step finds the session as it was.
                    logger.info("dropped a pushed step that does not fit its session: %s", exc)
                    self._serving.count("refused_pushes")
                    continue
                self._serving.count("failures")
                raise ServerError(f"step refused: {exc}") from None
            pushed_on = None
            push = SessionState.push_step(plan, output)
            if push is not None:
                pushed_on = await self._push(session, plan.push[0], push)
            if pushed:
                self._serving.count("pushed_steps")
            result = session.state.completed(plan, output, pushed=pushed_on)
            signed = await self._serving.signed(
                "step",
                session.opening.blocks,
                session.opening.active_adapter,
                {"hidden_states": plan.hidden, "prompts": plan.prompts, "hypo_ids": plan.reorder},
                {"hidden_states": output},
                session=session.opening.session_id,
                padding=session.opening.left_padding,
                step=result.position,
                previous=session.chain,
                with_asked=True,
            )
            if signed is not None:
                receipt, signature = signed
                session.chain = receipt.digest()
                result = attrs.evolve(result, receipt=signature)
            await call.send(compress_floats(result.to_wire(), self.limits.compression))

    async def _step(
        self, plan: StepPlan, session: _Session, backend: BlockBackend, pool: TaskPool
    ) -> torch.Tensor:
        (start, end), adapter = session.opening.blocks, session.opening.active_adapter
        batch = session.opening.batch_size
        hidden = backend.check_hidden(plan.hidden)
        prompts = plan.prompts
        backend.check_prompts(prompts, start, end, hidden)
        # Checked: from here on the step runs (and rolls back what it wrote if it fails).
        for cache in session.caches:
            cache.rollback(plan.position)
        session.state.rolled_back(plan)
        self._serving.count("steps")
        tokens = plan.tokens
        if plan.reorder is not None:
            reorder = plan.reorder

            def reorder_all() -> None:
                for cache in session.caches:
                    cache.reorder(reorder)

            await pool.run(reorder_all, priority=Priority.INFERENCE)
        if tokens == 0:
            return hidden
        chunk = max(1, self.limits.max_batch_tokens // batch)
        if prompts is None and tokens <= chunk and self.limits.batch_steps:
            self._serving.count("batched_steps")
            key = ("step", start, end, adapter)

            def run_batch(
                items: list[tuple[torch.Tensor, list[KVCache]]],
            ) -> list[torch.Tensor]:
                return backend.inference_steps(start, end, items, adapter=adapter)

            return await pool.run_batched(
                key,
                (hidden, session.caches),
                run_batch,
                priority=Priority.INFERENCE,
                size=batch * tokens,
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
                        start,
                        end,
                        part,
                        session.caches,
                        prompts=part_prompts,
                        adapter=adapter,
                    ),
                    priority=Priority.INFERENCE,
                    cost_key=(
                        "chunk",
                        start,
                        end,
                        adapter,
                        part_prompts is not None,
                    ),
                    size=batch * part.shape[1],
                )
            )
        return torch.cat(outputs, dim=1)

    # -- pushes ----------------------------------------------------------------------------------

    async def _push(self, session: _Session, target: PushTarget, step: Step) -> bool:
        """Hand ``step`` to ``target``, the next server's session; whether it was sent."""
        key = (target.peer, target.session_id)
        self._start_dial(session, key)
        push_call = session.pushes.get(key)
        if isinstance(push_call, _Dialling):
            with trio.move_on_after(_DIAL_WAIT_S):
                await push_call.done.wait()
            push_call = session.pushes[key]
        if not isinstance(push_call, Call):
            return False  # being dialled, or it failed
        timeout = _push_timeout(step)
        with trio.move_on_after(timeout) as waited:
            try:
                await push_call.send(compress_floats(step.to_wire(), self.limits.compression))
                return True
            except TransportError as exc:
                logger.info("cannot push to %s: %r", target.peer, exc)
        if waited.cancelled_caught:
            logger.info("cannot push to %s: not sent in %.1f s", target.peer, timeout)
        # Part of the step may have been sent: the next server is not left waiting for the rest.
        push_call.reset()
        self._serving.count("push_failures")
        session.pushes[key] = _FAILED
        return False

    def _start_dial(self, session: _Session, key: tuple[str, str]) -> None:
        """Start opening the push stream to ``key`` unless it was tried already, or the session
        holds as many push streams, or has tried as many next sessions, as it may."""
        if key in session.pushes or len(session.pushes) >= _MAX_PUSH_TRIES:
            return
        if sum(push is not None for push in session.pushes.values()) >= _MAX_PUSH_TARGETS:
            return
        peer = key[0]
        if (
            self.connect_peer is None
            or session.nursery is None
            or trio.current_time() < self._unreachable.get(peer, -math.inf)
        ):
            session.pushes[key] = None
            return
        dialling = session.pushes[key] = _Dialling()
        session.nursery.start_soon(self._dial, session, key, self.connect_peer, dialling)

    async def _dial(
        self,
        session: _Session,
        key: tuple[str, str],
        connect_peer: Callable[[str], Awaitable[Connection]],
        dialling: _Dialling,
    ) -> None:
        """Open the push stream to ``key``'s session (in the session's nursery)."""
        try:
            await self._dial_once(session, key, connect_peer)
        finally:
            dialling.done.set()

    async def _dial_once(
        self,
        session: _Session,
        key: tuple[str, str],
        connect_peer: Callable[[str], Awaitable[Connection]],
    ) -> None:
        peer, session_id = key
        opened = None
        with trio.move_on_after(_DIAL_TIMEOUT_S):
            try:
                connection = await connect_peer(peer)
                opened = await session.exits.enter_async_context(open_call(connection, PUSH))
                await opened.send(OpenPush(session_id=session_id).to_wire())
            except TransportError as exc:
                logger.info("cannot push to %s: %r", peer, exc)
            else:
                self._unreachable.pop(peer, None)
                session.pushes[key] = opened
                self._serving.count("push_streams")
                return
        self._mark_unreachable(peer)
        self._serving.count("push_dial_failures")
        # A stream opened whose header could not be sent is held until the session ends.
        session.pushes[key] = None if opened is None else _FAILED

    def _mark_unreachable(self, peer: str) -> None:
        """Until proven otherwise (the dial succeeds); at most a few thousand remembered."""
        now = trio.current_time()
        if len(self._unreachable) >= _MAX_UNREACHABLE:
            for other in [p for p, until in self._unreachable.items() if until <= now]:
                del self._unreachable[other]
            while len(self._unreachable) >= _MAX_UNREACHABLE:
                del self._unreachable[next(iter(self._unreachable))]
        self._unreachable[peer] = now + _UNREACHABLE_S

    async def serve_push(self, call: ServerCall) -> None:
        """Another server's outputs, as steps of one of our sessions."""
        with trio.move_on_after(self.limits.step_timeout_s) as waited:
            header = await call.receive()
        if waited.cancelled_caught:
            raise ServerError("no push header arrived in time")
        try:
            session_id = OpenPush.from_wire_untrusted(header).session_id
        except CodecError as exc:
            raise ServerError(f"push refused: {exc}") from None
        # A client opens its sessions on all its servers at once and sends the first step
        # without waiting: the previous server's push may come before the session's opening
        # (waited for up to early_push_wait_s), or while it waits for cache (waited for as long
        # as it does).
        arrived = trio.current_time()
        while (session := self._sessions.get(session_id)) is None or session.inbox is None:
            deadline = arrived + self.limits.early_push_wait_s
            if session_id in self._opening_ids:
                deadline = math.inf
            elif trio.current_time() >= deadline:
                raise ServerError(f"unknown session {session_id!r}")
            with trio.move_on_at(deadline):
                await self._registered.wait()
        inbox = session.inbox
        with trio.CancelScope() as feed:
            # Ends (as the stream's clean end) when the session does.
            session.feeds.add(feed)
            try:
                await self._feed(call, inbox, session.state)
            finally:
                session.feeds.discard(feed)

    async def _feed(
        self, call: ServerCall, inbox: trio.MemorySendChannel[_InboxItem], state: SessionState
    ) -> None:
        """A push stream's steps into its session's inbox, until either ends."""
        while True:
            try:
                message = await call.receive()
            except CallEnded:
                return
            carried = [name for name in _NEVER_PUSHED if message.get(name) is not None]
            try:
                if carried:
                    # Left to the session, it would reorder or redo the client's rows.
                    raise ValueError(
                        f"a pushed step carries no {' and no '.join(carried)} (only a step "
                        "without them is pushed on)"
                    )
                step = Step.from_wire_untrusted(message)
                if not state.granted(step, pusher=str(call.peer_id)):
                    raise ValueError("its client did not grant this step")
            except (ValueError, CodecError) as exc:
                logger.info("refused a push from %s: %s", call.peer_id, exc)
                self._serving.count("refused_pushes")
                raise ServerError(f"push refused: {exc}") from None
            try:
                await inbox.send((step, True))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return  # the session ended


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
