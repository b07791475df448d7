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
prompts added to the step's first positions.  The session ends when the client ends its side;
the cache is freed then.  Any error ends the session with a message naming the cause: the
server checks a step fully before touching the cache, so nothing of another session, nor of
this one before the failed step, is changed.

Scheduling: single-step work of different sessions over the same blocks and adapter is batched
(:meth:`BlockBackend.inference_steps`); steps longer than ``max_batch_tokens`` tokens are
processed in chunks, each a separate job, so that a long prefill never holds up other sessions.

**Forward / backward** (``petals.forward`` / ``petals.backward``): tensors sent in parts (see
``_protocol``): meta ``{"blocks", "active_adapter", "points"}`` with ``hidden_states`` (and
``grad_outputs`` for backward, ``prompts`` optionally), below inference steps in priority.  A
forward runs each block as its own job.  A backward recomputes its span's forward with autograd,
in groups of blocks whose graphs fit ``backward_activation_bytes`` (one group: no extra forward),
then returns ``grad_inputs`` (and ``grad_prompts``).

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
from collections.abc import Iterator
from typing import Any, Final

import attrs
import torch
import trio

from .._errors import AdapterError, CallEnded, CodecError, ServerError
from ..models import KVCache
from ..transport import Handlers, ServerCall
from ._backend import BlockBackend, Graph
from ._memory_cache import MemoryCache
from ._protocol import BACKWARD, FORWARD, INFERENCE, INFO, receive_tensors, send_tensors
from ._task_pool import Priority, TaskPool

__all__ = ["BlockServer", "ServingLimits"]

logger = logging.getLogger(__name__)

_MAX_SESSION_ID_CHARS: Final = 128
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
    inline_compute_s: float = attrs.field(default=0.005, validator=_non_negative)


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
        peer: str,
        start: int,
        end: int,
        adapter: str | None,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
    ) -> bool:
        if (self.peer, self.start, self.end, self.adapter) != (peer, start, end, adapter):
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

    @property
    def position(self) -> int:
        return self.caches[0].length


@attrs.frozen(kw_only=True)
class BlockServerStatistics:
    sessions: int
    steps: int
    batched_steps: int
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

    def __init__(self, limits: ServingLimits, *, version: str) -> None:
        self.limits = limits
        self.version = version
        self._backend: BlockBackend | None = None
        self._pool: TaskPool | None = None
        self._cache: MemoryCache | None = None
        self._sessions: dict[str, _Session] = {}
        self._refusing: str | None = "the server is still loading its blocks"
        self._counts = dict.fromkeys(
            ["steps", "batched_steps", "forwards", "backwards", "kept_backwards", "failures"], 0
        )
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
            self._sessions[session_id] = session
            try:
                with session.scope:
                    session.scope.deadline = trio.current_time() + self.limits.session_timeout_s
                    await call.send({"ready": True, "position": 0})
                    await self._steps(call, session, backend, pool)
                    return
                if session.closed_because is not None:
                    raise ServerError(session.closed_because)
                raise ServerError(
                    f"the session exceeded this server's session timeout "
                    f"({self.limits.session_timeout_s} s)"
                )
            finally:
                del self._sessions[session_id]
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

    async def _steps(
        self, call: ServerCall, session: _Session, backend: BlockBackend, pool: TaskPool
    ) -> None:
        while True:
            with trio.move_on_after(self.limits.step_timeout_s) as waited:
                try:
                    step = await call.receive()
                except CallEnded:
                    return
            if waited.cancelled_caught:
                raise ServerError(
                    f"no step arrived within this server's step timeout "
                    f"({self.limits.step_timeout_s} s): the session is closed"
                )
            try:
                output = await self._step(step, session, backend, pool)
            except (ValueError, CodecError) as exc:
                self._counts["failures"] += 1
                raise ServerError(f"step refused: {exc}") from None
            await call.send({"hidden_states": output, "position": session.position})

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
        self._counts["steps"] += 1
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
            self._counts["batched_steps"] += 1
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
            self._counts["forwards"] += 1
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
            token = meta.get("kept")
            token = token if isinstance(token, str) else ""
            kept = self._kept.get(token)
            if kept is not None and kept.peer == str(call.peer_id):
                self._forget(token)  # a graph serves one backward (its own or none)
            else:
                kept = None  # unknown, or another peer's: not this caller's to spend
            if kept is not None and kept.matches(
                str(call.peer_id), start, end, adapter, hidden, prompts
            ):
                grad_inputs, grad_prompts = await pool.run(
                    functools.partial(backend.backward_from_graph, kept.graph, grad_outputs),
                    priority=Priority.BACKWARD,
                    points=points,
                )
                self._counts["backwards"] += 1
                self._counts["kept_backwards"] += 1
                await send_tensors(
                    call.send,
                    {},
                    {
                        "grad_inputs": grad_inputs.to(hidden.dtype),
                        "grad_prompts": None
                        if grad_prompts is None or prompts is None
                        else grad_prompts.to(prompts.dtype),
                    },
                )
                return
            groups = self._backward_groups(backend, start, end, hidden)
            # Each group's input: the request's for the first, a forward (no graph) for the others.
            group_inputs = [hidden]
            if len(groups) > 1:
                outputs = await self._run_forward(
                    backend, pool, start, groups[-1][0], hidden, prompts, adapter, points
                )
                group_inputs += [outputs[group_start - start - 1] for group_start, _ in groups[1:]]
            grad: torch.Tensor = grad_outputs
            prompt_grads: list[torch.Tensor | None] = []
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
                prompt_grads.append(prompt_grad)
            self._counts["backwards"] += 1
            grad_prompts = None
            if prompts is not None:
                grad_prompts = torch.cat([g for g in reversed(prompt_grads) if g is not None]).to(
                    prompts.dtype
                )
            await send_tensors(
                call.send,
                {},
                {"grad_inputs": grad.to(hidden.dtype), "grad_prompts": grad_prompts},
            )

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
            self._counts["failures"] += 1
            raise
        except (ValueError, CodecError) as exc:
            self._counts["failures"] += 1
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
