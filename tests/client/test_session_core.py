"""The client's session core paired with servers' session states, in memory.

A hypothesis state machine drives one :class:`SessionCore` through steps, rollbacks, beam
reorderings and server failures (also during a replacement's replay), while each span's server
is a :class:`SessionState` beside a simulated computation: its cache is the span's inputs, and
each block adds to every position the running sum of its inputs so far (so an output depends on
everything the cache holds, in order).  What travels between them are the protocol's messages,
including server-to-server pushes of the next span's step.  After every step the outputs must
equal the model computed from scratch over the session's history, and every live server must
hold exactly the inputs the client remembers for its span: failures, replays and pushes change
nothing that can be seen.

Values are small integers in float32, so every sum is exact.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import attrs
import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from petals_core import ServerError
from petals_core.client._session_core import SessionCore, SpanState
from petals_core.protocol import Step, StepResult
from petals_core.routing import RouteSpan
from petals_core.server._session_state import SessionState, StepPlan

BLOCKS = 4
BATCH = 2
HIDDEN = 3
MAX_LENGTH = 10
#: Two positions a step: long histories are replayed, and long steps sent, in several.
STEP_BYTES = 2 * BATCH * HIDDEN * 4


def run_blocks(x: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Blocks ``start .. end - 1`` over every position of ``x`` ``(B, T, H)``: each adds the
    running sum of its inputs (a stand-in for attention over a cache)."""
    for _ in range(start, end):
        x = x + x.cumsum(dim=1)
    return x


@attrs.define(eq=False)
class SimulatedServer:
    """A server's session: the protocol's state plus a cache of the span's inputs."""

    span: RouteSpan
    state: SessionState
    cache: torch.Tensor = attrs.field(factory=lambda: torch.zeros(BATCH, 0, HIDDEN))
    alive: bool = True

    def take(self, step: Step, *, pushed: bool) -> tuple[StepPlan, torch.Tensor] | None:
        """Run ``step`` as the server would: its plan and output (None: a stale push)."""
        plan = self.state.plan(step, pushed=pushed)
        if plan is None:
            return None
        cache = self.cache[:, : plan.position]
        if plan.reorder is not None:
            cache = cache[plan.reorder]
        self.state.rolled_back(plan)
        self.cache = torch.cat([cache, plan.hidden], dim=1)
        return plan, run_blocks(self.cache, self.span.start, self.span.end)[:, plan.position :]


