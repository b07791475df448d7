"""Inference sessions through real servers on loopback, compared step by step with the same blocks
run locally: rollback, beam reordering, deep prompts, and failover (a server leaving, a server
process killed with SIGKILL or stalled with SIGSTOP) with the history replayed elsewhere.
"""

from __future__ import annotations

import functools
import itertools
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from petals_core import PetalsError, ServerError, SessionTooLarge
from petals_core.client import (
    InferenceSession,
    RemoteSequenceManager,
    RemoteSequential,
    _session_core,
    remote_backward,
    remote_forward,
)
from petals_core.routing import MissingBlocksError
from petals_core.server import ServingLimits
from petals_core.testing import open_local_swarm

from ..dht._swarm import wait_until
from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    PROCESS_PREFIX,
    InProcessSwarm,
    Model,
    assert_close,
    in_process_swarm,
    manager_for,
    peer_id_of,
    process_of,
    process_server_args,
    sequential_over,
    wait_for_servers,
)


class Reference:
    """What a session should output: the inputs so far of every row, run locally in full."""

    def __init__(self, model: Model, prompts: torch.Tensor | None = None) -> None:
        self.model = model
        self.prompts = prompts
        self.inputs: torch.Tensor | None = None  # (B, position, hidden)

    def step(self, hidden: torch.Tensor, hypo_ids: torch.Tensor | None = None) -> torch.Tensor:
        if hypo_ids is not None:
            assert self.inputs is not None
            self.inputs = self.inputs[hypo_ids]
            if self.prompts is not None and self.prompts.shape[1] > 1:  # each row its own
                self.prompts = self.prompts[:, hypo_ids]
        position = 0 if self.inputs is None else self.inputs.shape[1]
        self.inputs = hidden if self.inputs is None else torch.cat([self.inputs, hidden], dim=1)
        with torch.no_grad():
            return self.model.forward(self.inputs, self.prompts)[:, position:]

    async def check_step(
        self,
        session: InferenceSession,
        batch: int,
        tokens: int,
        *,
        prompts: torch.Tensor | None = None,
        hypo_ids: torch.Tensor | None = None,
    ) -> None:
        """A random ``(batch, tokens)`` step through ``session`` gives what the local blocks give
        (``prompts`` go to the session's first step; the reference holds its own)."""
        x = torch.randn(batch, tokens, HIDDEN)
        actual = await session.step(x, prompts=prompts, hypo_ids=hypo_ids)
        assert_close(actual, self.step(x, hypo_ids))

    def rollback(self, position: int) -> None:
        assert self.inputs is not None
        self.inputs = self.inputs[:, :position]


@asynccontextmanager
async def _session_over(
    swarm: InProcessSwarm, **manager_fields: Any
) -> AsyncIterator[InferenceSession]:
    """A session of up to 16 positions through ``swarm``, opened once the client sees all its
    servers (see :func:`sequential_over`)."""
    async with (
        sequential_over(list(swarm.servers.values()), **manager_fields) as seq,
        seq.open_inference_session(max_length=16) as session,
    ):
        yield session


async def test_rollback_and_reorder_through_two_servers_equal_local(
    model: Model, tmp_path: Path
) -> None:
    torch.manual_seed(1)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        seq = RemoteSequential(manager_for(list(swarm.servers.values())))
        reference = Reference(model)
        with trio.fail_after(DEADLINE_S):
            async with seq, seq.open_inference_session(max_length=16) as session:
                await reference.check_step(session, 3, 4)
                assert [(s.start, s.end) for s in session.route] == [(0, 3), (3, 6)]
                for _ in range(2):
                    await reference.check_step(session, 3, 1)
                # Roll back to position 2 and write new tokens there.
                session.position = 2
                reference.rollback(2)
                await reference.check_step(session, 3, 2)
                assert session.position == 4
                # Beam search: row 0 continues row 2, rows 1 and 2 continue row 0.
                hypo_ids = torch.tensor([2, 0, 0])
                await reference.check_step(session, 3, 1, hypo_ids=hypo_ids)
                await reference.check_step(session, 3, 1)
                assert session.retries == 0


