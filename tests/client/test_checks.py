"""Checked answers of forward passes: a server whose backend perturbs what it computes (a test
double, never a mode of the shipped server) is caught on its first checked answer, and the
client's outputs and gradients equal an honest swarm's; answers are signed, and a server whose
signature does not match is refused."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from petals_core import PetalsError
from petals_core.client import (
    InferenceSession,
    RemoteSequenceManager,
    RemoteSequential,
    remote_backward,
    remote_forward,
)
from petals_core.client._checks import (
    TOLERANCE,
    agree,
    check_receipt,
    disagreement,
    majority,
    tolerance,
)
from petals_core.server import ServingLimits
from petals_core.testing import make_liar

from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    InProcessSwarm,
    Model,
    add_liar_and_two_honest,
    assert_close,
    in_process_swarm,
    local_grads,
    manager_for,
    sequential_over,
    training_inputs,
    wait_for_servers,
)
from .test_inference import Reference, _give_up_during_step, _hold_steps

#: How much the liar changes its outputs: a fifth of their scale.
LIE = 0.2
#: What bounds a replay's (and a check's) steps.
STEP_BYTES = "petals_core.client._session_core.MAX_STEP_BYTES"


def test_honest_differences_stay_within_the_bound_and_lies_do_not() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 7, HIDDEN)
    assert disagreement(x, x.clone()) == 0.0
    for dtype, bound in TOLERANCE.items():
        rounded = x.to(getattr(torch, dtype)).float()
        assert agree(rounded, x, bound), dtype
    lie = x + LIE * x.abs().mean()
    assert not agree(lie, x, max(TOLERANCE.values()))
    assert disagreement(x, x[:, :3]) == float("inf")
    assert disagreement(x, torch.full_like(x, float("nan"))) == float("inf")
    assert tolerance(None) == max(TOLERANCE.values())


def test_a_third_answer_decides_only_when_it_sides_with_one() -> None:
    assert majority(0.0, 1.0, 0.1) == "first"
    assert majority(1.0, 0.0, 0.1) == "second"
    assert majority(0.0, 0.0, 0.1) is None  # the two differ, and the third is near both
    assert majority(1.0, float("inf"), 0.1) is None


async def _train_beside_a_liar(
    model: Model, tmp_path: Path, lies: tuple[str, ...], rounds: int, **fields: Any
) -> tuple[dict[str, str], str, set[str]]:
    """Three servers hold every block; the liar announces the highest speed, so routes prefer
    it.  ``rounds`` forwards and backwards with deep prompts, each equal to local autograd.
    Returns the servers caught, the liar's PeerID and the servers the last forward saved."""
    x, prompts, grad_output = training_inputs(5, rows=2, length=5)
    expected, expected_grad, expected_prompt_grad = local_grads(model, x, grad_output, prompts)
    assert expected_prompt_grad is not None
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar = await add_liar_and_two_honest(swarm, lies)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(
                list(swarm.servers.values()), max_retries=3, **fields
            ) as seq:
                for _ in range(rounds):
                    output, saved = await remote_forward(seq.sequence_manager, x, prompts)
                    assert_close(output, expected)
                    grad, prompt_grad = await remote_backward(
                        seq.sequence_manager, grad_output, saved, prompts
                    )
                    assert_close(grad, expected_grad)
                    assert prompt_grad is not None
                    assert_close(prompt_grad, expected_prompt_grad)
                used = {span.peer_id for chunk in saved for span, *_ in chunk}
                return dict(seq.sequence_manager.state.caught), liar, used


async def test_a_liar_is_caught_on_its_first_checked_answer(model: Model, tmp_path: Path) -> None:
    """Forward and backward equal local autograd all the same, and the liar is not used again."""
    caught, liar, used = await _train_beside_a_liar(model, tmp_path, ("forward", "step"), 3)
    assert list(caught) == [liar]
    assert "against two other servers" in caught[liar]
    assert liar not in used