class Swarm:
    """Servers by session id, a random source for routes, and the client's side of the I/O."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.servers: dict[str, SimulatedServer] = {}
        self.peers = 0
        #: Answers waiting for the client, by session id (pushed steps are answered there).
        self.outbox: dict[str, list[StepResult]] = {}
        self.push_losses = 0.0

    def route(self, start: int, end: int) -> list[RouteSpan]:
        """One or two spans covering ``[start, end)``, on new servers."""
        cuts = [start, end]
        if end - start > 1 and self.rng.random() < 0.5:
            cuts.insert(1, self.rng.randrange(start + 1, end))
        spans = []
        for a, b in itertools.pairwise(cuts):
            self.peers += 1
            spans.append(RouteSpan(peer_id=f"peer-{self.peers}", start=a, end=b))
        return spans

    def open(self, core: SessionCore, state: SpanState) -> None:
        opening = core.opening(state, alloc_timeout=0.0, active_adapter=None)
        assert opening.blocks == (state.span.start, state.span.end)
        server_state = SessionState(batch=opening.batch_size, max_length=opening.max_length)
        self.servers[state.session_id] = SimulatedServer(state.span, server_state)
        self.outbox[state.session_id] = []

    def deliver(self, state: SpanState, step: Step) -> None:
        """The client's step to ``state``'s server, and the pushes it causes down the chain."""
        self._take(state.session_id, step, pushed=False)

    def _take(self, session_id: str, step: Step, *, pushed: bool) -> None:
        server = self.servers[session_id]
        if not server.alive:
            raise ServerError("the server is gone")
        taken = server.take(step, pushed=pushed)
        if taken is None:
            return
        plan, output = taken
        onward = SessionState.push_step(plan, output)
        pushed_on = None
        if onward is not None:
            receiver = self.servers.get(plan.push[0].session_id)
            pushed_on = (
                receiver is not None and receiver.alive and self.rng.random() >= self.push_losses
            )
            if pushed_on:
                self._take(plan.push[0].session_id, onward, pushed=True)
        self.outbox[session_id].append(server.state.completed(plan, output, pushed=pushed_on))

    def answer(self, core: SessionCore, index: int) -> StepResult:
        state = core.spans[index]
        server = self.servers.get(state.session_id)
        if server is None or not server.alive:
            raise ServerError("the server is gone")
        while self.outbox[state.session_id]:
            result = self.outbox[state.session_id].pop(0)
            if core.is_answer(index, result):
                return result
        raise ServerError("no answer came")


class PairedSessions(RuleBasedStateMachine):
    """One client session core against its servers' session states."""

    @initialize(seed=st.integers(0, 2**32 - 1), push_losses=st.sampled_from([0.0, 0.5]))
    def start(self, seed: int, push_losses: float) -> None:
        self.swarm = Swarm(seed)
        self.swarm.push_losses = push_losses
        self.core = SessionCore(blocks=range(BLOCKS), max_length=MAX_LENGTH)
        self.history = torch.zeros(BATCH, 0, HIDDEN)  # the session's inputs, as the model sees
        self.generator = torch.Generator().manual_seed(seed)
        self.replay_failures = 0

    # -- the client's side of a step, as the driver runs it (I/O replaced by the swarm) --------

    def _open(self, route: list[RouteSpan], at: int) -> list[SpanState]:
        opened = self.core.route_opened(route, at)
        for state in opened:
            self.swarm.open(self.core, state)
        return opened

    def _replace(self, index: int) -> None:
        core = self.core
        failed, history = core.take_for_replacement(index)
        opened: list[SpanState] = []
        try:
            opened = self._open(self.swarm.route(failed.span.start, failed.span.end), index)
            x = history
            for state in opened:
                if x is None or x.shape[1] == 0:
                    break
                if self.replay_failures:
                    self.replay_failures -= 1
                    self.swarm.servers[state.session_id].alive = False
                outputs = []
                for start, end in core.replay_pieces(x, max_bytes=STEP_BYTES):
                    self.swarm.deliver(state, core.replay(state, x, start, end))
                    result = self.swarm.answer(core, core.spans.index(state))
                    outputs.append(core.replayed(state, x, start, end, result))
                x = torch.cat(outputs, dim=1)
        except ServerError:
            core.replacement_failed(index, failed, history, opened)
            raise

    def _run(
        self,
        hidden: torch.Tensor,
        hypo_ids: torch.Tensor | None,
        fail_at: int | None,
        interrupted: bool = False,
    ) -> torch.Tensor | None:
        """A step of the caller's, in pieces as the driver sends it; ``fail_at``: it fails for
        good during that piece (None: once it is done), and is abandoned (``interrupted``: as
        a cancelled step is, its streams given up)."""
        core, tokens = self.core, hidden.shape[1]
        outputs = []
        pieces = core.step_pieces(hidden, prompts=None, max_bytes=STEP_BYTES)
        for number, (start, end) in enumerate(pieces):
            x = hidden[:, start:end]
            reorder = hypo_ids if start == 0 else None
            output = self._run_piece(x, reorder, start > 0, end < tokens, number == fail_at)
            if output is None:
                core.abandon(interrupted=interrupted)
                assert not interrupted or all(state.stale for state in core.spans)
                return None
            outputs.append(output)
        return torch.cat(outputs, dim=1)

    def _run_piece(
        self,
        hidden: torch.Tensor,
        hypo_ids: torch.Tensor | None,
        continued: bool,
        more: bool,
        fail: bool,
    ) -> torch.Tensor | None:
        """One step message through the chain; with ``fail``, it stops after the first span
        answered (None), as a step that fails for good there."""
        core = self.core
        core.begin(hidden, prompts=None, hypo_ids=hypo_ids, padding=None, continued=continued)
        if not core.spans:
            self._open(self.swarm.route(0, BLOCKS), 0)
        core.start_chain(server_to_server=True)
        x, index = hidden, 0
        while index < len(core.spans):
            if fail and index == 1:
                return None
            state = core.spans[index]
            try:
                if state.stale:  # it may hold a reorder taken back: replayed anew
                    raise ServerError("stale")
                request = core.request(index, x)
                if request is not None:
                    self.swarm.deliver(state, request)
                output = core.answered(index, x, self.swarm.answer(core, index))
            except ServerError:
                core.failed()
                while True:
                    try:
                        self._replace(index)
                        break
                    except ServerError:
                        continue
                continue
            x, index = output, index + 1
        if fail:
            return None
        core.finish(more=more)
        return x

    # -- rules ---------------------------------------------------------------------------------

    @precondition(lambda self: self.core.position < MAX_LENGTH)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        tokens = data.draw(st.integers(1, MAX_LENGTH - self.core.position), label="tokens")
        hypo_ids = None
        if self.core.position and data.draw(st.booleans(), label="reorder"):
            hypo_ids = torch.tensor(
                data.draw(st.lists(st.integers(0, BATCH - 1), min_size=BATCH, max_size=BATCH))
            )
        fail_at = data.draw(st.sampled_from([None, None, 0, 1, 2]), label="fails for good at")
        interrupted = fail_at is not None and data.draw(st.booleans(), label="cancelled")
        hidden = torch.randint(-1, 2, (BATCH, tokens, HIDDEN), generator=self.generator).float()
        output = self._run(hidden, hypo_ids, fail_at, interrupted)
        if output is None:  # the session is as before the step
            assert self.core.position == self.history.shape[1]
            return
        history = self.history if hypo_ids is None else self.history[hypo_ids]
        self.history = torch.cat([history, hidden], dim=1)
        expected = run_blocks(self.history, 0, BLOCKS)[:, -tokens:]
        assert torch.equal(output, expected)

    @precondition(lambda self: self.core.position > 0)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        position = data.draw(st.integers(0, self.core.position), label="position")
        self.core.rollback(position)
        self.history = self.history[:, :position]

    @precondition(lambda self: bool(self.core.spans))
    @rule(data=st.data(), during_replay=st.integers(0, 2))
    def a_server_dies(self, data: st.DataObject, during_replay: int) -> None:
        state = data.draw(st.sampled_from(self.core.spans), label="span")
        server = self.swarm.servers.get(state.session_id)
        if server is not None:
            server.alive = False
        self.replay_failures = during_replay

    @invariant()
    def servers_hold_what_the_client_remembers(self) -> None:
        if not hasattr(self, "core"):
            return
        for state in self.core.spans:
            server = self.swarm.servers.get(state.session_id)
            if server is None or not server.alive or state.gone or state.stale:
                continue  # (a stale span's server may hold a reorder taken back)
            history = self.core.history.get(state.span.start)
            if history is None:
                continue
            position = min(self.core.position, history.shape[1], server.cache.shape[1])
            assert torch.equal(server.cache[:, :position], history[:, :position])

    @invariant()
    def only_the_chain_s_histories_are_kept(self) -> None:
        if not hasattr(self, "core"):
            return
        starts = {state.span.start for state in self.core.spans}
        assert set(self.core.history) <= starts
        assert set(self.core._buffers) <= starts


