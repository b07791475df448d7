"""``RemoteSequential``: remote blocks as a PyTorch module, with autograd and inference sessions.

Sync face (PyTorch, HF ``generate()``): calls go through the client bridge; the sequence
manager's network part starts on first use, in the bridge's thread.  Trio face: ``async with
sequential:`` runs the network part in the caller's nursery, and the ``*_async`` methods (and
:meth:`open_inference_session`) are awaited directly; sync calls made from that program's worker
threads then use its loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
import trio
from torch import nn

from ._bridge import bridge
from ._inference import InferenceSession
from ._placement import like, to_wire
from ._report_judge import run_manager
from ._sequence_manager import RemoteSequenceManager
from ._sequential import DEFAULT_MAX_CHUNK_TOKENS, Saved, remote_backward, remote_forward

__all__ = ["RemoteSequential", "SyncInferenceSession"]


class RemoteSequential(nn.Module):
    """The blocks of ``manager`` as one module: ``(B, T, hidden) -> (B, T, hidden)``."""

    def __init__(
        self, manager: RemoteSequenceManager, *, max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS
    ) -> None:
        super().__init__()
        self.sequence_manager = manager
        self.max_chunk_tokens = max_chunk_tokens
        self._exit: contextlib.AsyncExitStack | None = None

    # -- structure -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.sequence_manager)

    def __getitem__(self, index: int | slice) -> RemoteSequential:
        return RemoteSequential(
            self.sequence_manager[index], max_chunk_tokens=self.max_chunk_tokens
        )

    def __iter__(self) -> Iterator[RemoteSequential]:
        for i in range(len(self)):
            yield self[i]

    def extra_repr(self) -> str:
        blocks = self.sequence_manager.block_indices
        return f"{self.sequence_manager.config.dht_prefix}[{blocks.start}:{blocks.stop}]"

    # -- the network part ------------------------------------------------------------------------

    async def __aenter__(self) -> RemoteSequential:
        """Run the network part in this trio program (until ``__aexit__``)."""
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(run_manager, self.sequence_manager)
        stack.callback(self.sequence_manager.close)
        self._exit = stack
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        stack, self._exit = self._exit, None
        if stack is not None:
            await stack.aclose()

    def _token(self) -> trio.lowlevel.TrioToken:
        """The loop of the network part, starting it in the bridge on first use."""
        state = self.sequence_manager.state
        if state.loop_token is None:
            bridge.run(self._start_in_bridge)
        assert state.loop_token is not None
        return state.loop_token

    async def _start_in_bridge(self) -> None:
        state = self.sequence_manager.state
        if state.loop_token is not None:
            return
        if state.started is not None:  # starting meanwhile
            await state.started.wait()
            if state.loop_token is not None:
                return
            raise RuntimeError("the sequence manager failed to start") from state.start_error
        await bridge.service_nursery().start(run_manager, self.sequence_manager)

    def shutdown(self) -> None:
        """Stop the network part started by the bridge (it stops with the process otherwise)."""
        if self.sequence_manager.state.loop_token is not None and self._exit is None:
            bridge.run(self._stop, token=self.sequence_manager.state.loop_token)

    async def _stop(self) -> None:
        self.sequence_manager.close()

    # -- forward / backward ----------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, prompts: torch.Tensor | None = None) -> torch.Tensor:
        """Remote forward with autograd (backward goes through the servers).

        The output is on the device and in the dtype of ``hidden``; the backward gives the
        gradients of ``hidden`` and ``prompts`` on their devices, in their dtypes."""
        if prompts is None:
            prompts = hidden.new_zeros(0)
        return _RemoteForward.apply(hidden, prompts, self)

    async def forward_async(
        self, hidden: torch.Tensor, prompts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The forward without autograd, awaited in a trio program."""
        output, _ = await remote_forward(
            self.sequence_manager, hidden, prompts, max_chunk_tokens=self.max_chunk_tokens
        )
        return output

    # -- inference -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def open_inference_session(
        self, max_length: int, **kwargs: Any
    ) -> AsyncIterator[InferenceSession]:
        async with InferenceSession(self.sequence_manager, max_length, **kwargs) as session:
            yield session

    def inference_session(self, max_length: int, **kwargs: Any) -> SyncInferenceSession:
        """A session for sync code: ``with seq.inference_session(max_length=64) as s:``."""
        return SyncInferenceSession(
            self, InferenceSession(self.sequence_manager, max_length, **kwargs)
        )


class SyncInferenceSession:
    """An :class:`InferenceSession` driven from synchronous code through the bridge."""

    def __init__(self, owner: RemoteSequential, session: InferenceSession) -> None:
        self._owner = owner
        self.session = session

    def __enter__(self) -> SyncInferenceSession:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    @property
    def position(self) -> int:
        return self.session.position

    @position.setter
    def position(self, value: int) -> None:
        self.session.position = value

    @property
    def max_length(self) -> int:
        return self.session.max_length

    def step(
        self,
        hidden: torch.Tensor,
        *,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """See :meth:`InferenceSession.step`; the output is on the device and in the dtype of
        ``hidden``."""
        # Copies to and from the caller's device are made here, in the caller's thread (on its
        # current stream), not in the thread that runs the network part.
        sent = to_wire(hidden, "hidden states")
        if prompts is not None:
            prompts = to_wire(prompts, "deep prompts")
        token = self._owner._token()

        async def run() -> torch.Tensor:
            return await self.session.step(
                sent, prompts=prompts, hypo_ids=hypo_ids, padding=padding
            )

        return like(bridge.run(run, token=token), hidden)

    def close(self) -> None:
        token = self._owner.sequence_manager.state.loop_token
        if token is not None:
            bridge.run(self.session.close, token=token)


class _RemoteForward(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, prompts: torch.Tensor, sequential: RemoteSequential
    ) -> torch.Tensor:
        # Copies to and from the caller's device are made in the caller's thread (see
        # SyncInferenceSession.step); what the backward needs is kept on the CPU, as sent.
        sent = to_wire(hidden, "hidden states")
        given = to_wire(prompts, "deep prompts") if prompts.numel() else None
        token = sequential._token()
        # A backward will follow: the servers may keep their graphs for it.
        wants_grad = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])

        async def run() -> tuple[torch.Tensor, list[Saved]]:
            return await remote_forward(
                sequential.sequence_manager,
                sent,
                given,
                max_chunk_tokens=sequential.max_chunk_tokens,
                keep_for_backward=wants_grad,
            )

        output, saved = bridge.run(run, token=token)
        ctx.sequential = sequential
        ctx.saved = saved
        ctx.prompts = given
        # Where the gradients go: the devices and dtypes of the inputs.
        ctx.hidden_home = (hidden.device, hidden.dtype)
        ctx.prompts_home = (prompts.device, prompts.dtype)
        ctx.prompts_shape = prompts.shape
        return like(output, hidden)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        sequential: RemoteSequential = ctx.sequential
        sent = to_wire(grad_output, "grad_output")

        async def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            return await remote_backward(
                sequential.sequence_manager,
                sent,
                ctx.saved,
                ctx.prompts,
                max_chunk_tokens=sequential.max_chunk_tokens,
            )

        grad_input, grad_prompts = bridge.run(run, token=sequential._token())
        prompts_device, prompts_dtype = ctx.prompts_home
        if grad_prompts is None:
            grad_prompts = torch.zeros(
                ctx.prompts_shape, device=prompts_device, dtype=prompts_dtype
            )
        return grad_input.to(*ctx.hidden_home), grad_prompts.to(*ctx.prompts_home), None