async def test_with_checks_off_the_liar_goes_unnoticed(model: Model, tmp_path: Path) -> None:
    """What checks prevent: ``verify="none"`` takes the liar's answers as they are."""
    torch.manual_seed(6)
    x = torch.randn(1, 4, HIDDEN)
    expected = model.forward(x).detach()
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar = await swarm.add((0, N_BLOCKS), throughput=1000.0)
        honest = await swarm.add((0, N_BLOCKS))
        make_liar(liar)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="none") as seq:
                seq.sequence_manager.on_request_failure(str(honest.dht.peer_id))  # route: liar
                output, _ = await remote_forward(seq.sequence_manager, x)
                assert disagreement(output, expected) > max(TOLERANCE.values())
                assert not seq.sequence_manager.state.caught


async def test_two_servers_that_disagree_with_no_third_fail_clearly(
    model: Model, tmp_path: Path
) -> None:
    torch.manual_seed(7)
    x = torch.randn(1, 4, HIDDEN)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar = await swarm.add((0, N_BLOCKS), throughput=1000.0)
        await swarm.add((0, N_BLOCKS))
        make_liar(liar)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(
                list(swarm.servers.values()), verify="all", missing_blocks_timeout_s=1.0
            ) as seq:
                with pytest.raises(PetalsError, match="no third server could decide"):
                    await remote_forward(seq.sequence_manager, x)
                assert not seq.sequence_manager.state.caught  # nobody is blamed without a majority


async def test_honest_answers_are_checked_and_counted(model: Model, tmp_path: Path) -> None:
    """``verify="all"`` over honest servers: every answer checked, nobody caught, outputs exact."""
    torch.manual_seed(8)
    x = torch.randn(2, 3, HIDDEN)
    expected = model.forward(x).detach()
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6), (0, 6)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                for _ in range(4):
                    output, _ = await remote_forward(seq.sequence_manager, x)
                    assert_close(output, expected)
                state = seq.sequence_manager.state
                assert not state.caught
                assert sum(state.verified.values()) >= 8  # each answer and its checker, 4 times


async def test_an_answer_whose_signature_does_not_match_is_refused(
    model: Model, tmp_path: Path
) -> None:
    """A server that signs something else than it answers (forward passes and inference steps):
    its answers are refused and it is banned like a failing server; the forward goes through
    the other server, and the session moves there with its history, both exactly.  The honest
    server is banned for a moment before each, so that the route takes the forger first."""
    torch.manual_seed(9)
    x = torch.randn(1, 4, HIDDEN)
    expected = model.forward(x).detach()
    async with in_process_swarm(model, tmp_path, []) as swarm:
        forger = await swarm.add((0, N_BLOCKS))
        honest = await swarm.add((0, N_BLOCKS))
        forger_id, honest_id = str(forger.dht.peer_id), str(honest.dht.peer_id)
        serving = forger.block_server._serving
        sign = serving.signed

        async def wrong_receipt(*args: Any, **kwargs: Any) -> Any:
            kind, blocks, adapter, asked, _ = args
            return await sign(kind, blocks, adapter, asked, {"other": torch.zeros(1)}, **kwargs)

        serving.signed = wrong_receipt  # type: ignore[method-assign]
        manager = manager_for(
            list(swarm.servers.values()), verify="none", max_retries=10, ban_timeout_s=0.5
        )
        with trio.fail_after(DEADLINE_S):
            async with RemoteSequential(manager) as seq:
                manager = seq.sequence_manager
                await wait_for_servers(manager, 2)
                manager.on_request_failure(honest_id)
                output, saved = await remote_forward(manager, x)
                assert_close(output, expected)
                assert forger_id not in {span.peer_id for chunk in saved for span, *_ in chunk}
                assert forger.block_server.statistics().forwards >= 1  # it answered, refused

                manager.on_request_success(forger_id)
                manager.on_request_failure(honest_id)
                reference = Reference(model)
                async with InferenceSession(manager, 8) as session:
                    for tokens in (3, 1, 1):
                        await reference.check_step(session, 1, tokens)
                    assert session.retries >= 1
                    assert [span.peer_id for span in session.route] == [honest_id]
                assert forger.block_server.statistics().steps >= 1


