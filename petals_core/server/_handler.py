"""The server's RPCs over the blocks it holds: :class:`BlockServer` wires the families of
block RPCs to the transport and answers ``petals.info`` itself.

- ``_inference``: inference sessions (``petals.inference``) and server-to-server pushes
  (``petals.push``);
- ``_training``: forward and backward passes (``petals.forward`` / ``petals.backward``), with
  forward graphs kept for a coming backward;
- ``_serving``: what they share (the backend, task pool and cache while the server serves, the
  counters).

The messages are :mod:`petals_core.protocol`'s.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from .._validators import (
    compression_scheme,
    non_negative as _non_negative,
    positive as _positive,
)
from ..protocol import (
    BACKWARD,
    FORWARD,
    INFERENCE,
    INFO,
    PUSH,
    TENSOR_DTYPES,
    InfoReply,
    InfoRequest,
)
from ..transport import Connection, Handlers, Identity, ServerCall
from ._backend import BlockBackend
from ._inference import InferenceHandlers
from ._memory_cache import MemoryCache
from ._serving import Serving
from ._task_pool import TaskPool
from ._training import TrainingHandlers

__all__ = ["BlockServer", "BlockServerStatistics", "ServingLimits"]


@attrs.frozen(kw_only=True)
class ServingLimits:
    """What one request may ask of the server."""

    #: Longest session (positions), the ``--inference_max_length`` flag; None: the model's
    #: default, which a server resolves when it starts (8192 with grouped-query attention, 2048
    #: without, as Petals): see :attr:`session_length`.
    inference_max_length: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    #: Tokens (rows x positions) one inference job processes at most, a batch of steps
    #: included: longer steps go in chunks; and one forward job of one block (one row at
    #: least): more rows go in further jobs.  The ``--max_batch_size`` flag.
    max_batch_tokens: int = attrs.field(default=2048, validator=_positive)
    #: Cap of a session's wait for cache (``--max_alloc_timeout``).
    max_alloc_timeout_s: float = attrs.field(default=600.0, validator=_positive)
    #: Longest life of a session (``--session_timeout``).
    session_timeout_s: float = attrs.field(default=1800.0, validator=_positive)
    #: Longest wait for a session's next step (``--step_timeout``).
    step_timeout_s: float = attrs.field(default=300.0, validator=_positive)
    #: How long a push may wait for the opening of the session it names to arrive: a client
    #: sends its sessions' openings and its first step at once, so a push can come first.  An
    #: opening that arrived and waits for cache is waited for as long as it waits.
    early_push_wait_s: float = attrs.field(default=10.0, validator=_positive)
    #: Longest forward / backward call (``--request_timeout``).
    request_timeout_s: float = attrs.field(default=180.0, validator=_positive)
    #: Elements a forward / backward request may carry in all.
    max_request_elements: int = attrs.field(default=1 << 28, validator=_positive)
    #: Forward / backward calls of one peer read and computed at once; more wait their turn
    #: before their tensors are read.
    max_requests_per_peer: int = attrs.field(default=4, validator=_positive)
    #: Sessions one peer may hold at once, open or opening (waiting for cache).
    max_sessions_per_peer: int = attrs.field(default=64, validator=_positive)
    #: Run concurrent sessions' steps over the same blocks as one batch (off: one by one, for
    #: comparison in benchmarks).
    batch_steps: bool = True
    #: Autograd graph (estimated bytes) one backward job may hold: a backward recomputes that
    #: many blocks and rows at once with their activations kept (one block of one row at
    #: least), the rest in further groups.
    backward_activation_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    #: Forward graphs kept for a coming backward, in estimated bytes in all (0: none kept).
    kept_forward_bytes: int = attrs.field(default=1 << 30, validator=_non_negative)
    #: How long a kept forward graph waits for its backward.
    kept_forward_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    #: Inference jobs expected to compute in less than this many seconds run on the event loop's
    #: thread, without the hand-off to a worker thread (``--inline_compute_ms``; 0: never).
    inline_compute_s: float = attrs.field(default=0.025, validator=_non_negative)
    #: How the server's outputs travel (``--compression``): None (as they are), ``"float16"``
    #: or ``"blockwise8"``.
    compression: str | None = attrs.field(default=None, converter=compression_scheme)

    @property
    def session_length(self) -> int:
        """``inference_max_length``, resolved (a server does it when it starts)."""
        if self.inference_max_length is None:
            raise ValueError("inference_max_length is the model's default: resolve it first")
        return self.inference_max_length


@attrs.frozen(kw_only=True)
class BlockServerStatistics:
    sessions: int
    #: Session openings under way (waiting for cache, or allocating it).
    openings: int
    steps: int
    batched_steps: int
    #: Steps that came from the previous server (server-to-server), stale ones dropped, and
    #: push streams refused for a step carrying what a push never does (prompts, hypo_ids).
    pushed_steps: int
    stale_pushes: int
    refused_pushes: int
    #: Push streams this server opened to the next servers' sessions, dials that failed, and
    #: pushes not sent in time or whose stream failed (their sessions push no more there).
    push_streams: int
    push_dial_failures: int
    push_failures: int
    forwards: int
    backwards: int
    #: Forward / backward calls waiting for their turn, and holding one (see
    #: ``ServingLimits.max_requests_per_peer``).
    requests_waiting: int
    requests_running: int
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
        self._serving = Serving(limits)
        self._inference = InferenceHandlers(self._serving)
        self._training = TrainingHandlers(self._serving)
        self.connect_peer = connect_peer

    @property
    def connect_peer(self) -> Callable[[str], Awaitable[Connection]] | None:
        """Dials another server by its PeerID (at the address the peer table gives); pushes to
        the next server need it."""
        return self._inference.connect_peer

    @connect_peer.setter
    def connect_peer(self, connect_peer: Callable[[str], Awaitable[Connection]] | None) -> None:
        self._inference.connect_peer = connect_peer

    # -- life cycle ------------------------------------------------------------------------------

    def sign_as(self, identity: Identity, model: str, *, torch_dtype: str, quant_type: str) -> None:
        """Sign every answer's receipt with ``identity``, naming ``model`` (its DHT prefix) and
        the dtype and quantisation the blocks compute in (as the server announces them)."""
        self._serving.sign_as(identity, model, torch_dtype=torch_dtype, quant_type=quant_type)

    def attach(self, backend: BlockBackend, pool: TaskPool, cache: MemoryCache) -> None:
        self._serving.attach(backend, pool, cache)

    def detach(self, reason: str) -> None:
        """Refuse new calls with ``reason`` and end the open sessions with it."""
        self._serving.detach(reason)
        self._inference.close_all(reason)
        self._training.clear()

    @property
    def cache_tokens_left(self) -> int:
        """Free cache, in positions of one row of one block (a session takes batch x
        max_length x blocks)."""
        cache, backend = self._serving.cache, self._serving.backend
        if cache is None or backend is None:
            return 0
        return cache.bytes_left // backend.cache_bytes_per_token

    @property
    def open_sessions(self) -> int:
        return self._inference.open_sessions

    async def wait_statistics(
        self, predicate: Callable[[BlockServerStatistics], bool]
    ) -> BlockServerStatistics:
        """Wait until the statistics satisfy ``predicate`` (checked whenever a count, or the
        sessions open or opening, change); returns them.  Bound it with a trio deadline."""
        while True:
            statistics = self.statistics()
            if predicate(statistics):
                return statistics
            await self._serving.wait_changed()

    def statistics(self) -> BlockServerStatistics:
        kept_forwards, kept_forward_bytes = self._training.kept_statistics()
        return BlockServerStatistics(
            sessions=self._inference.open_sessions,
            openings=self._inference.openings,
            requests_waiting=self._training.waiting,
            requests_running=self._training.running,
            kept_forwards=kept_forwards,
            kept_forward_bytes=kept_forward_bytes,
            **self._serving.counts,
        )

    # -- handlers --------------------------------------------------------------------------------

    def handlers(self) -> Handlers:
        handlers = Handlers()
        handlers.add_unary(INFO, self._info)
        handlers.add_stream(INFERENCE, self._inference.serve_session)
        handlers.add_stream(PUSH, self._inference.serve_push)
        handlers.add_stream(FORWARD, self._training.forward)
        handlers.add_stream(BACKWARD, self._training.backward)
        return handlers

    async def _info(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        InfoRequest.from_wire_untrusted(request)
        backend, _, _ = self._serving.parts()
        return InfoReply(
            version=self.version,
            start_block=backend.start,
            end_block=backend.end,
            hidden_size=backend.hidden_size,
            torch_dtype=str(backend.dtype).removeprefix("torch."),
            accepted_dtypes=tuple(str(d).removeprefix("torch.") for d in TENSOR_DTYPES),
            adapters=tuple(sorted(backend.adapters)),
            cache_tokens_left=self.cache_tokens_left,
            inference_max_length=self.limits.session_length,
            max_batch_tokens=self.limits.max_batch_tokens,
            open_sessions=self._inference.open_sessions,
            device=str(backend.device),
            device_memory_reserved_bytes=backend.device_memory_reserved_bytes(),
            decode_graphs=backend.decode_graphs_info(),
        ).to_wire()