async def test_the_spans_of_a_session_open_on_their_servers_at_once(
    model: Model, tmp_path: Path
) -> None:
    """Each server's cache allocation waits until the other's has begun: opened one after the
    other, the first would wait until the barrier gives up."""
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        barrier = threading.Barrier(2, timeout=DEADLINE_S / 4)
        for server in swarm.servers.values():
            backend = server.backend
            assert backend is not None
            original = backend.allocate_caches

            def allocate(*args: Any, original: Any = original, **kwargs: Any) -> Any:
                barrier.wait()  # in the server's pool thread
                return original(*args, **kwargs)

            backend.allocate_caches = allocate  # type: ignore[method-assign]
        seq = RemoteSequential(manager_for(list(swarm.servers.values())))
        reference = Reference(model)
        with trio.fail_after(DEADLINE_S):
            async with seq, seq.open_inference_session(max_length=16) as session:
                assert session.first_step is None
                await reference.check_step(session, 2, 4)
                times = session.first_step
                assert times is not None
                assert 0 <= times.connect_s <= times.open_s
                assert times.route_s >= 0 and times.route_s + times.open_s <= times.total_s
                await reference.check_step(session, 2, 1)
                assert session.first_step is times
                assert session.retries == 0


async def test_failover_after_reorder_replays_reordered_history_and_prompts(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks 3:6 are held twice; the holder in the route leaves after a reorder: its
    replacement rebuilds its cache from the reordered history, with the deep prompts (each row
    its own, reordered with it), in steps of two positions (as a long history is, in steps of
    MAX_STEP_BYTES)."""
    monkeypatch.setattr(_session_core, "MAX_STEP_BYTES", 2 * 2 * HIDDEN * 4)
    torch.manual_seed(2)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6), (3, 6)]) as swarm:
        prompts = torch.randn(N_BLOCKS, 2, 2, HIDDEN) * 0.5
        reference = Reference(model, prompts)
        with trio.fail_after(DEADLINE_S):
            async with _session_over(swarm) as session:
                await reference.check_step(session, 2, 4, prompts=prompts)
                await reference.check_step(session, 2, 1)
                hypo_ids = torch.tensor([1, 1])
                await reference.check_step(session, 2, 1, hypo_ids=hypo_ids)
                second = session.route[1].peer_id
                await swarm.leave(second)
                for _ in range(3):
                    await reference.check_step(session, 2, 1)
                assert session.retries >= 1
                assert session.manager.is_banned(second)
                assert second not in {span.peer_id for span in session.route}
                assert [(s.start, s.end) for s in session.route] == [(0, 3), (3, 6)]


async def test_a_replacement_slow_to_open_gets_the_time_an_opening_may_take(
    model: Model, tmp_path: Path
) -> None:
    """The server of blocks 3:6 leaves; the only other one, announcing a high speed, takes
    seconds to allocate its cache (its memory is busy).  The replay's first step waits for the
    opening's answer as long as an opening may take (``request_timeout_s``), not only the step
    timeout its speed implies: the replacement goes through, unblamed, tokens exact."""
    torch.manual_seed(37)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        reference = Reference(model)
        with trio.fail_after(DEADLINE_S):
            async with _session_over(swarm, min_step_timeout_s=0.5) as session:
                await reference.check_step(session, 2, 4)
                spare = await swarm.add((3, 6), throughput=1000.0)
                backend = spare.backend
                assert backend is not None
                original = backend.allocate_caches

                def allocate_slowly(*args: Any, **kwargs: Any) -> Any:
                    time.sleep(3.0)  # (in the server's pool thread: a slow allocation)
                    return original(*args, **kwargs)

                backend.allocate_caches = allocate_slowly  # type: ignore[method-assign]
                await wait_for_servers(session.manager, 3)
                await swarm.leave(session.route[1].peer_id)
                await reference.check_step(session, 2, 1)
                assert session.route[1].peer_id == str(spare.dht.peer_id)
                assert not session.manager.is_banned(str(spare.dht.peer_id))


async def test_a_rollback_inside_the_deep_prompts_applies_them_again(
    model: Model, tmp_path: Path
) -> None:
    """Deep prompts of 3 positions, a prefill of 5, then back to position 1: the next steps
    take the prompts' positions 1 and 2 as a session that never went back would, over two
    servers that push to each other."""
    torch.manual_seed(13)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        prompts = torch.randn(N_BLOCKS, 1, 3, HIDDEN) * 0.5
        reference = Reference(model, prompts)
        with trio.fail_after(DEADLINE_S):
            async with _session_over(swarm) as session:
                await reference.check_step(session, 1, 5, prompts=prompts)
                session.position = 1
                reference.rollback(1)
                await reference.check_step(session, 1, 1)
                await reference.check_step(session, 1, 3)
                assert session.retries == 0


async def _sent_again_once_3_6_is_held(
    swarm: InProcessSwarm,
    session: InferenceSession,
    reference: Reference,
    x: torch.Tensor,
    hypo_ids: torch.Tensor,
) -> None:
    """A server holds blocks 3:6 again: the step of ``x`` that failed goes through as if it
    had never failed, and the next one too."""
    await swarm.add((3, 6))
    await wait_for_servers(session.manager, 2)
    assert_close(await session.step(x, hypo_ids=hypo_ids), reference.step(x, hypo_ids))
    await reference.check_step(session, 2, 1)


async def test_a_step_that_failed_can_be_sent_again_as_it_was(model: Model, tmp_path: Path) -> None:
    """The holder of 3:6 leaves and no other holds those blocks: a step that reorders the rows
    fails, and with it the replacement.  Once a server holds them again, the same step (the same
    reorder) goes through as if it had never failed."""
    torch.manual_seed(3)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        reference = Reference(model)
        with trio.fail_after(DEADLINE_S):
            async with _session_over(swarm, missing_blocks_timeout_s=0.5, max_retries=2) as session:
                await reference.check_step(session, 2, 3)
                await reference.check_step(session, 2, 1)
                await swarm.leave(session.route[1].peer_id)
                x, hypo_ids = torch.randn(2, 1, HIDDEN), torch.tensor([1, 1])
                with pytest.raises((PetalsError, MissingBlocksError)):
                    await session.step(x, hypo_ids=hypo_ids)
                assert session.position == 4
                await _sent_again_once_3_6_is_held(swarm, session, reference, x, hypo_ids)


async def test_a_long_prefill_goes_in_pieces_and_equals_local(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step larger than MAX_STEP_BYTES (here two positions of two rows) goes to every server
    as several, the first holding the deep prompts' three positions, from server to server:
    each server takes three steps for a prefill of seven positions, and the outputs equal the
    local blocks'."""
    monkeypatch.setattr(_session_core, "MAX_STEP_BYTES", 2 * 2 * HIDDEN * 4)
    torch.manual_seed(5)
    prompts = torch.randn(N_BLOCKS, 2, 3, HIDDEN) * 0.5
    reference = Reference(model, prompts)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with _session_over(swarm, verify="none") as session:
                await reference.check_step(session, 2, 7, prompts=prompts)
                steps = [s.block_server.statistics().steps for s in swarm.servers.values()]
                assert steps == [3, 3]  # (0:3 with the prompts, 3:5, 5:7)
                await reference.check_step(session, 2, 1)
                assert session.position == 8 and session.retries == 0


async def test_a_padded_long_prefill_in_pieces_equals_it_in_one_step(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left padding longer than the first piece (it goes with the sessions' openings): a
    prefill of seven positions in pieces of two, and the step after it, give what they give
    with the prefill in one step."""
    torch.manual_seed(7)
    x, after, padding = torch.randn(2, 7, HIDDEN), torch.randn(2, 1, HIDDEN), torch.tensor([0, 5])
    outputs = []
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            for step_bytes in (1 << 30, 2 * 2 * HIDDEN * 4):
                monkeypatch.setattr(_session_core, "MAX_STEP_BYTES", step_bytes)
                async with _session_over(swarm, verify="none") as session:
                    outputs += [await session.step(x, padding=padding), await session.step(after)]
            steps = [s.block_server.statistics().steps for s in swarm.servers.values()]
    assert steps == [2 + 5, 2 + 5]  # (the prefill in one step; then 0:2, 2:4, 4:6, 6:7)
    assert_close(outputs[2], outputs[0])
    assert_close(outputs[3], outputs[1])


async def test_a_long_prefill_that_fails_for_good_midway_leaves_the_session_as_it_was(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder of 3:6 leaves during the second piece of a long step (after a reorder): the
    step fails for good, the pieces done are taken back with the reorder, and once a server
    holds 3:6 again the same step goes through as if it had never failed."""
    monkeypatch.setattr(_session_core, "MAX_STEP_BYTES", 2 * 2 * HIDDEN * 4)
    torch.manual_seed(6)
    reference = Reference(model)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with _session_over(
                swarm, verify="none", missing_blocks_timeout_s=0.5, max_retries=2
            ) as session:
                await reference.check_step(session, 2, 2)
                second = session.route[1].peer_id
                entered, _ = _hold_steps(swarm.servers[second], skip=2)
                x, hypo_ids = torch.randn(2, 5, HIDDEN), torch.tensor([1, 0])
                async with trio.open_nursery() as nursery:

                    async def leave_when_held() -> None:
                        await entered.wait()
                        await swarm.leave(second)

                    nursery.start_soon(leave_when_held)
                    with pytest.raises((PetalsError, MissingBlocksError)):
                        await session.step(x, hypo_ids=hypo_ids)
                assert session.position == 2
                await _sent_again_once_3_6_is_held(swarm, session, reference, x, hypo_ids)


@pytest.mark.parametrize("max_retries", [1, 2])
async def test_the_pieces_of_a_long_prefill_share_one_retry_budget(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_retries: int
) -> None:
    """A prefill of six positions goes in three pieces; a server fails the second piece and
    another the third: two failures of one caller's step, beyond ``max_retries=1`` (the step
    fails) and within ``max_retries=2`` (it equals the local blocks')."""
    monkeypatch.setattr(_session_core, "MAX_STEP_BYTES", 2 * 2 * HIDDEN * 4)
    torch.manual_seed(9)
    reference = Reference(model)
    async with in_process_swarm(model, tmp_path, [(0, 6)] * 3) as swarm:
        failed_at: set[int] = set()
        for server in swarm.servers.values():
            inference = server.block_server._inference
            original = inference._step

            async def failing(plan: Any, *args: Any, original: Any = original) -> Any:
                if plan.position in (2, 4) and plan.position not in failed_at:
                    failed_at.add(plan.position)
                    raise ServerError(f"this server fails the piece at {plan.position}")
                return await original(plan, *args)

            inference._step = failing
        with trio.fail_after(DEADLINE_S):
            async with _session_over(swarm, verify="none", max_retries=max_retries) as session:
                if max_retries == 1:
                    with pytest.raises(PetalsError, match="failed after 2 attempt"):
                        await session.step(torch.randn(2, 6, HIDDEN))
                    assert session.position == 0
                else:
                    await reference.check_step(session, 2, 6)
                assert failed_at == {2, 4} and session.retries == 2


async def test_closing_a_session_during_its_step_blames_no_server_and_leaves_no_session(
    model: Model, tmp_path: Path
) -> None:
    async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values())) as seq:
                manager = seq.sequence_manager
                session = InferenceSession(manager, 16)
                await session.step(torch.randn(1, 2, HIDDEN))
                held = _hold_steps(swarm.servers[session.route[0].peer_id])
                await _close_during_step(session, *held, torch.randn(1, 1, HIDDEN))
                assert not manager.state.bans
                await _no_open_sessions(swarm.servers.values())


async def test_closing_a_session_while_it_fails_over_blames_no_replacement(
    model: Model, tmp_path: Path
) -> None:
    """Closed while a replacement replays (its server held), or while a beam step that lost
    its first server waits for the second: the step ends as closed, every session is closed,
    and no server but the one that left is blamed."""
    spans = [(0, 3), (0, 3), (3, 6), (3, 6)]
    async with in_process_swarm(model, tmp_path, spans) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="none") as seq:
                manager = seq.sequence_manager
                session = InferenceSession(manager, 16)
                await session.step(torch.randn(2, 2, HIDDEN))
                first, second = (span.peer_id for span in session.route)
                spare = next(
                    p
                    for p in swarm.servers
                    if p != second and swarm.servers[p].blocks == range(3, 6)
                )
                held = _hold_steps(swarm.servers[spare])
                await swarm.leave(second)
                await _close_during_step(session, *held, torch.randn(2, 1, HIDDEN))
                assert set(manager.state.bans) == {second}
                await _no_open_sessions(swarm.servers.values())

                session = InferenceSession(manager, 16)
                await session.step(torch.randn(2, 2, HIDDEN))
                first, second = (span.peer_id for span in session.route)
                held = _hold_steps(swarm.servers[second])
                await swarm.leave(first)
                reorder = torch.tensor([1, 0])
                await _close_during_step(
                    session, *held, torch.randn(2, 1, HIDDEN), hypo_ids=reorder
                )
                assert first in manager.state.bans and second not in manager.state.bans
                await _no_open_sessions(swarm.servers.values())


