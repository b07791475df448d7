"""Fraud reports: a caught server's signed answer published in the DHT, and judged by other
clients before they ban it; forged, altered, expired, oversized reports and reports about
correct answers are refused with their reason, and honest servers keep serving."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio
import trio.testing

from petals_core import ReportRefused
from petals_core.client import (
    InferenceSession,
    RemoteSequenceManager,
    RemoteSequential,
    _report_judge,
    remote_forward,
)
from petals_core.client._report_judge import CHECKS_PER_ROUND, MAX_UNDECIDED, judge_listed
from petals_core.client._reports import (
    REPORT_TTL_S,
    ReportBook,
    book_of,
    check_report,
    decode_report,
    encode_report,
    publish,
)
from petals_core.client._sequential import _forward_span
from petals_core.dht import MAX_EVIDENCE_BYTES, Listing, fetch_listings, index_key
from petals_core.protocol import (
    FIRST_STEP,
    FraudReport,
    Receipt,
    Signature,
    StepEvidence,
    digest_tensors,
)
from petals_core.routing import RouteSpan
from petals_core.testing import make_liar
from petals_core.transport import Identity, encode_message

from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    N_BLOCKS,
    InProcessSwarm,
    Model,
    add_liar_and_two_honest,
    assert_close,
    checking_client,
    in_process_swarm,
    manager_for,
    wait_for_servers,
)
from .test_inference import Reference

MODEL = "tiny-llama-hf"


def _signed(
    server: Identity, *, issued: int | None = None, model: str = MODEL, **tensors: torch.Tensor
) -> FraudReport:
    asked = {"hidden_states": tensors.get("asked", torch.ones(1, 2, 4))}
    answered = {"hidden_states": tensors.get("answered", torch.zeros(1, 2, 4))}
    receipt = Receipt(
        kind="forward",
        model=model,
        blocks=(0, 2),
        torch_dtype="float32",
        quant_type="none",
        issued=int(time.time()) if issued is None else issued,
        asked=digest_tensors(asked),
        answered=digest_tensors(answered),
    )
    return _report(server, receipt, receipt.sign(server), asked, answered)


def _report(
    server: Identity,
    receipt: Receipt,
    signature: Signature,
    asked: dict[str, torch.Tensor],
    answered: dict[str, torch.Tensor],
    **session: Any,
) -> FraudReport:
    """The report against ``server`` of the answer its ``receipt`` signed, with the receipt's
    kind, model, blocks and adapter."""
    return FraudReport(
        accused=str(server.peer_id),
        kind=receipt.kind,
        model=receipt.model,
        blocks=receipt.blocks,
        adapter=receipt.adapter,
        signature=signature,
        asked=asked,
        answered=answered,
        **session,
    )


def test_a_report_round_trips_and_checks() -> None:
    server = Identity.generate()
    report = _signed(server)
    decoded = decode_report(encode_report(report))
    assert decoded == report
    assert torch.equal(decoded.answered["hidden_states"], report.answered["hidden_states"])
    check_report(decoded, model=MODEL, now=time.time())


def test_forged_altered_expired_and_foreign_reports_are_refused() -> None:
    server, other = Identity.generate(), Identity.generate()
    report = _signed(server)
    now = time.time()
    cases = [
        (attrs.evolve(report, accused=str(other.peer_id)), "forged: the answer is signed by"),
        (
            attrs.evolve(report, answered={"hidden_states": torch.ones(1, 2, 4)}),
            "forged: .* signature does not cover this question and answer",
        ),
        (attrs.evolve(report, blocks=(0, 3)), "signature does not cover"),
        (
            attrs.evolve(report, signature=_signed(other).signature),
            "forged: the answer is signed by",
        ),
    ]
    for bad, reason in cases:
        with pytest.raises(ReportRefused, match=reason):
            check_report(bad, model=MODEL, now=now)
    with pytest.raises(ReportRefused, match="about model 'tiny-llama-hf', not 'bloom'"):
        check_report(report, model="bloom", now=now)
    old = _signed(server, issued=int(now - REPORT_TTL_S - 60))
    with pytest.raises(ReportRefused, match=r"expired: the answer is 24.0 h old"):
        check_report(old, model=MODEL, now=now)
    future = _signed(server, issued=int(now + 2 * 3600))
    with pytest.raises(ReportRefused, match="in the future"):
        check_report(future, model=MODEL, now=now)


def test_oversized_and_malformed_reports_are_refused() -> None:
    server = Identity.generate()
    big = torch.zeros(1, MAX_EVIDENCE_BYTES // (4 * 64) + 1, 64)
    with pytest.raises(ReportRefused, match="too large to publish"):
        encode_report(_signed(server, answered=big))
    wire = _signed(server).to_wire()
    for changed, reason in [
        ({"kind": "push"}, "only forward, backward, step answers are reported"),
        ({"kind": "step"}, "a step report's session must be text"),
        ({"version": 2}, "version must be 1"),
        ({"blocks": [2, 2]}, "blocks must be"),
        ({"answered": {"grad_inputs": torch.zeros(1)}}, "answered tensors are"),
        ({"asked": {"hidden_states": 1}}, "must be a tensor"),
        ({"signature": {"signer": b"x"}}, "signer must be 32 bytes"),
    ]:
        with pytest.raises(ReportRefused, match=f"malformed: .*{reason}"):
            decode_report(encode_message({**wire, **changed}))
    with pytest.raises(ReportRefused, match="malformed"):
        decode_report(b"\xff" * 10)


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        ({"asked": torch.ones(4)}, r"hidden_states must be \(B, T, hidden\)"),
        ({"asked": torch.ones(0, 2, 4)}, r"hidden_states must be \(B, T, hidden\)"),
        ({"asked": torch.ones(1, 2, 4, dtype=torch.int64)}, "must be floating-point"),
        ({"answered": torch.ones(1, 3, 4)}, r"answer must be \(1, 2, 4\)"),
    ],
)
def test_reports_whose_tensors_do_not_fit_their_question_are_refused(
    tensors: dict[str, torch.Tensor], reason: str
) -> None:
    """Signed by the accused or not, tensors of the wrong shape or dtype never reach a replay."""
    report = _signed(Identity.generate(), **tensors)
    with pytest.raises(ReportRefused, match=f"malformed: .*{reason}"):
        decode_report(encode_report(report))


def test_step_reports_with_prompts_or_row_indices_that_do_not_fit_are_refused() -> None:
    report = _session(Identity.generate(), ((0, 8), (8, 1)))
    wire = report.to_wire()
    bad_rows = {**wire["asked"], "hypo_ids": torch.tensor([0, 5])}
    bad_prompts = {**wire["asked"], "prompts": torch.ones(3, 2, 1, 4)}
    for asked, reason in [(bad_rows, "hypo_ids must be"), (bad_prompts, "prompts must be")]:
        with pytest.raises(ReportRefused, match=reason):
            decode_report(encode_message({**wire, "asked": asked}))


def _session(
    server: Identity, lengths: tuple[tuple[int, int], ...], padding: tuple[int, ...] | None = None
) -> FraudReport:
    """A signed step report of a session whose steps take ``(start, tokens)`` each."""
    issued = int(time.time())
    signed = []
    previous = FIRST_STEP
    for start, tokens in lengths:
        asked = {"hidden_states": torch.randn(2, tokens, 4)}
        answered = {"hidden_states": torch.randn(2, tokens, 4)}
        receipt = Receipt(
            kind="step",
            model=MODEL,
            blocks=(0, 2),
            session="s1",
            padding=padding,
            step=start + tokens,
            previous=previous,
            torch_dtype="float32",
            quant_type="none",
            issued=issued,
            asked=digest_tensors(asked),
            answered=digest_tensors(answered),
        )
        previous = receipt.digest()
        signed.append((receipt, receipt.sign(server, with_asked=True), asked, answered))
    steps = tuple(
        StepEvidence(position=r.step or 0, signature=sig, asked=asked, answered=r.answered)
        for r, sig, asked, _ in signed[:-1]
    )
    receipt, signature, asked, answered = signed[-1]
    return _report(
        server,
        receipt,
        signature,
        asked,
        answered,
        session="s1",
        padding=padding,
        position=receipt.step,
        steps=steps,
    )


def test_a_step_report_carries_its_whole_session_and_checks() -> None:
    server = Identity.generate()
    # A prefill, two tokens, a rollback to 9 and a token again.
    report = _session(server, ((0, 8), (8, 1), (9, 1), (9, 1)), padding=(0, 3))
    decoded = decode_report(encode_report(report))
    assert decoded == report and len(decoded.steps) == 3
    check_report(decoded, model=MODEL, now=time.time())


def test_step_reports_that_do_not_make_one_signed_session_are_refused() -> None:
    server, other = Identity.generate(), Identity.generate()
    report = _session(server, ((0, 8), (8, 1), (9, 1)))
    now = time.time()
    gap = _session(server, ((0, 8), (9, 1)))
    late_start = _session(server, ((2, 8), (10, 1)))
    altered = attrs.evolve(
        report,
        steps=(
            attrs.evolve(report.steps[0], asked={"hidden_states": torch.zeros(2, 8, 4)}),
            report.steps[1],
        ),
    )
    foreign = attrs.evolve(
        report, steps=(_session(other, ((0, 8), (8, 1))).steps[0], report.steps[1])
    )
    # A prefill, the same positions again from 0 with other inputs, a token: reporting the
    # first prefill and the token (as if the token followed it) leaves a hole in the chain.
    resent = _session(server, ((0, 8), (0, 8), (8, 1)))
    skipping = attrs.evolve(resent, steps=resent.steps[:1])
    for bad, reason in [
        (gap, r"step 1 \(to position 10\) does not follow"),
        (late_start, r"step 0 \(to position 10\) does not follow"),
        (altered, "does not cover the step to position 8"),
        (foreign, "does not cover the step to position 8"),
        (attrs.evolve(report, padding=(0, 1)), "signature does not cover this question"),
        (attrs.evolve(report, session="s2"), "signature does not cover this question"),
        (skipping, "not the session's whole chain of receipts"),
        (attrs.evolve(report, steps=report.steps[::-1]), "does not follow"),
    ]:
        with pytest.raises(ReportRefused, match=reason):
            check_report(bad, model=MODEL, now=now)


async def _wait_verdicts(manager: RemoteSequenceManager, count: int) -> None:
    """Judge the model's reports round after round until ``count`` are decided."""
    book = book_of(manager)
    while len(book.verdicts) < count:
        if await judge_listed(manager) == 0:
            await trio.lowlevel.checkpoint()