async def test_a_lying_server_in_a_session_is_caught_and_the_outputs_stay_exact(
    model: Model, tmp_path: Path
) -> None:
    """Inference: the liar's first answer is checked (another server replays the span's inputs),
    a third server decides, and the step moves to a replacement with the session's history: every
    output equals the local blocks'.  Later steps never reach the liar."""
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        liar = await swarm.add((0, N_BLOCKS), throughput=1000.0)
        await swarm.add((0, N_BLOCKS))
        make_liar(liar)
        liar_id = str(liar.dht.peer_id)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), max_retries=3) as seq:
                torch.manual_seed(10)
                reference = Reference(model)
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    for tokens in (4, 1, 1, 2, 1):
                        await reference.check_step(session, 2, tokens)
                    assert liar_id not in {span.peer_id for span in session.route}
                assert list(seq.sequence_manager.state.caught) == [liar_id]


async def test_a_checked_session_is_followed_step_by_step_by_another_server(
    model: Model, tmp_path: Path
) -> None:
    """``verify="all"``: a second server follows the session's span in a session of its own,
    computing each step once (no replays), and every answer is compared with its; rollback and
    beam reordering reach it too, and every output equals the local blocks'."""
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS), (0, N_BLOCKS)]) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                torch.manual_seed(11)
                reference = Reference(model)
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    await reference.check_step(session, 2, 4)
                    for server in swarm.servers.values():
                        assert server.block_server.statistics().sessions == 1
                    await reference.check_step(session, 2, 1)
                    session.position = 3
                    reference.rollback(3)
                    await reference.check_step(session, 2, 2)
                    await reference.check_step(session, 2, 1, hypo_ids=torch.tensor([1, 0]))
                    steps = [s.block_server.statistics().steps for s in swarm.servers.values()]
                    assert steps == [4, 4]
                    # Every answer's receipt is kept, main and follower alike, and checks.
                    assert len(session.receipts) == 2 * 4
                    # The position after each step: 4, 5, then 5 again after the rollback, 6.
                    assert sorted(r.receipt.step for r in session.receipts) == [
                        4,
                        4,
                        5,
                        5,
                        5,
                        5,
                        6,
                        6,
                    ]
                    peers = {str(s.dht.peer_id) for s in swarm.servers.values()}
                    assert {r.peer for r in session.receipts} == peers
                    for kept in session.receipts:
                        check_receipt(kept.receipt, kept.signature, kept.peer)
                        assert kept.receipt.kind == "step" and kept.receipt.blocks == (0, N_BLOCKS)
                state = seq.sequence_manager.state
                assert not state.caught
                assert sum(state.verified.values()) == 2 * 4


async def test_a_follower_slower_than_it_claims_is_dropped_instead_of_holding_the_steps(
    model: Model, tmp_path: Path
) -> None:
    """``verify="all"``: the server following the session answers a step far slower than its
    announced speed allows, well within ``request_timeout_s``: its answer is awaited as long as
    the span's server's would be, then the follower is dropped, and the step's answer (exact)
    stands unchecked instead of waiting for it."""
    spans = [(0, N_BLOCKS)] * 2
    async with in_process_swarm(model, tmp_path, spans, throughput=100.0) as swarm:
        delays: dict[str, float] = {}
        for peer, server in swarm.servers.items():
            inference = server.block_server._inference

            async def delayed(*args: Any, peer: str = peer, original: Any = inference._step) -> Any:
                await trio.sleep(delays.get(peer, 0.0))
                return await original(*args)

            inference._step = delayed
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(
                list(swarm.servers.values()),
                verify="all",
                request_timeout_s=60.0,
                min_step_timeout_s=2.0,
            ) as seq:
                torch.manual_seed(41)
                reference = Reference(model)
                state = seq.sequence_manager.state
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    await reference.check_step(session, 2, 4)
                    (main,) = [span.peer_id for span in session.route]
                    assert state.verified[main] == 1
                    (follower,) = set(swarm.servers) - {main}
                    delays[follower] = 8.0
                    await reference.check_step(session, 2, 1)
                    assert state.verified[main] == 1
                assert not state.caught