PairedSessions.TestCase.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)
test_paired_sessions = PairedSessions.TestCase


# -- the core alone --------------------------------------------------------------------------


def _core() -> SessionCore:
    return SessionCore(blocks=range(BLOCKS), max_length=MAX_LENGTH)


def test_the_callers_mistakes_are_refused_before_anything_changes() -> None:
    core = _core()
    hidden = torch.zeros(BATCH, 2, HIDDEN)
    core.begin(hidden, prompts=None, hypo_ids=None, padding=None)
    core.finish()
    for kwargs, match in (
        ({"hidden": torch.zeros(3, 1, HIDDEN)}, "this session has 2 rows"),
        ({"hidden": torch.zeros(BATCH, 1, 4)}, "this session's hidden states are of size 3"),
        ({"hidden": torch.zeros(BATCH, 9, HIDDEN)}, "exceed the session's max_length 10"),
        ({"prompts": torch.zeros(BLOCKS, 1, 1, HIDDEN)}, "deep prompts go with the first step"),
        ({"hypo_ids": torch.tensor([0, 2])}, r"hypo_ids must be \(2,\) integers in \[0, 2\)"),
        ({"hypo_ids": torch.tensor([0.0, 1.0])}, "hypo_ids must be"),
        ({"padding": torch.tensor([0, 0])}, "left padding goes with the first step"),
    ):
        arguments: dict[str, Any] = {
            "hidden": torch.zeros(BATCH, 1, HIDDEN),
            "prompts": None,
            "hypo_ids": None,
            "padding": None,
            **kwargs,
        }
        hidden = arguments.pop("hidden")
        with pytest.raises(ValueError, match=match):
            core.begin(hidden, **arguments)
        assert core.position == 2