async def test_closing_a_session_while_a_checker_opens_leaves_no_session(
    model: Model, tmp_path: Path
) -> None:
    async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values())) as seq:
                manager = seq.sequence_manager  # its first answers checked
                session = InferenceSession(manager, 16)
                entered, release = trio.Event(), trio.Event()
                follower = session._follower

                async def slow_follower(state: Any) -> Any:
                    entered.set()
                    await release.wait()
                    return await follower(state)

                session._follower = slow_follower  # type: ignore[method-assign]
                await _close_during_step(session, entered, release, torch.randn(1, 2, HIDDEN))
                await _no_open_sessions(swarm.servers.values())


async def test_a_span_cut_short_while_taking_back_a_reorder_blames_nobody(
    model: Model, tmp_path: Path
) -> None:
    """The caller gives up on a beam step (its spans then hold a reorder taken back), then on
    the next step while the first span is replayed anew: neither server is blamed, and the step
    after goes through as if neither had been sent."""
    torch.manual_seed(4)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        servers = list(swarm.servers.values())
        reference = Reference(model)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(servers, verify="none", max_retries=2) as seq:
                manager = seq.sequence_manager
                async with InferenceSession(manager, 16) as session:
                    await reference.check_step(session, 2, 2)
                    first, second = (swarm.servers[span.peer_id] for span in session.route)
                    entered, release = _hold_steps(second)
                    beam = torch.tensor([1, 0])
                    await _give_up_during_step(session, entered, torch.randn(2, 1, HIDDEN), beam)
                    release.set()
                    entered, release = _hold_steps(first)  # its replay, this time
                    await _give_up_during_step(session, entered, torch.randn(2, 1, HIDDEN))
                    release.set()
                    await reference.check_step(session, 2, 1)
                    assert not manager.state.bans