async def test_a_caught_liar_is_reported_and_other_clients_ban_it_once_confirmed(
    model: Model, tmp_path: Path
) -> None:
    """A client checking every answer catches the liar and publishes its signed answer; another
    client, checking nothing itself, reads the report, has two other servers confirm it, and
    stops using the liar: its outputs are exact."""
    torch.manual_seed(11)
    x = torch.randn(1, 4, HIDDEN)
    expected = model.forward(x).detach()
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar_id = await add_liar_and_two_honest(swarm)
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for(servers, verify="all")) as checking,
                RemoteSequential(manager_for(servers, verify="none")) as trusting,
            ):
                await wait_for_servers(checking.sequence_manager, 3)
                await wait_for_servers(trusting.sequence_manager, 3)
                output, _ = await remote_forward(checking.sequence_manager, x)
                assert_close(output, expected)
                assert liar_id in checking.sequence_manager.state.caught
                await book_of(checking.sequence_manager).wait_published(1)

                await _wait_verdicts(trusting.sequence_manager, 1)
                (verdict,) = book_of(trusting.sequence_manager).verdicts.values()
                reporter = str(checking.sequence_manager.state.dht.peer_id)  # type: ignore[union-attr]
                assert verdict.upheld and verdict.accused == liar_id
                assert verdict.reporters == {reporter}
                reason = trusting.sequence_manager.state.caught[liar_id]
                assert reason.startswith(f"reported by {reporter}: blocks 0:{N_BLOCKS} off by")
                for _ in range(3):
                    output, saved = await remote_forward(trusting.sequence_manager, x)
                    assert_close(output, expected)
                    assert liar_id not in {span.peer_id for span, *_ in saved[0]}


