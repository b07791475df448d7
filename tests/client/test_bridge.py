"""The bridge from sync code to trio: lazy start of exactly one thread, refusal on a trio thread,
use of the caller's loop from worker threads of a trio program, and a fresh start in a forked
child (checked in a separate interpreter, so that the test process never forks).
"""

from __future__ import annotations

import inspect
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import trio

from petals_core.client import Bridge, RemoteSequential, bridge

from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    Model,
    assert_close,
    in_process_swarm,
    manager_for,
)

BRIDGE_THREAD = "petals_core-bridge"


def bridge_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == BRIDGE_THREAD]


async def double(value: int) -> int:
    await trio.lowlevel.checkpoint()
    return 2 * value


async def fail() -> None:
    raise KeyError("from the loop")


def test_bridge_starts_one_thread_on_first_use() -> None:
    # Threads started since ``before`` (others of the process may end meanwhile, e.g. trio's
    # idle worker threads, so counting them all would not tell).
    before = set(threading.enumerate())

    def started() -> set[threading.Thread]:
        return set(threading.enumerate()) - before

    own = Bridge()
    assert started() == set()
    assert own._thread is None
    assert own.run(double, 21) == 42
    thread = own._thread
    assert thread is not None and thread.is_alive() and thread.daemon
    assert started() == {thread}
    assert thread.name == BRIDGE_THREAD
    assert own.run(double, 1) == 2
    with pytest.raises(KeyError, match="from the loop"):
        own.run(fail)
    assert own._thread is thread
    assert started() == {thread}
    # What a forked child runs: the parent's thread and loop are forgotten, and the next call
    # starts the child's own.
    own._forget()
    assert (own._token, own._nursery, own._thread) == (None, None, None)
    assert own.run(double, 2) == 4
    assert own._thread is not None and own._thread is not thread


def _waiting_in_the_bridge(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in a bridge call, past handing it to the loop (in trio's
    ``from_thread.run``)."""
    lines, first = inspect.getsourcelines(Bridge.run)
    (handing,) = [first + i for i, line in enumerate(lines) if "trio.from_thread.run(" in line]
    innermost = frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code is Bridge.run.__code__:
            return frame is not innermost and frame.f_lineno == handing
        frame = frame.f_back
    return False


def test_ctrl_c_before_the_loop_began_the_call_comes_back_at_once() -> None:
    """Ctrl-C while the bridge's loop has not begun the call yet (it is busy): the interrupt
    reaches the caller at once, not once the loop is free; the call then starts cancelled."""
    assert threading.current_thread() is threading.main_thread()
    own = Bridge()
    assert own.run(double, 1) == 2
    token = own.token()
    stuck, free, released = threading.Event(), threading.Event(), threading.Event()
    token.run_sync_soon(lambda: (stuck.set(), free.wait(DEADLINE_S), released.set()))
    assert stuck.wait(DEADLINE_S)
    ran: list[int] = []

    async def record() -> None:
        ran.append(1)
        await trio.lowlevel.checkpoint()
        ran.append(2)

    main = threading.main_thread()

    def interrupt() -> None:
        deadline = time.monotonic() + DEADLINE_S
        while not _waiting_in_the_bridge(main) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert main.ident is not None
        signal.pthread_kill(main.ident, signal.SIGINT)

    thread = threading.Thread(target=interrupt, name="ctrl-c", daemon=True)
    thread.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            own.run(record)
        assert not released.is_set()  # back while the loop was still stuck
    finally:
        free.set()
        thread.join(DEADLINE_S)
    # Once free, the loop begins the call cancelled: it stops at its first checkpoint.
    assert own.run(double, 2) == 4
    assert ran in ([], [1])


async def test_sync_call_on_a_trio_thread_is_refused() -> None:
    with pytest.raises(RuntimeError, match="trio thread"):
        Bridge().run(double, 1)
    seq = RemoteSequential(
        manager_for(initial_peers=["/ip4/127.0.0.1/udp/9/quic-v1"], dht_prefix="x")
    )
    with pytest.raises(RuntimeError, match="await"):
        seq(torch.zeros(1, 1, HIDDEN))
    assert seq.sequence_manager.state.loop_token is None


def test_forked_child_starts_its_own_bridge() -> None:
    # Only the bridge's module (stdlib and trio): loaded from its file, as a fresh interpreter
    # would run it, so that its fork hook is registered there.
    path = Path(__file__).parents[2] / "petals_core" / "client" / "_bridge.py"
    script = textwrap.dedent(
        f"""
        import importlib.util, os, threading
        spec = importlib.util.spec_from_file_location("bridge_module", {str(path)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        bridge = module.bridge

        async def answer():
            return threading.current_thread()

        parent = bridge.run(answer)
        assert parent is bridge._thread
        pid = os.fork()
        if pid == 0:
            if bridge._thread is not None or bridge._token is not None:
                os._exit(3)  # the parent's thread, which does not exist here, is remembered
            child = bridge.run(answer)
            os._exit(0 if child is bridge._thread and child is not parent else 4)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert result.returncode == 0, result.stderr
    assert "child exit 0" in result.stdout, result.stdout + result.stderr


async def test_worker_threads_of_a_trio_program_use_its_loop(model: Model, tmp_path: Path) -> None:
    torch.manual_seed(6)
    x = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        expected = model.forward(x)
    thread_before = bridge._thread
    async with in_process_swarm(model, tmp_path, [(0, 6)]) as swarm:
        seq = RemoteSequential(manager_for(list(swarm.servers.values())))
        with trio.fail_after(DEADLINE_S):
            async with seq:
                assert seq.sequence_manager.state.loop_token is trio.lowlevel.current_trio_token()

                def sync_use() -> tuple[torch.Tensor, torch.Tensor]:
                    with seq.inference_session(max_length=4) as session:
                        stepped = session.step(x)
                    return seq(x).detach(), stepped

                output, stepped = await trio.to_thread.run_sync(sync_use)
    assert_close(output, expected)
    assert_close(stepped, expected)
    assert bridge._thread is thread_before  # no bridge thread was started for it


async def test_plain_sync_code_runs_in_the_bridge_thread(model: Model, tmp_path: Path) -> None:
    """A script without trio: the network part starts on first use, in the one bridge thread."""
    torch.manual_seed(7)
    x = torch.randn(2, 3, HIDDEN)
    with torch.no_grad():
        expected = model.forward(x)
    async with in_process_swarm(model, tmp_path, [(0, 2), (2, 6)]) as swarm:
        servers = list(swarm.servers.values())

        def script() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            threads = set(threading.enumerate())
            before = set(bridge_threads())  # the bridge may run already (earlier tests)
            seq = RemoteSequential(manager_for(servers))
            assert set(threading.enumerate()) <= threads  # none started (others may have ended)
            assert seq.sequence_manager.state.loop_token is None
            try:
                output = seq(x).detach()
                token = seq.sequence_manager.state.loop_token
                assert token is not None and token is bridge._token
                assert bridge._thread is not None and bridge._thread.is_alive()
                started = set(bridge_threads()) - before
                assert started <= {bridge._thread}  # at most one thread: the bridge's
                with seq.inference_session(max_length=8) as session:
                    first = session.step(x[:, :2])
                    second = session.step(x[:, 2:])
                    assert session.position == 3
                assert set(bridge_threads()) - before == started
                return output, first, second
            finally:
                seq.shutdown()

        with trio.fail_after(DEADLINE_S):
            output, first, second = await trio.to_thread.run_sync(script)
    assert_close(output, expected)
    assert_close(torch.cat([first, second], dim=1), expected)