@attrs.frozen
class _Checked:
    """A session checking every answer over three servers of all the blocks."""

    swarm: InProcessSwarm
    manager: RemoteSequenceManager
    reference: Reference
    session: InferenceSession


@asynccontextmanager
async def _checked_session(model: Model, tmp_path: Path, seed: int) -> AsyncIterator[_Checked]:
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)] * 3) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                torch.manual_seed(seed)
                reference = Reference(model)
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    yield _Checked(swarm, seq.sequence_manager, reference, session)


def _positions_by_peer(session: InferenceSession) -> dict[str, list[int]]:
    """The positions each server's receipts in ``session`` name, in the order they came."""
    positions: dict[str, list[int]] = {}
    for kept in session.receipts:
        assert kept.receipt.step is not None
        positions.setdefault(kept.peer, []).append(kept.receipt.step)
    return positions


async def test_a_follower_opened_late_catches_up_in_pieces(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify="all"``: the span's server leaves after five positions; its replacement is
    followed by a server opened then, which takes the span's inputs so far in steps of two
    positions (as a long history goes, in steps of MAX_STEP_BYTES), each answered before the
    next, and the step's own (two positions, across the pieces' grid) last; every output equals
    the local blocks', nobody is caught."""
    monkeypatch.setattr(STEP_BYTES, 2 * 2 * HIDDEN * 4)
    async with _checked_session(model, tmp_path, 19) as checked:
        session = checked.session
        for tokens in (4, 1):
            await checked.reference.check_step(session, 2, tokens)
        (first,) = session.route
        before = _positions_by_peer(session)
        await checked.swarm.leave(first.peer_id)
        for tokens in (2, 1):
            await checked.reference.check_step(session, 2, tokens)
        assert session.retries >= 1
        (replacement,) = session.route
        after = _positions_by_peer(session)
        assert not checked.manager.state.caught
    (follower,) = set(after) - {first.peer_id, replacement.peer_id}
    # The replacement's replay and the follower's catch-up (positions 0:5) in pieces.
    added = {peer: after[peer][len(before.get(peer, [])) :] for peer in after}
    assert added[replacement.peer_id] == [2, 4, 5, 7, 8]
    assert added[follower] == [2, 4, 5, 7, 8]


async def test_a_decider_replays_a_long_history_in_pieces(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify="all"``: the span's server lies at its fifth step; the third server that
    decides recomputes the span's inputs from position 0 in steps of two positions (as a long
    history goes, in steps of MAX_STEP_BYTES).  The liar is caught and every output equals the
    local blocks'."""
    monkeypatch.setattr(STEP_BYTES, 2 * 2 * HIDDEN * 4)
    async with _checked_session(model, tmp_path, 20) as checked:
        session = checked.session
        for tokens in (4, 1, 1, 1):
            await checked.reference.check_step(session, 2, tokens)
        (first,) = session.route
        follower = {r.peer for r in session.receipts} - {first.peer_id}
        make_liar(checked.swarm.servers[first.peer_id], lies=("step",))
        await checked.reference.check_step(session, 2, 1)
        positions = _positions_by_peer(session)
        assert list(checked.manager.state.caught) == [first.peer_id]
    (decider,) = set(positions) - {first.peer_id} - follower
    # Inputs 0:8 in four steps; then the replacement (the decider or the follower) goes on.
    assert positions[decider][:4] == [2, 4, 6, 8]