async def test_a_client_leaving_right_after_a_catch_still_publishes_its_report(
    model: Model, tmp_path: Path
) -> None:
    torch.manual_seed(14)
    x = torch.randn(1, 2, HIDDEN)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar_id = await add_liar_and_two_honest(swarm)
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            async with checking_client(servers, x) as checking:
                assert liar_id in checking.state.caught
            # The network part stopped: what it caught was published before its node closed.
            assert book_of(checking).published
            async with RemoteSequential(manager_for(servers, verify="none")) as later:
                await wait_for_servers(later.sequence_manager, 3)
                await _wait_verdicts(later.sequence_manager, 1)
                assert liar_id in later.sequence_manager.state.caught


async def test_a_session_liar_is_reported_with_its_session_and_judged_by_replaying_it(
    model: Model, tmp_path: Path
) -> None:
    """A session that rolls back and reorders its beams, checked step by step: a report on a
    correct step of it is refused (another server replays the session and agrees); then its
    server starts lying, is caught, and the report on its session, every step included, is
    upheld by a client that checks nothing."""
    torch.manual_seed(15)
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)] * 3) as swarm:
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for(servers, verify="all")) as checking,
                RemoteSequential(manager_for(servers, verify="none")) as judging,
            ):
                manager = checking.sequence_manager
                await wait_for_servers(manager, 3)
                await wait_for_servers(judging.sequence_manager, 3)
                reference = Reference(model)
                async with InferenceSession(manager, 16) as session:
                    await reference.check_step(session, 2, 4)
                    await reference.check_step(session, 2, 1)
                    session.position = 3
                    reference.rollback(3)
                    x = torch.randn(2, 2, HIDDEN)
                    hypo_ids = torch.tensor([1, 0])
                    output = await session.step(x, hypo_ids=hypo_ids)
                    assert_close(output, reference.step(x, hypo_ids))
                    (state,) = session._core.spans
                    liar_id = state.peer  # the server the session goes through
                    liar = next(s for s in servers if str(s.dht.peer_id) == liar_id)
                    correct = session._calls[state].report(manager, output)
                    assert correct is not None and len(correct.steps) == 2
                    book = book_of(manager)
                    prefix = manager.config.dht_prefix
                    assert prefix is not None and manager.state.dht is not None
                    await publish(manager.state.dht, prefix, book, correct, now=time.time())
                    await _wait_verdicts(judging.sequence_manager, 1)
                    (refused,) = book_of(judging.sequence_manager).verdicts.values()
                    assert not refused.upheld
                    assert refused.reason.startswith("about a correct answer")

                    make_liar(liar, lies=("step",))
                    await reference.check_step(session, 2, 1)
                    assert liar_id in manager.state.caught
                    await book.wait_published(2)
                await _wait_verdicts(judging.sequence_manager, 2)
                upheld = [
                    v for v in book_of(judging.sequence_manager).verdicts.values() if v.upheld
                ]
                assert len(upheld) == 1 and upheld[0].accused == liar_id
                assert liar_id in judging.sequence_manager.state.caught