def test_deep_prompts_must_fit_the_blocks_the_rows_and_the_first_step() -> None:
    hidden = torch.zeros(BATCH, 2, HIDDEN)
    for shape in ((BLOCKS, 1, 3, HIDDEN), (BLOCKS + 1, 1, 1, HIDDEN), (BLOCKS, 3, 1, HIDDEN)):
        with pytest.raises(ValueError, match="deep prompts must be"):
            _core().begin(hidden, prompts=torch.zeros(shape), hypo_ids=None, padding=None)


def test_a_refused_first_step_leaves_the_batch_open() -> None:
    """A first step refused for its prompts or its padding does not fix the session's batch
    or hidden size: the corrected step may have other rows."""
    core = _core()
    rows = BATCH + 1
    for bad in (
        {"prompts": torch.zeros(BLOCKS, 1, 1, HIDDEN + 1), "padding": None},
        {"prompts": None, "padding": torch.tensor([0.5] * BATCH)},
    ):
        with pytest.raises(ValueError, match=r"deep prompts|padding"):
            core.begin(torch.zeros(BATCH, 2, HIDDEN), hypo_ids=None, **bad)
    assert core.batch is None
    core.begin(torch.zeros(rows, 2, HIDDEN), prompts=None, hypo_ids=None, padding=None)
    assert (core.batch, core.hidden_size) == (rows, HIDDEN)


def test_a_failed_step_takes_its_reorder_back_and_its_spans_are_replayed_anew() -> None:
    core = _core()
    prompts = (
        torch.arange(float(BLOCKS * BATCH)).reshape(BLOCKS, BATCH, 1, 1).expand(-1, -1, 1, HIDDEN)
    )
    first = torch.arange(float(BATCH * 2 * HIDDEN)).reshape(BATCH, 2, HIDDEN)
    core.begin(first, prompts=prompts, hypo_ids=None, padding=torch.tensor([1, 0]))
    (state,) = core.route_opened([RouteSpan(peer_id="a", start=0, end=BLOCKS)], 0)
    core.start_chain(server_to_server=False)
    request = core.request(0, first)
    assert request is not None
    core.answered(0, first, StepResult(hidden_states=first, position=2, step_id=request.step_id))
    core.finish()
    assert core.abandon() == []  # a step that reordered nothing: nothing to take back

    reorder = torch.tensor([1, 1])
    core.begin(torch.zeros(BATCH, 1, HIDDEN), prompts=None, hypo_ids=reorder, padding=None)
    assert torch.equal(core.history[0], first[reorder])
    assert torch.equal(core.prompts, prompts[:, reorder])  # each row keeps its prompt
    assert core.padding == [0, 0]
    assert core.take_for_replacement(0)[0] is state  # it fails, and its replacement too
    (replacement,) = core.route_opened([RouteSpan(peer_id="b", start=0, end=BLOCKS)], 0)
    assert core.abandon() == [replacement]
    assert core.spans == [state] and state.stale
    assert torch.equal(core.history[0], first) and torch.equal(core.prompts, prompts)
    assert core.padding == [1, 0] and core.position == 2


