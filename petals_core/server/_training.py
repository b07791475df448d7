"""Fine-tuning passes: ``petals.forward`` and ``petals.backward``, and the forward graphs kept
for a coming backward.

The messages are :mod:`petals_core.protocol`'s; both passes rank below inference steps.  A
forward runs each block as its own job, over at most ``max_batch_tokens`` tokens (rows x
positions, one row at least: rows are independent) as an inference step does, more rows in
further jobs (but a forward that keeps its graph for a backward runs whole, within
``backward_activation_bytes``).  A backward recomputes its span's forward with autograd, over
as many rows at once as one block's graph fits ``backward_activation_bytes`` (one row at
least), and in groups of blocks whose graphs fit it (one group: no extra forward), then returns
the gradients of its input (and of its prompts).

A forward asked to keep its graph for a backward may instead run with autograd and keep it
(estimated bytes within ``backward_activation_bytes`` and, with the other kept graphs,
``kept_forward_bytes``; the oldest are dropped to make room, and any after
``kept_forward_timeout_s``); its reply then holds the graph's token.  A backward from the same
peer naming that token, with the same blocks, adapter, hidden states and prompts, takes the
gradients from the kept graph without recomputing; anything else (an unknown, used or expired
token, other inputs) is recomputed as usual.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
import torch
import trio

from .._errors import AdapterError, CodecError, ServerError
from ..protocol import (
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    receive_tensors,
    send_tensors,
)
from ..transport import ServerCall, compress_floats
from ._backend import BlockBackend, Graph
from ._serving import Serving, check_blocks_held
from ._task_pool import Priority, TaskPool

__all__ = ["TrainingHandlers"]

_Request = TypeVar("_Request", ForwardRequest, BackwardRequest)


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


class TrainingHandlers:
    """The ``petals.forward`` and ``petals.backward`` handlers, and the kept forward graphs."""

    def __init__(self, serving: Serving) -> None:
        self._serving = serving
        self.limits = serving.limits
        self._encode_part = functools.partial(compress_floats, scheme=self.limits.compression)
        #: Token -> kept forward graph, oldest first.
        self._kept: dict[str, _Kept] = {}
        self._kept_bytes = 0
        #: Each peer's turns to read and compute a call (see :meth:`_turn`), dropped once
        #: nobody holds or waits for one.
        self._peer_turns: dict[str, trio.CapacityLimiter] = {}
        #: Calls waiting for their turn now, and holding one.
        self.waiting = self.running = 0

    def kept_statistics(self) -> tuple[int, int]:
        """The forward graphs kept now, and their estimated bytes."""
        self._drop_expired()
        return len(self._kept), self._kept_bytes

    def clear(self) -> None:
        """Drop every kept graph."""
        self._kept.clear()
        self._kept_bytes = 0

    # -- forward ---------------------------------------------------------------------------------

    async def forward(self, call: ServerCall) -> None:
        await self._in_turn(call, self._forward)

    async def _forward(self, call: ServerCall) -> None:
        request, backend, pool = await self._receive(call, ForwardRequest.from_wire_untrusted)
        (start, end), hidden, prompts = request.blocks, request.hidden_states, request.prompts
        adapter = request.active_adapter
        nbytes = backend.activation_bytes(hidden.shape[0], hidden.shape[1]) * (end - start)
        token = None
        if request.keep_for_backward and nbytes <= min(
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
            )
            # Not kept once the server left these blocks (a move): the graph holds them.
            if self._serving.backend is backend:
                token = self._keep(
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
            output = (await self._run_forward(backend, pool, start, end, hidden, prompts, adapter))[
                -1
            ]
        self._serving.count("forwards")
        output = output.to(hidden.dtype)
        signed = await self._serving.signed(
            "forward",
            (start, end),
            adapter,
            request.to_wire()[1],
            {"hidden_states": output},
        )
        reply = ForwardReply(hidden_states=output, kept=token, receipt=signed and signed[1])
        await send_tensors(call.send, *reply.to_wire(), encode_part=self._encode_part)

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

    # -- backward --------------------------------------------------------------------------------

    async def backward(self, call: ServerCall) -> None:
        await self._in_turn(call, self._backward)

    async def _backward(self, call: ServerCall) -> None:
        request, backend, pool = await self._receive(call, BackwardRequest.from_wire_untrusted)
        start, end = request.blocks
        hidden, prompts = request.hidden_states, request.prompts
        kept = self._take_kept(request.kept, str(call.peer_id))
        if kept is not None and kept.matches(start, end, request.active_adapter, hidden, prompts):
            grad, grad_prompts = await pool.run(
                functools.partial(backend.backward_from_graph, kept.graph, request.grad_outputs),
                priority=Priority.BACKWARD,
            )
            self._serving.count("kept_backwards")
        else:
            grad, grad_prompts = await self._recompute_backward(backend, pool, request, start, end)
        self._serving.count("backwards")
        reply = BackwardReply(
            grad_inputs=grad.to(hidden.dtype),
            grad_prompts=None
            if grad_prompts is None or prompts is None
            else grad_prompts.to(prompts.dtype),
        )
        signed = await self._serving.signed(
            "backward",
            (start, end),
            request.active_adapter,
            request.to_wire()[1],
            reply.tensors(),
        )
        reply = attrs.evolve(reply, receipt=signed and signed[1])
        await send_tensors(call.send, *reply.to_wire(), encode_part=self._encode_part)

    def _take_kept(self, token: str | None, peer: str) -> _Kept | None:
        """The graph ``token`` names, if ``peer`` kept it; it serves one backward (or none)."""
        if token is None:
            return None
        kept = self._kept.get(token)
        if kept is None or kept.peer != peer:
            return None  # unknown, or another peer's: not this caller's to spend
        self._forget(token)
        return kept

    async def _recompute_backward(
        self,
        backend: BlockBackend,
        pool: TaskPool,
        request: BackwardRequest,
        start: int,
        end: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the input (and prompts) of blocks ``[start, end)``, over as many rows
        at once as one block's graph fits the backward memory budget (one row at least)."""
        hidden, prompts, grad = request.hidden_states, request.prompts, request.grad_outputs
        per_row = max(1, backend.activation_bytes(1, hidden.shape[1]))
        rows = _row_slices(hidden.shape[0], self.limits.backward_activation_bytes // per_row)
        shared = prompts is not None and prompts.shape[1] == 1
        grads, prompt_grads = [], []
        for part in rows:
            part_prompts = prompts if prompts is None or shared else prompts[:, part]
            part_grad, prompt_grad = await self._rows_backward(
                backend,
                pool,
                request.active_adapter,
                (start, end),
                hidden[part],
                grad[part],
                part_prompts,
            )
            grads.append(part_grad)
            if prompt_grad is not None:
                prompt_grads.append(prompt_grad)
        grad = grads[0] if len(grads) == 1 else torch.cat(grads)
        if len(prompt_grads) <= 1:
            return grad, prompt_grads[0] if prompt_grads else None
        # A prompt shared by every row gets the sum of their gradients; a row's own, its rows'.
        if shared:
            total = torch.stack(prompt_grads).sum(0, dtype=torch.float32)
            return grad, total.to(prompt_grads[0].dtype)
        return grad, torch.cat(prompt_grads, 1)

    async def _rows_backward(
        self,
        backend: BlockBackend,
        pool: TaskPool,
        adapter: str | None,
        blocks: tuple[int, int],
        hidden: torch.Tensor,
        grad: torch.Tensor,
        prompts: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gradients of the input (and prompts) of these rows, each group of blocks recomputed
        with its graph."""
        start, end = blocks
        groups = self._backward_groups(backend, start, end, hidden)
        # Each group's input: the request's for the first, a forward (no graph) for the others.
        group_inputs = [hidden]
        if len(groups) > 1:
            outputs = await self._run_forward(
                backend, pool, start, groups[-1][0], hidden, prompts, adapter
            )
            group_inputs += [outputs[group_start - start - 1] for group_start, _ in groups[1:]]
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

    # -- both ------------------------------------------------------------------------------------

    async def _in_turn(
        self, call: ServerCall, handle: Callable[[ServerCall], Awaitable[None]]
    ) -> None:
        """``handle(call)`` in the call's turn (:meth:`_turn`), within the request timeout;
        refused while the server does not serve."""
        self._serving.parts()  # refused at once while the server does not serve
        with self._request_deadline():
            async with self._turn(call):
                self._serving.parts()  # (it may have moved to other blocks meanwhile)
                await handle(call)

    @contextlib.asynccontextmanager
    async def _turn(self, call: ServerCall) -> AsyncIterator[None]:
        """Wait for a turn: at most ``max_requests_per_peer`` calls of one peer are read and
        computed at once; the others wait before their tensors are read (their bytes held back
        on their streams, so that the calls under way go on), which bounds what one peer's
        requests hold in memory, not just each one.  (No bound across peers: slow senders
        under free identities could then shut every peer out.)"""
        peer = str(call.peer_id)
        turns = self._peer_turns.get(peer)
        if turns is None:
            turns = self._peer_turns[peer] = trio.CapacityLimiter(self.limits.max_requests_per_peer)
        self._count(waiting=1)
        waiting = True
        try:
            with call.held_back():
                await turns.acquire()
            try:
                waiting = False
                self._count(waiting=-1, running=1)
                try:
                    yield
                finally:
                    self._count(running=-1)
            finally:
                turns.release()
        finally:
            if waiting:
                self._count(waiting=-1)
            unused = not turns.borrowed_tokens and not turns.statistics().tasks_waiting
            if unused and self._peer_turns.get(peer) is turns:
                del self._peer_turns[peer]

    def _count(self, *, waiting: int = 0, running: int = 0) -> None:
        self.waiting += waiting
        self.running += running
        self._serving.changed()

    @contextlib.contextmanager
    def _request_deadline(self) -> Iterator[None]:
        with trio.move_on_after(self.limits.request_timeout_s) as scope:
            yield
        if scope.cancelled_caught:
            raise ServerError(
                f"the request exceeded this server's request timeout "
                f"({self.limits.request_timeout_s} s)"
            )

    async def _receive(
        self,
        call: ServerCall,
        parse: Callable[[Mapping[str, Any], Mapping[str, Any]], _Request],
    ) -> tuple[_Request, BlockBackend, TaskPool]:
        """The call's request, checked against what this server holds and allows, and what it
        is computed with (taken once it arrived: the server may have moved to other blocks
        meanwhile)."""
        meta, tensors = await receive_tensors(
            call.receive, max_elements=self.limits.max_request_elements
        )
        backend, pool, _ = self._serving.parts()
        try:
            request = parse(meta, tensors)
            start, end = check_blocks_held(request.blocks, backend)
            backend.check_adapter(request.active_adapter)
            hidden = backend.check_hidden(request.hidden_states)
            if hidden.shape[1] > self.limits.session_length:
                raise ValueError(
                    f"{hidden.shape[1]} tokens exceed this server's longest sequence, "
                    f"{self.limits.session_length} (--inference_max_length)"
                )
            backend.check_prompts(request.prompts, start, end, hidden)
        except AdapterError:
            self._serving.count("failures")
            raise
        except (ValueError, CodecError) as exc:
            self._serving.count("failures")
            raise ServerError(f"request refused: {exc}") from None
        return request, backend, pool

    async def _run_forward(
        self,
        backend: BlockBackend,
        pool: TaskPool,
        start: int,
        end: int,
        hidden: torch.Tensor,
        prompts: torch.Tensor | None,
        adapter: str | None,
    ) -> list[torch.Tensor]:
        """Every block's output, each block a job of its own for each slice of rows of at most
        ``max_batch_tokens`` tokens."""
        rows = _row_slices(hidden.shape[0], self.limits.max_batch_tokens // max(1, hidden.shape[1]))
        outputs = []
        x = hidden
        for index in range(start, end):
            prompt = None if prompts is None else prompts[index - start]
            parts = []
            for part in rows:
                part_prompt = prompt if prompt is None or prompt.shape[0] == 1 else prompt[part]
                parts.append(
                    await pool.run(
                        functools.partial(
                            backend.forward_block,
                            index,
                            x[part],
                            prompt=part_prompt,
                            adapter=adapter,
                        ),
                        priority=Priority.FORWARD,
                    )
                )
            x = parts[0] if len(parts) == 1 else torch.cat(parts)
            outputs.append(x)
        return outputs


def _row_slices(batch: int, rows: int) -> list[slice]:
    """Rows ``0 .. batch - 1`` in slices of ``rows`` (at least one)."""
    rows = max(1, rows)
    return [slice(first, min(first + rows, batch)) for first in range(0, batch, rows)]