async def test_hostile_reports_are_refused_and_frame_no_honest_server(
    model: Model, tmp_path: Path
) -> None:
    """Reports about a correct answer, with an altered answer, under another's name, oversized,
    with missing evidence, and the same report listed twice: each refused with its reason (the
    duplicate judged once), no honest server banned, and the swarm serves as before."""
    torch.manual_seed(12)
    x = torch.randn(1, 3, HIDDEN)
    expected = model.forward(x).detach()
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)] * 3) as swarm:
        servers = list(swarm.servers.values())
        peers = [str(server.dht.peer_id) for server in servers]
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for(servers, verify="none")) as framer,
                RemoteSequential(manager_for(servers, verify="none")) as accomplice,
                RemoteSequential(
                    manager_for(servers, verify="none", reports_period_s=0.05)
                ) as judging,
            ):
                for client in (framer, accomplice, judging):
                    await wait_for_servers(client.sequence_manager, 3)
                manager = framer.sequence_manager
                dht = manager.state.dht
                assert dht is not None
                book = book_of(manager)
                # A correct answer of peers[0], signed by it, reported as it is.
                span = RouteSpan(start=0, end=N_BLOCKS, peer_id=peers[0])
                output, _, honest = await _forward_span(manager, span, x, None, False)
                assert_close(output, expected)
                wrong = {"hidden_states": honest.answered["hidden_states"] + 1.0}
                other_span = attrs.evolve(span, peer_id=peers[1])
                _, _, other_answer = await _forward_span(manager, other_span, x, None, False)
                hostile = [
                    honest,
                    attrs.evolve(honest, answered=wrong),
                    attrs.evolve(other_answer, accused=peers[2]),
                ]
                prefix = manager.config.dht_prefix
                assert prefix is not None
                for report in hostile:
                    await publish(dht, prefix, book, report, now=time.time())
                # The accomplice lists the correct-answer report again, and two that name
                # evidence that is too large or not there.
                digests = [hashlib.sha256(encode_report(r)).digest() for r in hostile]
                listings = [book.published[digest] for digest in digests]
                forged = [
                    attrs.evolve(listings[0], size=MAX_EVIDENCE_BYTES + 1, digest=b"\x01" * 32),
                    attrs.evolve(listings[0], size=1000, digest=b"\x02" * 32),
                    listings[0],
                ]
                await accomplice.sequence_manager.state.dht.store(  # type: ignore[union-attr]
                    index_key(prefix),
                    encode_message({"reports": [listing.to_wire() for listing in forged]}),
                    time.time() + 600,
                    signed=True,
                )
                listed = await fetch_listings(dht, prefix)
                assert len(listed) == 6

                await _wait_verdicts(judging.sequence_manager, 5)
                verdicts = book_of(judging.sequence_manager).verdicts
                reasons = {digest: v.reason for (digest, _, _), v in verdicts.items()}
                assert not any(v.upheld for v in verdicts.values())
                assert len(verdicts[listings[0].key].reporters) == 2  # judged once
                assert reasons[listings[0].digest].startswith("about a correct answer")
                assert "signature does not cover" in reasons[listings[1].digest]
                assert "forged: the answer is signed by" in reasons[listings[2].digest]
                assert reasons[b"\x01" * 32].startswith("oversized")
                assert reasons[b"\x02" * 32] == (
                    "undecided in 3 tries: its evidence is not (all) in the DHT"
                )
                assert not judging.sequence_manager.state.caught
                output, _ = await remote_forward(judging.sequence_manager, x)
                assert_close(output, expected)


