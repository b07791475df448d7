"""The fuzzing harness: runs in the server's trio loop, runs each example and checks the server
afterwards (its cache, its log and the canary session)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, Protocol

import torch
import trio

from petals_core import RemoteError
from petals_core.protocol import INFERENCE
from petals_core.server import Server
from petals_core.transport import (
    Connection,
)

from ._wire import BLOCKS, CANARY_ID, HIDDEN, FuzzFailure, RawCall, refusal

#: Generous for a slow shared machine; only turns a hang into a failure.
EXAMPLE_TIMEOUT_S: Final = 30.0


class Harness:
    """The server, the client connection and the canary session; checks after each example."""

    def __init__(self, server: Server, connection: Connection) -> None:
        self.server = server
        self.connection = connection
        self.stop = trio.Event()
        self.errors_logged: list[logging.LogRecord] = []
        self._canary: RawCall | None = None
        self._calls: list[RawCall] = []
        self._canary_broken = False
        #: How often the canary was reopened (it timed out on a slow machine, or an example
        #: failed during its step).
        self.canary_reopened = 0
        self._canary_step = {
            "hidden_states": torch.randn(1, 2, HIDDEN, generator=torch.Generator().manual_seed(7)),
            "start_from_position": 4,
        }
        self._canary_expected: torch.Tensor | None = None
        self.baseline_tokens = 0

    async def open_canary(self) -> None:
        """Open the canary (no other session may be open) and take its reference output."""
        call = await RawCall.open(self.connection, INFERENCE)
        await call.send(
            {"session_id": CANARY_ID, "blocks": list(BLOCKS), "max_length": 16, "batch_size": 1}
        )
        if await call.receive() != {"ready": True, "position": 0}:
            raise FuzzFailure("the canary session did not open")
        prefix = torch.randn(1, 4, HIDDEN, generator=torch.Generator().manual_seed(6))
        await call.send({"hidden_states": prefix})
        await call.receive()
        self._canary = call
        expected = await self._canary_output()
        if expected is None:
            raise FuzzFailure("the canary session timed out as it opened")
        # A reopened canary computes what the first one did.
        if self._canary_expected is not None and not torch.equal(expected, self._canary_expected):
            raise FuzzFailure("a new canary session computes other outputs than the first")
        self._canary_expected = expected
        self.baseline_tokens = self.server.block_server.cache_tokens_left

    async def _reopen_canary(self) -> None:
        """After the canary timed out, or an example failed during a canary step (its stream
        may hold half a message); every example call is over by then."""
        assert self._canary is not None
        self._canary.abandon()
        self.canary_reopened += 1
        while self.server.block_server.open_sessions:  # noqa: ASYNC110 (see check_clean)
            await trio.sleep(0.005)
        await self.open_canary()

    async def close_canary(self) -> None:
        if self._canary is not None and not self._canary_broken:
            await self._canary.send_eof()
            await self._canary.finish()
            await self._canary.close()

    async def _canary_output(self) -> torch.Tensor | None:
        """The canary's output for its step; None if the server had closed it for its step
        timeout (this machine was too slow to feed it in time; it is reopened before the next
        check)."""
        call = self._canary
        assert call is not None
        self._canary_broken = True  # until its answer is in
        await call.send(self._canary_step)
        try:
            reply = await call.receive()
        except RemoteError as exc:
            if refusal(exc, call) == "refused:timeout":
                return None
            raise FuzzFailure(f"the canary session was ended: {exc}") from exc
        if reply is None or reply.get("position") != 6:
            raise FuzzFailure(f"the canary answered {reply!r}")
        self._canary_broken = False
        output: torch.Tensor = reply["hidden_states"]
        return output

    async def check_canary(self, *, exact: bool) -> bool:
        """Whether the canary answered (and then: its output is unchanged, or raises)."""
        output = await self._canary_output()
        if output is None:
            return False
        assert self._canary_expected is not None
        if exact:
            if not torch.equal(output, self._canary_expected):
                raise FuzzFailure("the canary's output changed: another session's cache leaked")
        elif not torch.allclose(output, self._canary_expected, rtol=1e-5, atol=1e-5):
            raise FuzzFailure("the canary's output changed while batched with the example")
        return True

    async def check_clean(self) -> None:
        """The example's calls are over: the cache is back at its baseline, only the canary is
        open, nothing was logged as a crash, and the canary's cache is untouched."""
        block_server = self.server.block_server
        while True:
            # The handler frees its grant when it exits; after a reset that happens after the
            # reset's packet arrived, and the server has no event for it: poll (the loop
            # usually finds it done at once; the example's deadline bounds it).  No session
            # at all: the canary timed out too.
            while block_server.open_sessions and (  # noqa: ASYNC110
                block_server.cache_tokens_left != self.baseline_tokens
                or block_server.open_sessions != 1
            ):
                await trio.sleep(0.005)
            if self.errors_logged:
                record = self.errors_logged[0]
                self.errors_logged.clear()
                raise FuzzFailure(
                    f"the server logged an error: {record.getMessage()} {record.exc_text}"
                )
            if not self._canary_broken and await self.check_canary(exact=True):
                return
            await self._reopen_canary()

    async def with_canary(self, work: Callable[[], Awaitable[str]]) -> str:
        """Run ``work`` while the canary takes a step at the same time."""
        outcome = ""

        async def run_work() -> None:
            nonlocal outcome
            outcome = await work()

        async def run_canary() -> None:
            if not self._canary_broken:
                await self.check_canary(exact=False)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_work)
            nursery.start_soon(run_canary)
        return outcome

    async def open_call(self, method: str | None) -> RawCall:
        call = await RawCall.open(self.connection, method)
        self._calls.append(call)
        return call

    async def run_case(self, case: Case) -> str:
        if self._canary_broken:
            with trio.fail_after(EXAMPLE_TIMEOUT_S):
                await self._reopen_canary()
        try:
            with trio.fail_after(EXAMPLE_TIMEOUT_S):
                outcome = await case.run(self)
        finally:
            # A failed example leaves its calls open: reset them, so that the next example
            # starts from a clean server (and hypothesis can shrink this one).
            for call in self._calls:
                call.abandon()
            self._calls.clear()
        with trio.fail_after(EXAMPLE_TIMEOUT_S):
            await self.check_clean()
        return outcome


class Case(Protocol):
    async def run(self, harness: Harness) -> str: ...
