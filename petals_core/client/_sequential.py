"""Forward and backward through remote blocks, for fine-tuning (async core).

Routes are sampled by throughput (``max_throughput``), so that concurrent requests spread over
the servers.  A batch larger than ``max_chunk_tokens`` is split along its rows into chunks sent
concurrently, each with its own route.  A span that fails is retried from its first block on a
new route (the spans before it are kept), with the sequence manager's backoff and ban.

Backward walks the spans of the forward in reverse: each server returns the gradient of its
input (and of its deep prompts), recomputing its forward from the inputs the client kept.  A
forward made for a backward (``keep_for_backward``) asks each server to keep its autograd graph:
a server that did answers with a token, and the backward that names it skips the recomputation
(the server still checks the inputs, and recomputes if its graph is gone).  When a span's server
is gone, its blocks are routed anew and the forward is recomputed on the new route for those
blocks only, then the backward continues there.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import torch
import trio

from .._errors import CodecError, PetalsError, ReceiptError, ServerError
from .._groups import run_concurrently
from ..dht import ServerInfo
from ..protocol import (
    BACKWARD,
    FORWARD,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    FraudReport,
    Signature,
    prompts_fit,
    receive_tensors,
    send_tensors,
)
from ..routing import MissingBlocksError, RouteSpan
from ..transport import as_received, compress_floats, open_call
from ._checks import check_receipt, compare, hops_allowance, majority, tolerance
from ._placement import describe, like, to_wire
from ._reports import book_of
from ._second_opinions import other_route
from ._sequence_manager import RemoteSequenceManager
from ._span_call import RETRIABLE

__all__ = ["remote_backward", "remote_forward"]

logger = logging.getLogger(__name__)

#: Rows x tokens per forward / backward request before the batch is split.
DEFAULT_MAX_CHUNK_TOKENS = 16384
_MAX_ELEMENTS = 1 << 30

#: What a forward keeps for its backward: per span, the span, its input and the server's token
#: for the graph it kept (None if it kept none).
Saved = list[tuple[RouteSpan, torch.Tensor, str | None]]
_Reply = TypeVar("_Reply", ForwardReply, BackwardReply)


async def _call(
    manager: RemoteSequenceManager, span: RouteSpan, request: ForwardRequest | BackwardRequest
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Send ``request`` to ``span``'s server; the reply's meta and tensors."""
    connection = await manager.connect(span.peer_id)
    method = FORWARD if isinstance(request, ForwardRequest) else BACKWARD
    with trio.fail_after(manager.config.request_timeout_s):
        async with open_call(connection, method) as call:
            # The end of our side goes with the last part: the server answers (and stops
            # reading) once it has that part, and an end sent later would meet a closed stream.
            await send_tensors(
                call.send,
                *request.to_wire(),
                last=functools.partial(call.send, eof=True),
                encode_part=functools.partial(compress_floats, scheme=manager.config.compression),
            )
            return await receive_tensors(call.receive, max_elements=_MAX_ELEMENTS)