def test_a_listing_names_who_is_accused_and_what_evidence() -> None:
    listing = Listing(reporter="r", accused="a", digest=b"\x00" * 32, size=5, issued=7)
    assert listing.to_wire() == {"accused": "a", "digest": b"\x00" * 32, "size": 5, "issued": 7}


def _judge_drawing_first(swarm: InProcessSwarm, accused: str, first: str) -> RemoteSequenceManager:
    """A client checking nothing whose draw of judges for reports about ``accused`` puts
    ``first`` first of the swarm's other servers (a judge's key is its own secret: here one is
    picked that pins down the draw)."""
    others = [peer for peer in swarm.servers if peer != accused]
    judge = manager_for(list(swarm.servers.values()), verify="none")
    judge.state.reports = next(
        book
        for book in (ReportBook() for _ in range(200))
        if min(others, key=book.checkers_rank(accused)) == first
    )
    return judge


async def test_the_servers_asked_to_judge_are_the_judges_draw_not_the_loudest(
    model: Model, tmp_path: Path
) -> None:
    """Two colluding servers announce a high throughput and answer the reported questions alike
    but wrongly, to frame an honest server with reports about its correct answers.  A judge draws
    the servers it asks by its own keyed rank, whatever they announce (here a judge whose rank
    puts the third honest server first): both reports are refused, and the honest server stays
    in use."""
    torch.manual_seed(3)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        victim = await swarm.add((0, N_BLOCKS))
        honest = await swarm.add((0, N_BLOCKS))
        colluders = [await swarm.add((0, N_BLOCKS), throughput=1000.0) for _ in range(2)]
        servers = list(swarm.servers.values())
        victim_id, honest_id = str(victim.dht.peer_id), str(honest.dht.peer_id)
        judge = _judge_drawing_first(swarm, victim_id, honest_id)
        book = book_of(judge)
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for(servers, verify="none")) as framer,
                RemoteSequential(judge) as judging,
            ):
                await wait_for_servers(framer.sequence_manager, 4)
                await wait_for_servers(judging.sequence_manager, 4)
                manager = framer.sequence_manager
                span = RouteSpan(start=0, end=N_BLOCKS, peer_id=victim_id)
                correct = [
                    (await _forward_span(manager, span, torch.randn(1, 3, HIDDEN), None, False))[2]
                    for _ in range(2)
                ]
                for colluder in colluders:
                    make_liar(colluder, lies=("forward",))
                prefix, dht = manager.config.dht_prefix, manager.state.dht
                assert prefix is not None and dht is not None
                for report in correct:
                    await publish(dht, prefix, book_of(manager), report, now=time.time())
                await _wait_verdicts(judging.sequence_manager, 2)
                for verdict in book.verdicts.values():
                    assert not verdict.upheld
                    assert verdict.reason.startswith(
                        f"about a correct answer: {honest_id} computed the same"
                    )
                assert victim_id not in judging.sequence_manager.state.caught


