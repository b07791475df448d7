"""Ctrl-C during a ``generate()`` of plain sync code: the step waited for is cancelled in the
bridge's thread before the ``KeyboardInterrupt`` reaches the caller, and the session goes on.

The servers run in a trio program of their own, on a daemon thread; the test's main thread is
the caller, as a script's is, and gets a real SIGINT once a server holds the step.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import trio
from transformers import LlamaForCausalLM

from petals_core.distributed import AutoDistributedModelForCausalLM

from .._trio_thread import TrioThread
from ..client._swarm_helpers import DEADLINE_S, InProcessSwarm, Model, in_process_swarm
from ._causal_lm import no_eos, random_ids


class _SwarmThread(TrioThread):
    """Servers of blocks 0:3 and 3:6 of ``model``, in a trio program on a daemon thread."""

    def __init__(self, model: Model, cache_dir: Path) -> None:
        super().__init__(
            "the swarm", thread_name="test-swarm-interrupt", start_timeout_s=DEADLINE_S
        )
        self._model = model
        self._cache_dir = cache_dir
        self.swarm: InProcessSwarm | None = None

    async def _program(self) -> None:
        async with in_process_swarm(self._model, self._cache_dir, [(0, 3), (3, 6)]) as swarm:
            self.swarm = swarm
            self._serving()
            assert self._stop is not None
            await self._stop.wait()

    def initial_peers(self) -> list[str]:
        assert self.swarm is not None
        first = next(iter(self.swarm.servers.values()))
        return [str(first.multiaddrs[0])]

    def hold_next_step(self) -> tuple[threading.Event, threading.Event]:
        """Hold the next step the server of blocks 0:3 takes until it is cancelled: the first
        event is set as it arrives, the second once its handler is cancelled (the client gave
        it up).  The steps after it go as usual."""
        entered, cancelled = threading.Event(), threading.Event()

        async def install() -> None:
            assert self.swarm is not None
            (server,) = (s for s in self.swarm.servers.values() if s.blocks == range(0, 3))
            inference = server.block_server._inference
            original = inference._step

            async def held(*args: Any, **kwargs: Any) -> Any:
                inference._step = original
                entered.set()
                try:
                    await trio.sleep_forever()
                finally:
                    cancelled.set()

            inference._step = held

        self.run(install)
        return entered, cancelled


@contextmanager
def _swarm_thread(model: Model, cache_dir: Path) -> Iterator[_SwarmThread]:
    thread = _SwarmThread(model, cache_dir)
    thread.start()
    try:
        yield thread
    finally:
        thread.stop()


def _ctrl_c_once(entered: threading.Event) -> threading.Thread:
    """A thread that sends SIGINT to the main thread (Ctrl-C) once ``entered`` is set."""
    main = threading.main_thread().ident
    assert main is not None

    def interrupt() -> None:
        if entered.wait(DEADLINE_S):
            signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=interrupt, name="ctrl-c", daemon=True)
    thread.start()
    return thread


def test_ctrl_c_while_generate_waits_cancels_its_step(model: Model, tmp_path: Path) -> None:
    assert threading.current_thread() is threading.main_thread()
    reference = LlamaForCausalLM.from_pretrained(model.folder).eval()
    ids = random_ids(1, 5, seed=40)
    settings = {"max_new_tokens": 3, "do_sample": False, **no_eos(reference)}
    expected = reference.generate(ids, **settings)
    with _swarm_thread(model, tmp_path) as swarm:
        distributed = AutoDistributedModelForCausalLM.from_pretrained(
            model.folder, initial_peers=swarm.initial_peers()
        )
        try:
            entered, cancelled = swarm.hold_next_step()
            ctrl_c = _ctrl_c_once(entered)
            with distributed.inference_session(max_length=16) as session:
                with pytest.raises(KeyboardInterrupt):
                    distributed.generate(ids, **settings)
                ctrl_c.join()
                # The step ended in the bridge before the interrupt came out (taken back: the
                # session is as before it), and the server's side of it was given up.
                assert session._inner.session._core._began_at is None
                assert session.position == 0
                assert cancelled.wait(DEADLINE_S)
                ours = distributed.generate(ids, **settings)
            assert torch.equal(ours, expected)
        finally:
            distributed.shutdown()