def _parse_reply(
    parse: Callable[[dict[str, Any], dict[str, torch.Tensor]], _Reply],
    span: RouteSpan,
    what: str,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> _Reply:
    """A server's reply; a malformed one is the server's failure (:class:`ServerError`: the
    call is sent elsewhere), as one of the wrong shape is."""
    try:
        return parse(meta, tensors)
    except CodecError as exc:
        raise ServerError(f"server {span.peer_id} returned a malformed {what}: {exc}") from None


def _check_receipt(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    request: ForwardRequest | BackwardRequest,
    answered: dict[str, torch.Tensor | None],
    signature: Signature | None,
) -> FraudReport:
    """The evidence of ``span``'s answer, once its receipt's signature checks (else
    :class:`ReceiptError`): what we sent as the server decoded it, what we received, and the
    signature over both; a fraud report if the answer turns out wrong."""
    scheme = manager.config.compression
    asked = {
        name: as_received(tensor, scheme)
        for name, tensor in request.to_wire()[1].items()
        if tensor is not None
    }
    kind = "forward" if isinstance(request, ForwardRequest) else "backward"
    if signature is None:
        raise ReceiptError(f"server {span.peer_id} answered a {kind} without a receipt")
    assert manager.config.dht_prefix is not None
    report = FraudReport(
        accused=span.peer_id,
        kind=kind,
        model=manager.config.dht_prefix,
        blocks=(span.start, span.end),
        adapter=request.active_adapter,
        signature=signature,
        asked=asked,
        answered={name: tensor for name, tensor in answered.items() if tensor is not None},
    )
    check_receipt(
        report.receipt, signature, span.peer_id, announced=manager.server_info(span.peer_id)
    )
    return report


def _prompts_for(
    manager: RemoteSequenceManager, prompts: torch.Tensor | None, span: RouteSpan
) -> torch.Tensor | None:
    if prompts is None:
        return None
    base = manager.block_indices.start
    return prompts[span.start - base : span.end - base]


async def _with_retries(
    manager: RemoteSequenceManager, what: str, attempt: list[int], action: Any
) -> Any:
    while True:
        try:
            return await action()
        except RETRIABLE as exc:
            peer = getattr(exc, "_petals_peer", None)
            await _failed_attempt(manager, attempt, peer, what, exc, "%s: %r; retrying", what, exc)


async def _failed_attempt(
    manager: RemoteSequenceManager,
    attempt: list[int],
    peer: str | None,
    what: str,
    exc: BaseException,
    *warning: object,
) -> None:
    """Count a failed attempt at ``what`` (against ``peer``, if known): raise once the attempts
    are spent, else log ``warning`` (a message and its arguments) and wait before the next."""
    attempt[0] += 1
    manager.on_request_failure(peer)
    if not manager.may_retry(attempt[0]):
        raise PetalsError(
            f"{what} failed after {attempt[0]} attempt(s); last error: {type(exc).__name__}: {exc}"
        ) from exc
    logger.warning(*warning)
    await trio.sleep(manager.retry_delay(attempt[0]))


async def _forward_span(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    keep: bool,
) -> tuple[torch.Tensor, str | None, FraudReport]:
    """``span``'s answer to ``hidden``: the output, the token of the graph its server kept, and
    the evidence of the answer."""
    request = ForwardRequest(
        blocks=(span.start, span.end),
        active_adapter=manager.config.active_adapter,
        hidden_states=hidden,
        prompts=_prompts_for(manager, prompts, span),
        keep_for_backward=keep,
    )
    try:
        began = trio.current_time()
        meta, tensors = await _call(manager, span, request)
        manager.on_forward_measured(
            span.peer_id,
            tokens=hidden.shape[0] * hidden.shape[1],
            blocks=span.end - span.start,
            seconds=trio.current_time() - began,
        )
        reply = _parse_reply(ForwardReply.from_wire_untrusted, span, "forward", meta, tensors)
        if reply.hidden_states.shape != hidden.shape:
            raise ServerError(f"server {span.peer_id} returned a forward of the wrong shape")
        evidence = _check_receipt(
            manager, span, request, {"hidden_states": reply.hidden_states}, reply.receipt
        )
    except RETRIABLE as exc:
        exc._petals_peer = span.peer_id  # type: ignore[union-attr]
        raise
    manager.on_request_success(span.peer_id)
    return reply.hidden_states.to(hidden.dtype), reply.kept, evidence


async def _forward_blocks(
    manager: RemoteSequenceManager,
    start: int,
    end: int,
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    attempt: list[int],
    *,
    keep: bool,
) -> tuple[torch.Tensor, Saved]:
    """``hidden`` through blocks ``[start, end)``; a failed span is rerouted from its start."""
    saved: Saved = []
    x = hidden
    block = start
    while block < end:
        route = await _with_retries(
            manager,
            "routing",
            attempt,
            lambda b=block: manager.make_sequence(
                b, end, mode="max_throughput", max_length=hidden.shape[1]
            ),
        )
        try:
            for span in route:
                output, token, evidence = await _forward_span(manager, span, x, prompts, keep)
                entries: Saved = [(span, x, token)]
                if manager.should_verify(span.peer_id):
                    output, entries = await _verify_forward(
                        manager, span, x, prompts, output, entries, keep, evidence
                    )
                saved.extend(entries)
                x = output
                block = span.end
        except RETRIABLE as exc:
            attempt[0] += 1
            manager.on_request_failure(getattr(exc, "_petals_peer", None))
            if not manager.may_retry(attempt[0]):
                raise PetalsError(
                    f"forward failed after {attempt[0]} attempt(s); last error: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            logger.warning("forward through blocks %d:%d failed: %r; rerouting", block, end, exc)
            await trio.sleep(manager.retry_delay(attempt[0]))
    return x, saved


async def _recompute(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    keep: bool,
    exclude: set[str],
    like: ServerInfo | None,
    *,
    wait: bool = False,
) -> tuple[torch.Tensor, Saved, list[FraudReport]]:
    """``span``'s blocks on ``hidden`` through other servers (not ``exclude``; of ``like``'s
    dtype and quantisation; drawn as :func:`other_route` draws them), unchecked, and the
    evidence of each one's answer; waiting for such servers (up to the manager's
    ``missing_blocks_timeout_s``) only if ``wait``."""
    route = await other_route(manager, span, exclude, like, wait=wait, max_length=hidden.shape[1])
    return await _forward_along(manager, route, hidden, prompts, keep)


async def _forward_along(
    manager: RemoteSequenceManager,
    route: list[RouteSpan],
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    keep: bool,
) -> tuple[torch.Tensor, Saved, list[FraudReport]]:
    """``hidden`` through ``route``'s servers in turn, unchecked: the output, what to keep for
    the backward, and the evidence of each one's answer."""
    saved: Saved = []
    evidence: list[FraudReport] = []
    x = hidden
    for other in route:
        output, token, answer = await _forward_span(manager, other, x, prompts, keep)
        saved.append((other, x, token))
        evidence.append(answer)
        x = output
    return x, saved, evidence


async def _verify_forward(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    hidden: torch.Tensor,
    prompts: torch.Tensor | None,
    output: torch.Tensor,
    entries: Saved,
    keep: bool,
    evidence: FraudReport,
) -> tuple[torch.Tensor, Saved]:
    """Check ``span``'s answer (``output``) against other servers holding its blocks: the answer
    to use and what to keep for the backward.  Another server recomputes it; if they disagree, a
    third decides, and the server in the minority is caught (never used again, and reported with
    ``evidence``, or the other's).  Where no other server can recompute it, the answer stands
    unchecked."""
    info = manager.server_info(span.peer_id)
    bound = tolerance(info)
    exclude = {span.peer_id}
    try:
        second, second_saved, second_evidence = await _recompute(
            manager, span, hidden, prompts, keep, exclude, info
        )
    except (MissingBlocksError, *RETRIABLE) as exc:
        logger.info(
            "could not check %s on blocks %d:%d: %r", span.peer_id, span.start, span.end, exc
        )
        return output, entries
    checkers = {other.peer_id for other, _, _ in second_saved}
    mine, theirs = evidence.signature, second_evidence[-1].signature
    seconds = [answer.signature for answer in second_evidence]
    off = compare(output, mine, second, theirs)
    if off <= bound + hops_allowance(seconds):
        for peer in {span.peer_id} | checkers:
            manager.on_verified(peer)
        return output, entries
    try:
        # A disagreement needs a decider: worth waiting for one.
        third, third_saved, third_evidence = await _recompute(
            manager, span, hidden, prompts, keep, exclude | checkers, info, wait=True
        )
    except (MissingBlocksError, *RETRIABLE) as exc:
        raise PetalsError(
            f"servers {span.peer_id} and {', '.join(sorted(checkers))} computed blocks "
            f"{span.start}:{span.end} differently (relative difference "
            f"{off:.3g}, bound {bound:.3g}) and no third server could "
            f"decide: {exc!r}"
        ) from exc
    why = f"blocks {span.start}:{span.end} off by {off:.3g} (bound {bound:.3g})"
    thirds = [answer.signature for answer in third_evidence]
    side = majority(
        compare(third, thirds[-1], output, mine),
        compare(third, thirds[-1], second, theirs),
        bound + hops_allowance(seconds) + hops_allowance(thirds),
    )
    if side == "second":
        manager.on_caught(span.peer_id, f"{why} against two other servers")
        book_of(manager).report(evidence)
        return second, second_saved
    if side == "first":
        if len(second_saved) == 1:
            manager.on_caught(second_saved[0][0].peer_id, f"{why} against two other servers")
            book_of(manager).report(second_evidence[0])
        manager.on_verified(span.peer_id)
        return output, entries
    raise PetalsError(
        f"servers disagree on {why} and no majority decides "
        f"({span.peer_id}; {', '.join(sorted(checkers))}; "
        f"{', '.join(sorted(s.peer_id for s, _, _ in third_saved))})"
    )


async def remote_forward(
    manager: RemoteSequenceManager,
    hidden: torch.Tensor,
    prompts: torch.Tensor | None = None,
    *,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
    keep_for_backward: bool = False,
) -> tuple[torch.Tensor, list[Saved]]:
    """Run ``(B, T, hidden)`` through the manager's blocks; returns the output and, per row
    chunk, what the backward needs.  ``keep_for_backward``: a :func:`remote_backward` follows;
    servers may keep their graphs for it.

    ``hidden`` and ``prompts`` may live on any device, in any floating-point dtype; the output
    is on the device and in the dtype of ``hidden`` (what is kept for the backward stays on the
    CPU, as sent)."""
    home = hidden
    hidden = to_wire(hidden, "hidden states")
    if prompts is not None:
        prompts = to_wire(prompts, "deep prompts")
    _check_inputs(manager, hidden, prompts, "hidden states")
    chunks = _row_chunks(hidden, max_chunk_tokens)
    outputs: list[torch.Tensor | None] = [None] * len(chunks)
    saved: list[Saved] = [[] for _ in chunks]
    start, end = manager.block_indices.start, manager.block_indices.stop

    async def run(i: int, rows: slice) -> None:
        chunk_prompts = _rows_of_prompts(prompts, rows, hidden.shape[0])
        outputs[i], saved[i] = await _forward_blocks(
            manager, start, end, hidden[rows], chunk_prompts, [0], keep=keep_for_backward
        )

    await _run_chunks(run, chunks)
    return like(torch.cat([o for o in outputs if o is not None]), home), saved


async def remote_backward(
    manager: RemoteSequenceManager,
    grad_output: torch.Tensor,
    saved: list[Saved],
    prompts: torch.Tensor | None = None,
    *,
    max_chunk_tokens: int = DEFAULT_MAX_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the input (and of the deep prompts) of a :func:`remote_forward`: the
    first on the device and in the dtype of ``grad_output``, the second in those of
    ``prompts``."""
    home, home_prompts = grad_output, prompts
    grad_output = to_wire(grad_output, "grad_output")
    if prompts is not None:
        prompts = to_wire(prompts, "deep prompts")
    _check_inputs(manager, grad_output, prompts, "grad_output")
    chunks = _row_chunks(grad_output, max_chunk_tokens)
    if len(chunks) != len(saved) or any(
        entries and grad_output[rows].shape != entries[0][1].shape
        for rows, entries in zip(chunks, saved, strict=True)
    ):
        raise ValueError(
            f"grad_output ({tuple(grad_output.shape)}) does not match the saved forward's output"
        )
    grads: list[torch.Tensor | None] = [None] * len(chunks)
    prompt_grads: list[torch.Tensor | None] = [None] * len(chunks)

    async def run(i: int, rows: slice) -> None:
        chunk_prompts = _rows_of_prompts(prompts, rows, grad_output.shape[0])
        grads[i], prompt_grads[i] = await _backward_chunk(
            manager, grad_output[rows], saved[i], chunk_prompts
        )

    await _run_chunks(run, chunks)
    grad_input = torch.cat([g for g in grads if g is not None])
    grad_prompts = None
    if prompts is not None:
        parts = [g for g in prompt_grads if g is not None]
        if prompts.shape[1] == 1:
            grad_prompts = torch.stack(parts).sum(dim=0)
        else:
            grad_prompts = torch.cat(parts, dim=1)
    if grad_prompts is not None and home_prompts is not None:
        grad_prompts = like(grad_prompts, home_prompts)
    return like(grad_input, home), grad_prompts


async def _backward_span(
    manager: RemoteSequenceManager, span: RouteSpan, request: BackwardRequest
) -> tuple[BackwardReply, FraudReport]:
    """``span``'s server's answer to ``request``, its shape and receipt checked, and the evidence
    of the answer."""
    meta, tensors = await _call(manager, span, request)
    reply = _parse_reply(BackwardReply.from_wire_untrusted, span, "backward", meta, tensors)
    if reply.grad_inputs.shape != request.hidden_states.shape:
        raise ServerError(f"server {span.peer_id} returned a backward of the wrong shape")
    return reply, _check_receipt(manager, span, request, reply.tensors(), reply.receipt)


def _grads_disagreement(
    a: BackwardReply, a_evidence: FraudReport, b: BackwardReply, b_evidence: FraudReport
) -> float:
    if (a.grad_prompts is None) != (b.grad_prompts is None):
        return float("inf")
    mine, theirs = a_evidence.signature, b_evidence.signature
    off = compare(a.grad_inputs, mine, b.grad_inputs, theirs)
    if a.grad_prompts is not None and b.grad_prompts is not None:
        off = max(off, compare(a.grad_prompts, mine, b.grad_prompts, theirs))
    return off


async def _backward_elsewhere(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    request: BackwardRequest,
    exclude: set[str],
    like: ServerInfo | None,
    *,
    wait: bool = False,
) -> tuple[BackwardReply, FraudReport] | None:
    """``request`` answered by one other server holding all of ``span``'s blocks (not
    ``exclude``; of ``like``'s dtype and quantisation; drawn as :func:`other_route` draws them),
    recomputing its forward, and the evidence of its answer; None if there is none or it
    fails."""
    try:
        route = await other_route(
            manager,
            span,
            exclude,
            like,
            wait=wait,
            whole_only=True,
            max_length=request.hidden_states.shape[1],
        )
    except MissingBlocksError:
        return None
    try:
        return await _backward_span(manager, route[0], attrs.evolve(request, kept=None))
    except RETRIABLE as exc:
        logger.info("could not check a backward on %s: %r", route[0], exc)
        return None


async def _verify_backward(
    manager: RemoteSequenceManager,
    span: RouteSpan,
    request: BackwardRequest,
    reply: BackwardReply,
    evidence: FraudReport,
) -> BackwardReply:
    """Check ``span``'s gradients against another server's for the same request (a single
    server holding the span's blocks; where there is none, they stand unchecked): the answer
    to use.  A disagreement goes to a third server and the minority is caught, as for forwards
    (:func:`_verify_forward`)."""
    info = manager.server_info(span.peer_id)
    bound = tolerance(info)
    second = await _backward_elsewhere(manager, span, request, {span.peer_id}, info)
    if second is None:
        return reply
    other, second_evidence = second
    checker = second_evidence.accused
    off = _grads_disagreement(reply, evidence, other, second_evidence)
    if off <= bound:
        manager.on_verified(span.peer_id)
        manager.on_verified(checker)
        return reply
    third = await _backward_elsewhere(
        manager, span, request, {span.peer_id, checker}, info, wait=True
    )
    if third is None:
        raise PetalsError(
            f"servers {span.peer_id} and {checker} computed the backward of blocks "
            f"{span.start}:{span.end} differently (relative difference {off:.3g}, bound "
            f"{bound:.3g}) and no third server could decide"
        )
    decider, third_evidence = third
    side = majority(
        _grads_disagreement(decider, third_evidence, reply, evidence),
        _grads_disagreement(decider, third_evidence, other, second_evidence),
        bound,
    )
    why = f"backward of blocks {span.start}:{span.end} off by {off:.3g} (bound {bound:.3g})"
    if side == "second":
        manager.on_caught(span.peer_id, f"{why} against two other servers")
        book_of(manager).report(evidence)
        return other
    if side == "first":
        manager.on_caught(checker, f"{why} against two other servers")
        book_of(manager).report(second_evidence)
        manager.on_verified(span.peer_id)
        return reply
    raise PetalsError(f"servers disagree on the {why} and no majority decides")


async def _backward_chunk(
    manager: RemoteSequenceManager,
    grad_output: torch.Tensor,
    saved: Saved,
    prompts: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    base = manager.block_indices.start
    grad = grad_output
    grad_prompts: torch.Tensor | None = None
    if prompts is not None:
        grad_prompts = torch.zeros_like(prompts)
    attempt = [0]
    pending = list(saved)
    while pending:
        span, inputs, token = pending.pop()
        request = BackwardRequest(
            blocks=(span.start, span.end),
            active_adapter=manager.config.active_adapter,
            hidden_states=inputs,
            grad_outputs=grad,
            prompts=_prompts_for(manager, prompts, span),
            kept=token,
        )
        try:
            reply, evidence = await _backward_span(manager, span, request)
            if manager.should_verify(span.peer_id):
                reply = await _verify_backward(manager, span, request, reply, evidence)
        except RETRIABLE as exc:
            await _failed_attempt(
                manager,
                attempt,
                span.peer_id,
                "backward",
                exc,
                "backward through %s failed: %r; rerouting",
                span,
                exc,
            )
            # Recompute the forward of these blocks on a new route, then go on backwards there.
            _, resaved = await _forward_blocks(
                manager, span.start, span.end, inputs, prompts, attempt, keep=True
            )
            pending.extend(resaved)
            continue
        manager.on_request_success(span.peer_id)
        grad = reply.grad_inputs.to(grad_output.dtype)
        if grad_prompts is not None:
            span_grads = reply.grad_prompts
            if span_grads is not None:
                grad_prompts[span.start - base : span.end - base] += span_grads.to(
                    grad_prompts.dtype
                )
    return grad, grad_prompts


async def _run_chunks(run: Any, chunks: list[slice]) -> None:
    """``run(i, rows)`` for every chunk, concurrently.  A failure raises the chunk's own error
    (e.g. :class:`MissingBlocksError`, :class:`PetalsError`), never an exception group: when
    several chunks fail at once, the first one's, naming the others in its notes."""
    if len(chunks) == 1:
        await run(0, chunks[0])
        return
    await run_concurrently(functools.partial(run, i, rows) for i, rows in enumerate(chunks))


def _check_inputs(
    manager: RemoteSequenceManager, hidden: torch.Tensor, prompts: torch.Tensor | None, what: str
) -> None:
    """``ValueError`` for inputs no server takes: the caller's mistake is refused here, before
    anything is sent, rather than blamed on every server in turn."""
    size = manager.hidden_size
    if hidden.dim() != 3 or hidden.shape[0] < 1 or hidden.shape[2] != (size or hidden.shape[2]):
        shape = f"(batch, tokens, {size or 'hidden'})"
        raise ValueError(f"{what} must be {shape}, got {describe(hidden)}")
    batch, tokens, hidden_size = hidden.shape
    blocks = len(manager)
    if prompts is not None and not prompts_fit(
        prompts, blocks=blocks, batch=batch, tokens=tokens, hidden_size=hidden_size
    ):
        raise ValueError(
            f"deep prompts must be ({blocks} blocks, 1 or {batch}, at most {tokens} positions, "
            f"{hidden_size}), got {describe(prompts)}"
        )


def _row_chunks(hidden: torch.Tensor, max_chunk_tokens: int) -> list[slice]:
    batch, tokens = hidden.shape[0], max(1, hidden.shape[1])
    rows = max(1, max_chunk_tokens // tokens)
    return [slice(i, min(i + rows, batch)) for i in range(0, batch, rows)]


def _rows_of_prompts(prompts: torch.Tensor | None, rows: slice, batch: int) -> torch.Tensor | None:
    if prompts is None or prompts.shape[1] == 1:
        return prompts
    return prompts[:, rows]