async def test_a_listing_that_names_a_report_wrongly_does_not_stand_for_it(
    model: Model, tmp_path: Path
) -> None:
    """A stranger lists a genuine report's evidence against an honest server and dated far
    ahead, and again with a wrong size: each such listing is refused on its own, remembered no
    longer than a report counts, and the genuine report is upheld (before, whichever listing the
    DHT gave first stood for the evidence, and its refusal lasted 146 billion years)."""
    torch.manual_seed(5)
    x = torch.randn(1, 2, HIDDEN)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar_id = await add_liar_and_two_honest(swarm)
        servers = list(swarm.servers.values())
        honest = [peer for peer in swarm.servers if peer != liar_id]
        with trio.fail_after(DEADLINE_S):
            async with checking_client(servers, x) as checking:
                reporter = book_of(checking)
                await reporter.wait_published(1)
                (genuine,) = reporter.published.values()
                prefix = checking.config.dht_prefix
                assert prefix is not None
                async with (
                    RemoteSequential(manager_for(servers, verify="none")) as stranger,
                    RemoteSequential(manager_for(servers, verify="none")) as judging,
                ):
                    for client in (stranger, judging):
                        await wait_for_servers(client.sequence_manager, 3)
                    dht = stranger.sequence_manager.state.dht
                    assert dht is not None
                    wrong = [
                        attrs.evolve(genuine, accused=honest[0], issued=2**62),
                        attrs.evolve(genuine, size=genuine.size + 1),
                    ]
                    await dht.store(
                        index_key(prefix),
                        encode_message({"reports": [listing.to_wire() for listing in wrong]}),
                        time.time() + 600,
                        signed=True,
                    )
                    assert len(await fetch_listings(dht, prefix)) == 3
                    verdicts = book_of(judging.sequence_manager).verdicts
                    while genuine.key not in verdicts or wrong[0].key not in verdicts:
                        await judge_listed(judging.sequence_manager)
                    assert verdicts[genuine.key].upheld
                    assert liar_id in judging.sequence_manager.state.caught
                    assert verdicts[wrong[0].key].reason == (
                        f"the evidence is about {liar_id}, but listed against {honest[0]}"
                    )
                    # Judged before the liar was banned, or not at all after.
                    if wrong[1].key in verdicts:
                        assert "does not match its digest" in verdicts[wrong[1].key].reason
                    assert not any(peer in judging.sequence_manager.state.caught for peer in honest)
                    latest = time.time() + REPORT_TTL_S
                    assert all(verdict.expires <= latest for verdict in verdicts.values())


async def test_listings_dated_1970_are_judged_once_not_in_a_loop(
    model: Model, tmp_path: Path
) -> None:
    """Listings of evidence that is not there, dated at 0: refused after the rounds a report may
    stay undecided, and remembered for as long as a report counts from now (before, their
    verdicts expired at once and were judged again, round after round without a pause)."""
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)]) as swarm:
        servers = list(swarm.servers.values())
        (victim,) = swarm.servers
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for(servers, verify="none")) as stranger,
                RemoteSequential(
                    manager_for(servers, verify="none", reports_period_s=0.05)
                ) as judging,
            ):
                for client in (stranger, judging):
                    await wait_for_servers(client.sequence_manager, 1)
                manager = stranger.sequence_manager
                prefix, dht = manager.config.dht_prefix, manager.state.dht
                assert prefix is not None and dht is not None
                fakes = [
                    Listing(reporter="", accused=victim, digest=bytes([i]) * 32, size=100, issued=0)
                    for i in range(CHECKS_PER_ROUND + 1)
                ]
                await dht.store(
                    index_key(prefix),
                    encode_message({"reports": [fake.to_wire() for fake in fakes]}),
                    time.time() + 600,
                    signed=True,
                )
                await _wait_verdicts(judging.sequence_manager, len(fakes))
                book = book_of(judging.sequence_manager)
                soonest = time.time() + REPORT_TTL_S - 600
                for verdict in book.verdicts.values():
                    assert verdict.reason == (
                        f"undecided in {MAX_UNDECIDED} tries: its evidence is not (all) in the DHT"
                    )
                    assert verdict.expires > soonest
                assert await judge_listed(judging.sequence_manager) == 0
                assert len(book.verdicts) == len(fakes) and not book.undecided