def _answer(core: SessionCore, index: int, x: torch.Tensor) -> None:
    """Span ``index`` takes step ``x`` and answers it with ``x``."""
    request = core.request(index, x)
    assert request is not None
    position = core.position + x.shape[1]
    core.answered(index, x, StepResult(hidden_states=x, position=position, step_id=request.step_id))


def test_histories_of_starts_that_leave_the_chain_are_freed() -> None:
    """A beam step re-routes a's blocks 0:2 over b and c, which answer, and then fails for good
    on d: the chain is a and d again, and the history c's start needed is freed.  A route
    opened anew (new padding at position 0) keeps only its own."""
    core = _core()
    first = torch.ones(BATCH, 2, HIDDEN)
    core.begin(first, prompts=None, hypo_ids=None, padding=None)
    spans = [RouteSpan(peer_id="a", start=0, end=2), RouteSpan(peer_id="d", start=2, end=BLOCKS)]
    core.route_opened(spans, 0)
    core.start_chain(server_to_server=False)
    for index in range(2):
        _answer(core, index, first)
    core.finish()

    step = torch.ones(BATCH, 1, HIDDEN)
    core.begin(step, prompts=None, hypo_ids=torch.tensor([1, 0]), padding=None)
    core.start_chain(server_to_server=False)
    _, x = core.take_for_replacement(0)
    assert x is not None
    route = [RouteSpan(peer_id="b", start=0, end=1), RouteSpan(peer_id="c", start=1, end=2)]
    for state in core.route_opened(route, 0):
        replay = core.replay(state, x, 0, x.shape[1])
        answer = StepResult(hidden_states=x, position=x.shape[1], step_id=replay.step_id)
        x = core.replayed(state, x, 0, x.shape[1], answer)
    for index in range(2):
        _answer(core, index, step)
    assert set(core.history) == set(core._buffers) == {0, 1, 2}
    core.abandon(interrupted=True)  # d failed for good
    assert [state.peer for state in core.spans] == ["a", "d"]
    assert set(core.history) == set(core._buffers) == {0, 2}

    core.rollback(0)
    core.begin(first, prompts=None, hypo_ids=None, padding=torch.tensor([1, 0]))
    core.route_opened([RouteSpan(peer_id="e", start=0, end=BLOCKS)], 0)
    core.start_chain(server_to_server=False)
    _answer(core, 0, first)
    core.finish()
    assert set(core.history) == set(core._buffers) == {0}


def test_padding_at_position_zero_closes_the_open_spans() -> None:
    core = _core()
    hidden = torch.zeros(BATCH, 3, HIDDEN)
    assert not core.begin(hidden, prompts=None, hypo_ids=None, padding=torch.tensor([1, 0]))
    core.route_opened([RouteSpan(peer_id="a", start=0, end=BLOCKS)], 0)
    assert core.opening(core.spans[0], alloc_timeout=1.0, active_adapter=None).left_padding == (
        1,
        0,
    )
    core.finish()
    core.rollback(0)  # new rows may come: the servers hold the old padding
    assert core.begin(hidden, prompts=None, hypo_ids=None, padding=None)
    assert core.spans == []
    with pytest.raises(ValueError, match=r"padding must lie in \[0, 3\]"):
        core.begin(hidden, prompts=None, hypo_ids=None, padding=torch.tensor([4, 0]))