def _hold_steps(server: Any, *, skip: int = 0) -> tuple[trio.Event, trio.Event]:
    """Hold ``server``'s inference steps (after ``skip`` of them) until the second event is set;
    the first is set as one arrives.  Held once: the next step after the release goes as usual."""
    inference = server.block_server._inference
    entered, release = trio.Event(), trio.Event()
    original = inference._step
    skipped = itertools.count()

    async def held(*args: Any, **kwargs: Any) -> Any:
        if next(skipped) < skip:
            return await original(*args, **kwargs)
        entered.set()
        await release.wait()
        inference._step = original
        return await original(*args, **kwargs)

    inference._step = held
    return entered, release


async def _close_during_step(
    session: InferenceSession,
    entered: trio.Event,
    release: trio.Event,
    x: torch.Tensor,
    **step: Any,
) -> None:
    """A step of ``x`` through ``session``, closed once ``entered`` is set (then ``release``
    set): the step ends as closed."""
    async with trio.open_nursery() as nursery:

        async def closed_step() -> None:
            with pytest.raises(PetalsError, match="closed"):
                await session.step(x, **step)

        nursery.start_soon(closed_step)
        await entered.wait()
        await session.close()
        release.set()


async def _give_up_during_step(
    session: InferenceSession, entered: trio.Event, x: torch.Tensor, hypo_ids: Any = None
) -> None:
    """A step of ``x`` through ``session``, cancelled once ``entered`` is set."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(functools.partial(session.step, x, hypo_ids=hypo_ids))
        await entered.wait()
        nursery.cancel_scope.cancel()


async def test_a_cancelled_close_still_ends_the_server_sessions(
    model: Model, tmp_path: Path
) -> None:
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values())) as seq:
                with trio.CancelScope() as scope:
                    async with seq.open_inference_session(max_length=8) as session:
                        await session.step(torch.randn(1, 2, HIDDEN))
                        servers = swarm.servers.values()
                        assert [s.block_server.open_sessions for s in servers] == [1, 1]
                        scope.cancel()
                        await trio.sleep_forever()  # cancelled at once: the session closes
                await _no_open_sessions(swarm.servers.values())


async def _no_open_sessions(servers: Any) -> None:
    await wait_until(lambda: all(server.block_server.open_sessions == 0 for server in servers))


async def test_step_refuses_bad_input_without_banning(model: Model, tmp_path: Path) -> None:
    async with in_process_swarm(model, tmp_path, [(0, 6)]) as swarm:
        manager = manager_for(list(swarm.servers.values()))
        seq = RemoteSequential(manager)
        with trio.fail_after(DEADLINE_S):
            async with seq, seq.open_inference_session(max_length=4) as session:
                await session.step(torch.randn(1, 2, HIDDEN))
                with pytest.raises(ValueError, match="max_length"):
                    await session.step(torch.randn(1, 3, HIDDEN))
                with pytest.raises(ValueError, match="rows"):
                    await session.step(torch.randn(2, 1, HIDDEN))
                with pytest.raises(ValueError, match="position 0"):
                    await session.step(
                        torch.randn(1, 1, HIDDEN), prompts=torch.zeros(N_BLOCKS, 1, 1, HIDDEN)
                    )
            async with seq.open_inference_session(max_length=4) as session:
                for prompts in (
                    torch.zeros(N_BLOCKS, 1, 3, HIDDEN),  # longer than the step
                    torch.zeros(N_BLOCKS - 1, 1, 1, HIDDEN),
                    torch.zeros(N_BLOCKS, 2, 1, HIDDEN),  # a row too many
                    torch.zeros(N_BLOCKS, 1, 1, HIDDEN + 1),
                ):
                    with pytest.raises(ValueError, match="deep prompts"):
                        await session.step(torch.randn(1, 2, HIDDEN), prompts=prompts)
                with pytest.raises(ValueError, match="only go back"):
                    session.position = 3
                assert not manager.state.bans
            with pytest.raises(PetalsError, match="closed"):
                await session.step(torch.randn(1, 1, HIDDEN))


async def test_a_server_gone_is_blamed_once_however_many_steps_find_it_gone(
    model: Model, tmp_path: Path
) -> None:
    """The session's server leaves, and the only other one fails every replay: the step fails
    for good, a span standing for the gone server in the chain.  The next step finds it gone
    again, and replaces it again, without blaming it a second time."""
    async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(
                list(swarm.servers.values()), verify="none", missing_blocks_timeout_s=0.2
            ) as seq:
                manager = seq.sequence_manager
                async with InferenceSession(manager, 16) as session:
                    await session.step(torch.randn(1, 2, HIDDEN))
                    (span,) = session.route
                    (other,) = (s for peer, s in swarm.servers.items() if peer != span.peer_id)

                    async def broken(*args: Any, **kwargs: Any) -> Any:
                        raise ServerError("this server fails every step")

                    other.block_server._inference._step = broken
                    await swarm.leave(span.peer_id)
                    for _ in range(2):
                        with pytest.raises(PetalsError):
                            await session.step(torch.randn(1, 1, HIDDEN))
                        assert manager.state.bans[span.peer_id].failures == 1


async def test_a_replacement_that_refuses_the_session_as_too_large_is_not_blamed(
    model: Model, tmp_path: Path
) -> None:
    """The session's server leaves; the only other one has cache for 8 positions, and refuses
    the session of 16 as its replay begins: not blamed, and the step fails naming why."""
    async with in_process_swarm(model, tmp_path, [(0, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            (first,) = swarm.servers
            seq = sequential_over(
                list(swarm.servers.values()), verify="none", missing_blocks_timeout_s=0.5
            )
            async with seq as sequential:
                manager = sequential.sequence_manager
                async with InferenceSession(manager, 16) as session:
                    await session.step(torch.randn(1, 2, HIDDEN))
                    small = str((await swarm.add((0, 6), attn_cache_tokens=8)).dht.peer_id)
                    await wait_for_servers(manager, 2)
                    await swarm.leave(first)
                    with pytest.raises(MissingBlocksError) as missing:
                        await session.step(torch.randn(1, 1, HIDDEN))
                    assert f"{small} [0:6) refused it (requested" in str(missing.value)
                    assert small not in manager.state.bans


async def test_a_server_that_says_a_step_is_too_large_after_opening_is_blamed(
    model: Model, tmp_path: Path
) -> None:
    """Only an opening may be refused as larger than the server takes: a server that says so
    of a later step fails as any failing server does."""
    async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="none") as seq:
                manager = seq.sequence_manager
                reference = Reference(model)
                async with InferenceSession(manager, 16) as session:
                    await reference.check_step(session, 1, 2)
                    (span,) = session.route

                    async def refusing(*args: Any, **kwargs: Any) -> Any:
                        raise SessionTooLarge("this step is too large")

                    swarm.servers[span.peer_id].block_server._inference._step = refusing
                    await reference.check_step(session, 1, 1)
                    assert manager.is_banned(span.peer_id)
                    assert session.route[0].peer_id != span.peer_id


async def test_a_session_larger_than_a_server_takes_goes_elsewhere_blaming_nobody(
    model: Model, tmp_path: Path
) -> None:
    """Three servers of all the blocks: one takes sessions (and sequences) of at most 8
    positions and announces so (routes leave it out, though it announces the most speed); one
    has attention cache for 8 positions only; the third takes everything, and a session of 16
    and a forward of 12 go through it.  Without the third, the second refuses a session of 16
    at once, and the session fails (no other server comes), naming each server's reason; so
    does a session longer than every server takes.  Nobody is banned."""
    torch.manual_seed(12)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        short_limits = ServingLimits(request_timeout_s=10.0, inference_max_length=8)
        short = await swarm.add((0, N_BLOCKS), throughput=1000.0, limits=short_limits)
        small = await swarm.add((0, N_BLOCKS), throughput=500.0, attn_cache_tokens=8)
        roomy = await swarm.add((0, N_BLOCKS))
        short_id, small_id, roomy_id = (str(s.dht.peer_id) for s in (short, small, roomy))
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            quick = {"missing_blocks_timeout_s": 0.5}
            async with sequential_over(servers, verify="none", **quick) as seq:
                manager = seq.sequence_manager
                reference = Reference(model)
                async with InferenceSession(manager, 16) as session:
                    await reference.check_step(session, 1, 4)
                    await reference.check_step(session, 1, 1)
                    assert [span.peer_id for span in session.route] == [roomy_id]
                # A forward of 12 positions, past the fastest server's longest sequence.
                x = torch.randn(1, 12, HIDDEN)
                output, _ = await remote_forward(manager, x)
                assert_close(output, model.forward(x).detach())
                with pytest.raises(MissingBlocksError) as missing:
                    async with InferenceSession(manager, 1 << 20) as session:
                        await session.step(torch.randn(1, 1, HIDDEN))
                assert f"{short_id} [0:6) takes at most 8 positions" in str(missing.value)
                assert not manager.state.bans
            manager = manager_for(servers, blocked_servers=(roomy_id,), **quick)
            async with RemoteSequential(manager):
                await wait_for_servers(manager, 2)
                with pytest.raises(MissingBlocksError) as missing:
                    async with InferenceSession(manager, 16) as session:
                        await session.step(torch.randn(1, 4, HIDDEN))
                message = str(missing.value)
                assert f"{short_id} [0:6) takes at most 8 positions" in message
                assert f"{small_id} [0:6) refused it (requested" in message
                assert not manager.state.bans


# --- real processes: SIGSTOP, SIGKILL --------------------------------------------------------


async def test_stall_and_kill_failover_in_a_process_swarm(model: Model) -> None:
    """One swarm of processes: A holds 0:3, B 3:6, C 0:6.

    1. A session routed through C (A and B banned while it opens); C is stopped (SIGSTOP) after
       2 steps: a short ``request_timeout_s`` finds the stall, C is banned and the session goes on
       through A and B with the same outputs.  C is resumed.
    2. A session routed through A and B (C banned while it opens): 10 single-token steps after a
       4-token prefill; A is killed (SIGKILL) after step 5: blocks 0:3 move to C, all outputs
       equal local, A is banned.
    3. A forward through blocks 3:6 (on B, C banned meanwhile); B is killed before the backward:
       the backward recomputes on C and gives the local gradients.
    4. Every server dead: requests fail once their retries are spent.
    """
    torch.manual_seed(3)
    spans = [(0, 3), (3, 6), (0, 6)]
    with trio.fail_after(4 * DEADLINE_S):
        async with open_local_swarm(
            model.folder, [process_server_args(span) for span in spans]
        ) as swarm:
            a, b, c = (peer_id_of(process) for process in swarm.servers)
            assert process_of(swarm, c) is swarm.servers[2]
            common: dict[str, Any] = {
                "initial_peers": swarm.initial_peers,
                "dht_prefix": PROCESS_PREFIX,
            }

            # 1. A stall, found by the request timeout.
            stalling = manager_for(**common, request_timeout_s=3.0)
            async with RemoteSequential(stalling) as seq:
                await wait_for_servers(stalling, 3)
                reference = Reference(model)
                async with seq.open_inference_session(max_length=16) as session:
                    stalling.on_request_failure(a)
                    stalling.on_request_failure(b)
                    await reference.check_step(session, 1, 4)
                    assert [(s.peer_id, s.start, s.end) for s in session.route] == [(c, 0, 6)]
                    stalling.on_request_success(a)
                    stalling.on_request_success(b)
                    await reference.check_step(session, 1, 1)
                    stopped = process_of(swarm, c).process
                    stopped.send_signal(signal.SIGSTOP)
                    try:
                        for _ in range(2):
                            await reference.check_step(session, 1, 1)
                    finally:
                        stopped.send_signal(signal.SIGCONT)
                    assert stalling.is_banned(c)
                    assert [(s.peer_id, s.start, s.end) for s in session.route] == [
                        (a, 0, 3),
                        (b, 3, 6),
                    ]

            # 2. A kill during a session.
            manager = manager_for(**common, request_timeout_s=4.0)
            async with RemoteSequential(manager) as seq:
                await wait_for_servers(manager, 3)
                reference = Reference(model)
                async with seq.open_inference_session(max_length=16) as session:
                    manager.on_request_failure(c)
                    await reference.check_step(session, 2, 4)
                    manager.on_request_success(c)
                    assert [(s.peer_id, s.start, s.end) for s in session.route] == [
                        (a, 0, 3),
                        (b, 3, 6),
                    ]
                    for step in range(1, 11):
                        if step == 6:
                            process_of(swarm, a).kill()
                        await reference.check_step(session, 2, 1)
                    assert manager.is_banned(a)
                    assert [(s.peer_id, s.start, s.end) for s in session.route] == [
                        (c, 0, 3),
                        (b, 3, 6),
                    ]

                # 3. A kill between forward and backward.
                second_half = manager[3:6]
                manager.on_request_failure(c)
                x = torch.randn(2, 3, HIDDEN)
                output, saved = await remote_forward(second_half, x)
                assert [span.peer_id for chunk in saved for span, *_ in chunk] == [b]
                manager.on_request_success(c)
                process_of(swarm, b).kill()
                grad_output = torch.randn_like(output)
                grad_input, _ = await remote_backward(second_half, grad_output, saved)
                assert manager.is_banned(b)
                local_x = x.clone().requires_grad_(True)
                local_output = model.forward(local_x, blocks=range(3, 6))
                assert_close(output, local_output.detach())
                local_output.backward(grad_output)
                assert local_x.grad is not None
                assert_close(grad_input, local_x.grad)

                # 4. Everyone dead: a request fails once its retries are spent.  The peer table
                # still lists C: the first attempt fails on C and bans it; the retry finds no
                # usable server left and names the blocks.
                process_of(swarm, c).kill()
                impatient = RemoteSequenceManager(
                    attrs.evolve(manager.config, max_retries=1, missing_blocks_timeout_s=2.0),
                    N_BLOCKS,
                    state=manager.state,
                )
                with pytest.raises(MissingBlocksError) as missing:
                    await remote_forward(impatient, x)
                assert missing.value.blocks == tuple(range(N_BLOCKS))
                assert impatient.is_banned(c)
                with pytest.raises(MissingBlocksError):
                    async with InferenceSession(impatient, 8) as doomed:
                        await doomed.step(x)
    exit_codes = [process.process.returncode for process in swarm.servers]
    assert exit_codes == [-signal.SIGKILL] * 3


async def test_a_stuck_server_is_replaced_after_the_step_timeout(
    model: Model, tmp_path: Path
) -> None:
    """The server's network answers (so the transport keeps it), but its step never comes."""
    torch.manual_seed(7)
    # Servers that announce about the speed they have: a step's timeout is then about 1 s.
    spans = [(0, 6), (0, 6)]
    async with in_process_swarm(model, tmp_path, spans, throughput=1000.0) as swarm:
        reference = Reference(model)
        with trio.fail_after(DEADLINE_S):
            async with _session_over(
                swarm, min_step_timeout_s=1.0, request_timeout_s=600.0
            ) as session:
                await reference.check_step(session, 1, 4)
                (span,) = session.route
                handlers = swarm.servers[span.peer_id].block_server._inference

                async def never_answer(*args: Any, **kwargs: Any) -> Any:
                    await trio.sleep_forever()

                handlers._step = never_answer  # type: ignore[method-assign]
                began = time.monotonic()
                await reference.check_step(session, 1, 1)
                waited = time.monotonic() - began
                assert session.manager.is_banned(span.peer_id)
                assert [s.peer_id for s in session.route] != [span.peer_id]
                assert waited < 30.0  # the step's timeout, not request_timeout_s
                await reference.check_step(session, 1, 1)