async def test_an_answer_is_judged_in_the_dtype_its_server_signed(
    model: Model, tmp_path: Path
) -> None:
    """An honest server's bfloat16 answer, reported after the server restarted in float32 with
    the same key: the judge asks a server computing in bfloat16, as the receipt says, and
    refuses the report as about a correct answer (judged by float32 servers against float32's
    bound, it had the honest server banned)."""
    torch.manual_seed(4)
    x = torch.randn(1, 3, HIDDEN)
    key = str(tmp_path / "victim.key")
    async with in_process_swarm(model, tmp_path, [(0, N_BLOCKS)] * 2) as swarm:
        await swarm.add((0, N_BLOCKS), torch_dtype="bfloat16")
        victim = await swarm.add((0, N_BLOCKS), torch_dtype="bfloat16", identity_path=key)
        victim_id = str(victim.dht.peer_id)
        with trio.fail_after(DEADLINE_S):
            async with RemoteSequential(
                manager_for(list(swarm.servers.values()), verify="none")
            ) as framer:
                manager = framer.sequence_manager
                await wait_for_servers(manager, 4)
                span = RouteSpan(start=0, end=N_BLOCKS, peer_id=victim_id)
                _, _, answer = await _forward_span(manager, span, x, None, False)
                assert answer.signature.torch_dtype == "bfloat16"
                await swarm.leave(victim_id)
                again = await swarm.add((0, N_BLOCKS), torch_dtype="float32", identity_path=key)
                assert str(again.dht.peer_id) == victim_id
                prefix, dht = manager.config.dht_prefix, manager.state.dht
                assert prefix is not None and dht is not None
                await publish(dht, prefix, book_of(manager), answer, now=time.time())
                async with RemoteSequential(
                    manager_for(list(swarm.servers.values()), verify="none")
                ) as judging:
                    await wait_for_servers(judging.sequence_manager, 4)
                    await _wait_verdicts(judging.sequence_manager, 1)
                    (verdict,) = book_of(judging.sequence_manager).verdicts.values()
                    assert not verdict.upheld
                    assert verdict.reason.startswith("about a correct answer")
                    assert victim_id not in judging.sequence_manager.state.caught


async def test_a_judge_passes_over_a_drawn_server_that_fails(model: Model, tmp_path: Path) -> None:
    """The server first in a judge's draw fails every forward (a test double): the judge asks
    the next ones in its draw and upholds the report in the same round, instead of leaving it
    undecided until it is refused."""
    torch.manual_seed(16)
    x = torch.randn(1, 2, HIDDEN)
    async with in_process_swarm(model, tmp_path, []) as swarm:
        liar_id = await add_liar_and_two_honest(swarm)
        broken = await swarm.add((0, N_BLOCKS))
        broken_id = str(broken.dht.peer_id)
        servers = list(swarm.servers.values())
        judge = _judge_drawing_first(swarm, liar_id, broken_id)
        book = book_of(judge)
        with trio.fail_after(DEADLINE_S):
            async with checking_client(servers, x) as checking:
                await book_of(checking).wait_published(1)
                backend = broken.backend
                assert backend is not None

                def failing(*args: object, **kwargs: object) -> None:
                    raise RuntimeError("this server's device fails")

                backend.forward_block = failing  # type: ignore[method-assign,assignment]
                async with RemoteSequential(judge) as judging:
                    await wait_for_servers(judging.sequence_manager, 4)
                    while not book.verdicts:
                        await judge_listed(judging.sequence_manager)
                    (verdict,) = book.verdicts.values()
                    assert verdict.upheld and broken_id not in verdict.reason
                    assert liar_id in judging.sequence_manager.state.caught
                    assert not book.undecided


async def test_rounds_of_judging_never_overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watcher's round and a caller's share the book one after the other: two at once would
    try the same listing, and the one left undecided would undo the other's verdict."""
    manager = manager_for(initial_peers=["/ip4/127.0.0.1/udp/9/quic-v1"], dht_prefix="model")
    inside = most = rounds = 0

    async def one_round(manager: Any, book: ReportBook) -> int:
        nonlocal inside, most, rounds
        inside += 1
        most = max(most, inside)
        await trio.testing.wait_all_tasks_blocked()  # the other round gets every chance to start
        inside -= 1
        rounds += 1
        return 0

    monkeypatch.setattr(_report_judge, "_judge_round", one_round)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(judge_listed, manager)
    assert (rounds, most) == (3, 1)