async def test_a_padded_long_prefill_is_checked_piece_by_piece(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left padding longer than a long prefill's first pieces: the span that no other server
    holds whole is checked at every piece by a route of two others (their check sessions as
    long as the padding), and at the step after; nobody is caught."""
    monkeypatch.setattr(STEP_BYTES, 2 * 2 * HIDDEN * 4)
    torch.manual_seed(21)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        whole = str((await swarm.add((0, N_BLOCKS), throughput=1000.0)).dht.peer_id)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    await session.step(torch.randn(2, 7, HIDDEN), padding=torch.tensor([0, 5]))
                    await session.step(torch.randn(2, 1, HIDDEN))
                    assert [span.peer_id for span in session.route] == [whole]
                state = seq.sequence_manager.state
    assert not state.caught
    assert state.verified[whole] == 4 + 1  # (pieces 0:2, 2:4, 4:6, 6:7; the step after)


@attrs.define
class _CheckedByTwo:
    session: InferenceSession
    state: Any  # the manager's state
    whole: str  # the server the session goes through
    checker: str  # the first server of the route that checks it
    delay: float | None  # how long each step the checker takes waits first (None: none)


@asynccontextmanager
async def _checked_by_two(
    model: Model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request_timeout_s: float,
    **manager_fields: Any,
) -> AsyncIterator[_CheckedByTwo]:
    """A session through the one server holding every block, checked by a route of two others
    (``verify="all"``, steps of two positions at most, each announcing a speed of 100 blocks
    per second), with ``request_timeout_s``; setting ``delay`` holds each step the first of
    those two takes."""
    monkeypatch.setattr(STEP_BYTES, 2 * 2 * HIDDEN * 4)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)], throughput=100.0) as swarm:
        checker = next(iter(swarm.servers))
        inference = swarm.servers[checker].block_server._inference
        whole = str((await swarm.add((0, N_BLOCKS), throughput=1000.0)).dht.peer_id)
        with trio.fail_after(DEADLINE_S):
            async with (
                sequential_over(
                    list(swarm.servers.values()),
                    verify="all",
                    request_timeout_s=request_timeout_s,
                    **manager_fields,
                ) as seq,
                InferenceSession(seq.sequence_manager, 16) as session,
            ):
                checked = _CheckedByTwo(
                    session, seq.sequence_manager.state, whole, str(checker), None
                )
                original = inference._step

                async def delayed(*args: Any, **kwargs: Any) -> Any:
                    if checked.delay is not None:
                        await trio.sleep(checked.delay)
                    return await original(*args, **kwargs)

                inference._step = delayed
                yield checked


async def test_a_check_replaying_a_long_history_gives_each_piece_its_time(
    model: Model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The span no other server holds whole is checked by a route of two others, the first of
    them on a slow link: each step it takes lasts a third of ``request_timeout_s``.  Checking
    the step after eight positions replays nine in five steps there, longer in all than
    ``request_timeout_s`` and each well within it, as a replacement's replay is: the check
    completes (the server's answer is verified)."""
    timeout = 3.0
    torch.manual_seed(23)
    async with _checked_by_two(model, tmp_path, monkeypatch, timeout) as checked:
        await checked.session.step(torch.randn(2, 8, HIDDEN))
        assert checked.state.verified[checked.whole] == 4  # (pieces 0:2, 2:4, 4:6, 6:8)
        checked.delay = timeout / 3
        await checked.session.step(torch.randn(2, 1, HIDDEN))
        assert [span.peer_id for span in checked.session.route] == [checked.whole]
    assert checked.state.verified[checked.whole] == 4 + 1
    assert not checked.state.caught


@pytest.mark.parametrize(
    ("request_timeout_s", "manager_fields", "delay"),
    [(2.0, {}, math.inf), (60.0, {"min_step_timeout_s": 2.0}, 8.0)],
    ids=["no answer within request_timeout_s", "far slower than it claims"],
)
async def test_a_checker_that_fails_a_check_is_banned_as_a_failing_server_is(
    model: Model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request_timeout_s: float,
    manager_fields: dict[str, Any],
    delay: float,
) -> None:
    """A server checking a span that does not answer a step within ``request_timeout_s``, or
    answers well within it but far slower than its announced speed allows: the check gives each
    step the time a step of the session that size would have (``answer_timeout``), then gives
    up (the answer stands unchecked), and that server is banned for a while, as one failing a
    step of the session is, so that the next checks go elsewhere; the user's step is not held
    for ``request_timeout_s`` per piece."""
    torch.manual_seed(29)
    async with _checked_by_two(
        model, tmp_path, monkeypatch, request_timeout_s, **manager_fields
    ) as checked:
        await checked.session.step(torch.randn(2, 2, HIDDEN))
        assert checked.state.verified[checked.whole] == 1
        checked.delay = delay
        await checked.session.step(torch.randn(2, 1, HIDDEN))
        assert [span.peer_id for span in checked.session.route] == [checked.whole]
    assert checked.state.verified[checked.whole] == 1
    assert checked.checker in checked.state.bans
    assert not checked.state.caught


async def test_a_server_lying_in_its_gradients_is_caught_before_the_optimiser_sees_them(
    model: Model, tmp_path: Path
) -> None:
    """A server whose forwards are right and whose backwards are not: checked backwards go to
    another server, a third decides, and the gradients equal local autograd."""
    caught, liar, _ = await _train_beside_a_liar(model, tmp_path, ("backward",), 2, verify="all")
    assert list(caught) == [liar]
    assert "backward of blocks 0:6" in caught[liar]


async def test_every_answer_checked_catches_an_occasional_liar_at_its_first_lie(
    model: Model, tmp_path: Path
) -> None:
    """``verify="all"``: the server a session goes through starts lying on a third of its steps
    at random; it is caught at its first lie, and every output equals the local blocks'."""
    async with _checked_session(model, tmp_path, 16) as checked:
        await checked.reference.check_step(checked.session, 2, 3)
        (first,) = checked.session.route
        make_liar(checked.swarm.servers[first.peer_id], lies=("step",), share=0.3, seed=0)
        for _ in range(8):
            await checked.reference.check_step(checked.session, 2, 1)
        assert list(checked.manager.state.caught) == [first.peer_id]


@pytest.mark.parametrize("check", ["followed", "recomputed"])
async def test_a_step_of_no_positions_that_reorders_is_checked_as_empty(
    model: Model, tmp_path: Path, check: str
) -> None:
    """``verify="all"``: a step of no new positions that only reorders the rows (beam search
    between tokens) is checked like any other, by a follower or (the span held whole by no
    other server) by a route of two others recomputing its inputs: both answers are empty,
    nobody is caught, and the steps after it equal the local blocks'."""
    torch.manual_seed(22)
    spans = [(0, N_BLOCKS)] if check == "followed" else [(0, 3), (3, 6)]
    async with in_process_swarm(model, tmp_path, spans) as swarm:
        whole = str((await swarm.add((0, N_BLOCKS), throughput=1000.0)).dht.peer_id)
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                reference = Reference(model)
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    await reference.check_step(session, 2, 3)
                    await reference.check_step(session, 2, 0, hypo_ids=torch.tensor([1, 0]))
                    for _ in range(2):
                        await reference.check_step(session, 2, 1)
                    (span,) = session.route
                    # (Recomputed: the only server of all the blocks is the one route of one span.)
                    assert check == "followed" or span.peer_id == whole
                state = seq.sequence_manager.state
    assert not state.caught
    assert state.verified[span.peer_id] == 4


async def test_a_followed_step_given_up_leaves_no_answer_behind(
    model: Model, tmp_path: Path
) -> None:
    """``verify="all"``: a step is given up (cancelled) while the span's server holds it, its
    follower having been sent it.  Nothing either server sent for it is taken for a later
    step's answer: the steps after it equal the local blocks', and nobody is caught."""
    async with _checked_session(model, tmp_path, 23) as checked:
        session = checked.session
        await checked.reference.check_step(session, 2, 3)
        (span,) = session.route
        entered, release = _hold_steps(checked.swarm.servers[span.peer_id])
        await _give_up_during_step(session, entered, torch.randn(2, 1, HIDDEN))
        release.set()
        for _ in range(2):
            await checked.reference.check_step(session, 2, 1)
        assert not checked.manager.state.caught
        assert not checked.manager.state.bans


async def test_a_followed_session_rolled_back_inside_its_deep_prompts_is_checked_alike(
    model: Model, tmp_path: Path
) -> None:
    """``verify="all"``: deep prompts of 3 positions, a prefill of 5, then back to position 1:
    the follower, like the span, takes the rest of the prompts; nobody is caught, and the
    outputs equal the local blocks'."""
    torch.manual_seed(24)
    prompts = torch.randn(N_BLOCKS, 1, 3, HIDDEN) * 0.5
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)] * 3) as swarm:
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                reference = Reference(model, prompts)
                async with InferenceSession(seq.sequence_manager, 16) as session:
                    await reference.check_step(session, 1, 5, prompts=prompts)
                    session.position = 1
                    reference.rollback(1)
                    for tokens in (1, 3):
                        await reference.check_step(session, 1, tokens)
                state = seq.sequence_manager.state
    assert not state.caught
    assert sum(state.verified.values()) == 2 * 3