async def test_compressed_steps_travel_in_fewer_bytes_and_stay_close(
    model: Model, tmp_path: Path
) -> None:
    """The client sends blockwise8, the servers answer in float16: outputs stay within the
    schemes' rounding of the local blocks', and the client's steps take far fewer bytes."""
    torch.manual_seed(11)
    spans = [(0, 3), (3, 6)]
    limits = ServingLimits(request_timeout_s=2.0, compression="float16")
    async with in_process_swarm(model, tmp_path, spans, limits=limits) as swarm:
        servers = list(swarm.servers.values())
        x = torch.randn(4, 32, HIDDEN)
        with torch.no_grad():
            expected = model.forward(x)
        sent: dict[str | None, int] = {}
        for compression in (None, "blockwise8"):
            with trio.fail_after(DEADLINE_S):
                async with sequential_over(servers, compression=compression) as seq:
                    manager = seq.sequence_manager
                    # The servers pinged first (for routes), so that only the step is counted.
                    await manager.make_sequence()
                    await wait_until(lambda state=manager.state: len(state.pings) == 2)
                    async with seq.open_inference_session(max_length=40) as session:
                        assert manager.state.dht is not None
                        node = manager.state.dht.node
                        before = node.statistics().bytes_sent
                        output = await session.step(x)
                        sent[compression] = node.statistics().bytes_sent - before
                        assert session.retries == 0
            scale = float(expected.abs().max())
            assert float((output - expected).abs().max()) < 0.05 * scale
        assert sent["blockwise8"] < 0.4 * sent[None]