def test_a_gone_span_fails_its_next_request() -> None:
    core = _core()
    hidden = torch.zeros(BATCH, 1, HIDDEN)
    core.begin(hidden, prompts=None, hypo_ids=None, padding=None)
    (state,) = core.route_opened([RouteSpan(peer_id="a", start=0, end=BLOCKS)], 0)
    failed, history = core.take_for_replacement(0)
    assert failed is state and history is None
    core.replacement_failed(0, failed, history, [])
    with pytest.raises(ServerError, match="no server holds blocks 0:4 yet"):
        core.request(0, hidden)


def test_an_answer_that_does_not_fit_the_step_is_the_servers_fault() -> None:
    core = _core()
    hidden = torch.zeros(BATCH, 2, HIDDEN)
    core.begin(hidden, prompts=None, hypo_ids=None, padding=None)
    core.route_opened([RouteSpan(peer_id="a", start=0, end=BLOCKS)], 0)
    core.start_chain(server_to_server=True)
    request = core.request(0, hidden)
    assert request is not None and request.push == ()  # one span: nothing to push on to
    wrong = StepResult(hidden_states=hidden, position=1, step_id=request.step_id)
    with pytest.raises(ServerError, match="expected \\(2, 2, 3\\) at 2"):
        core.answered(0, hidden, wrong)
    stale = StepResult(hidden_states=hidden, position=2, step_id=request.step_id + 1)
    assert not core.is_answer(0, stale)


def test_a_long_step_goes_in_pieces_the_first_holding_the_prompts() -> None:
    core = _core()
    hidden = torch.zeros(BATCH, 7, HIDDEN)
    prompts = torch.zeros(BLOCKS, 1, 3, HIDDEN)
    assert core.step_pieces(hidden, prompts=None, max_bytes=STEP_BYTES) == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 7),
    ]
    assert core.step_pieces(hidden, prompts=prompts, max_bytes=STEP_BYTES) == [
        (0, 3),
        (3, 5),
        (5, 7),
    ]
    # A step that fits one message, or not the session, is one piece (begin judges the latter).
    assert core.step_pieces(hidden[:, :2], prompts=None, max_bytes=STEP_BYTES) == [(0, 2)]
    too_long = torch.zeros(BATCH, MAX_LENGTH + 1, HIDDEN)
    assert core.step_pieces(too_long, prompts=None, max_bytes=STEP_BYTES) == [(0, MAX_LENGTH + 1)]
    assert core.step_pieces(hidden, prompts=None) == [(0, 7)]  # MAX_STEP_BYTES


def test_the_first_piece_of_a_long_step_takes_padding_within_the_whole_step() -> None:
    core = _core()
    first = torch.zeros(BATCH, 2, HIDDEN)
    with pytest.raises(ValueError, match=r"padding must lie in \[0, 2\]"):
        core.begin(first, prompts=None, hypo_ids=None, padding=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"padding must lie in \[0, 7\]"):
        core.begin(first, prompts=None, hypo_ids=None, padding=torch.tensor([0, 8]), length=7)
    core.begin(first, prompts=None, hypo_ids=None, padding=torch.tensor([0, 5]), length=7)
    assert core.padding == [0, 5]


def test_a_model_of_known_hidden_size_refuses_another_from_the_first_step() -> None:
    core = SessionCore(blocks=range(BLOCKS), max_length=MAX_LENGTH, hidden_size=HIDDEN)
    with pytest.raises(ValueError, match=r"hidden states are of size 3; got \(2, 1, 4\)"):
        core.begin(torch.zeros(BATCH, 1, 4), prompts=None, hypo_ids=None, padding=None)
    assert core.batch is None  # nothing changed: a step of the right size is the first
    core.begin(torch.zeros(BATCH, 1, HIDDEN), prompts=None, hypo_ids=None, padding=None)
    assert (core.batch, core.hidden_size) == (BATCH, HIDDEN)