async def test_a_padded_batch_is_checked_step_by_step_with_its_padding(
    model: Model, tmp_path: Path
) -> None:
    """Rows of different lengths (left padding): the follower's session is opened with the same
    padding, the step receipts (which sign it) check, nobody is caught, and the outputs equal a
    session's without checks."""
    torch.manual_seed(17)
    steps = [torch.randn(2, 5, HIDDEN), torch.randn(2, 1, HIDDEN), torch.randn(2, 1, HIDDEN)]
    padding = torch.tensor([0, 2])
    outputs: dict[str, list[torch.Tensor]] = {}
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)] * 2) as swarm:
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            for verify in ("none", "all"):
                async with sequential_over(servers, verify=verify) as seq:
                    async with InferenceSession(seq.sequence_manager, 16) as session:
                        outputs[verify] = [
                            await session.step(x, padding=padding if i == 0 else None)
                            for i, x in enumerate(steps)
                        ]
                        assert {r.receipt.padding for r in session.receipts} == {(0, 2)}
                        peers = {r.peer for r in session.receipts}
                    assert not seq.sequence_manager.state.caught
            assert len(peers) == 2  # the span's server and its follower
            for checked, unchecked in zip(outputs["all"], outputs["none"], strict=True):
                assert_close(checked, unchecked)


async def test_a_server_that_compresses_its_answers_is_compared_like_with_like(
    model: Model, tmp_path: Path
) -> None:
    """An honest server sending its answers as blockwise8 (0.7% off, more than float32's bound):
    checked against servers that send theirs as they are, forward, backward and session steps,
    nobody is caught (each answer is compared after the other's compression)."""
    torch.manual_seed(18)
    x, grad = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HIDDEN)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        compressing = await swarm.add(
            (0, N_BLOCKS), throughput=1000.0, limits=ServingLimits(compression="blockwise8")
        )
        for _ in range(2):
            await swarm.add((0, N_BLOCKS))
        with trio.fail_after(DEADLINE_S):
            async with sequential_over(list(swarm.servers.values()), verify="all") as seq:
                for _ in range(2):
                    _, saved = await remote_forward(seq.sequence_manager, x, keep_for_backward=True)
                    await remote_backward(seq.sequence_manager, grad, saved)
                async with InferenceSession(seq.sequence_manager, 8) as session:
                    for tokens in (3, 1, 1):
                        await session.step(torch.randn(2, tokens, HIDDEN))
                assert not seq.sequence_manager.state.caught
                assert compressing.block_server.statistics().forwards >= 1
