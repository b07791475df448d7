"""The stream of one span's session on its server (:class:`SpanCall`): opening it, sending
steps, reading answers with their receipts checked, and keeping the evidence a fraud report
carries; and what a server failing looks like from the client (:data:`RETRIABLE`)."""

from __future__ import annotations

import logging
from contextlib import AsyncExitStack

import torch
import trio

from .._errors import (
    CodecError,
    ReceiptError,
    RemoteError,
    ServerError,
    SessionTooLarge,
    TransportError,
)
from ..dht import MAX_EVIDENCE_BYTES, ServerInfo
from ..protocol import (
    INFERENCE,
    FraudReport,
    OpenSession,
    Receipt,
    SessionReady,
    Signature,
    SignedReceipt,
    Step,
    StepEvidence,
    StepResult,
    digest_tensors,
)
from ..transport import Call, as_received, compress_floats, open_call
from ._checks import check_receipt
from ._sequence_manager import RemoteSequenceManager
from ._session_core import SessionCore, SpanState

__all__ = ["RETRIABLE", "SpanCall"]

logger = logging.getLogger(__name__)

#: What a server failing looks like from here: network trouble, a remote exception, a stall.
RETRIABLE = (TransportError, RemoteError, ServerError, trio.TooSlowError)
#: The longest a session's closing may take (it goes on when the caller is cancelled).
_CLOSE_TIMEOUT_S = 10.0


class SpanCall:
    """The stream of one span's session on its server.  With ``keep_evidence``, it keeps every
    step as the server received it with its signature (up to ``MAX_EVIDENCE_BYTES``): what a
    fraud report on this session carries."""

    def __init__(
        self, state: SpanState, receipts: list[SignedReceipt], *, keep_evidence: bool = False
    ) -> None:
        self.state = state
        self.stack = AsyncExitStack()
        self.call: Call | None = None
        #: Where the receipts of its answers go once they check (the session's).
        self.receipts = receipts
        #: The session's steps so far, as its server received them; None once one could not be
        #: kept (too large, or received otherwise than we hold it).
        self.evidence: list[StepEvidence] | None = [] if keep_evidence else None
        self._evidence_bytes = 0
        #: What the step now answered was computed from, as the server received it.
        self._asked: dict[str, torch.Tensor | None] | None = None
        #: The opening was sent, and the server has not said yet that it took it.
        self.unconfirmed = False
        #: The server's announcement when its first answer came (what receipts must name).
        self._announced: ServerInfo | None = None

    async def open(
        self, manager: RemoteSequenceManager, opening: OpenSession, *, wait: bool = True
    ) -> float:
        """Open the span's session on its server; returns how long connecting took.

        With ``wait=False`` only the opening is sent: steps may follow at once (the server
        reads them after it), and the server's answer to the opening is read before the first
        step's (:attr:`unconfirmed` until then)."""
        started = trio.current_time()
        connection = await manager.connect(self.state.peer)
        connected = trio.current_time() - started
        self.call = await self.stack.enter_async_context(open_call(connection, INFERENCE))
        await self.call.send(opening.to_wire())
        self.unconfirmed = True
        if wait:
            await self._confirm()
        return connected

    async def _confirm(self) -> None:
        """Read the server's answer to the opening.  Its refusal of a session larger than it
        takes is raised as :class:`SessionTooLarge` (any later answer saying so is a
        :class:`RemoteError` like others)."""
        assert self.call is not None
        try:
            reply = await self.call.receive()
        except RemoteError as exc:
            if exc.remote_type == SessionTooLarge.__name__:
                raise SessionTooLarge(exc.remote_message) from None
            raise
        try:
            SessionReady.from_wire_untrusted(reply)
        except CodecError:
            raise ServerError(
                f"server {self.state.peer} did not open the session: {reply!r}"
            ) from None
        self.unconfirmed = False

    async def send(self, step: Step, compression: str | None) -> None:
        assert self.call is not None
        try:
            await self.call.send(compress_floats(step.to_wire(), compression))
        except TransportError:
            if self.unconfirmed:
                # The server may have refused the opening while the step was on its way (and
                # stopped reading): its answer says why, the send's failure does not.
                with trio.move_on_after(_CLOSE_TIMEOUT_S):
                    await self._confirm()
            raise
        if self.evidence is not None:
            self._asked = {
                "hidden_states": as_received(step.hidden_states, compression),
                "prompts": None if step.prompts is None else as_received(step.prompts, compression),
                "hypo_ids": None if step.hypo_ids is None else step.hypo_ids.to(torch.int64),
            }

    def pushed(self, x: torch.Tensor) -> None:
        """The step now awaited was pushed to the server by the previous one: ``x``, as the
        previous server answered us (its receipt says whether it pushed the same)."""
        self._asked = {"hidden_states": x}

    async def answer(
        self, core: SessionCore, index: int, manager: RemoteSequenceManager
    ) -> StepResult:
        """The answer the core awaits from span ``index``, its receipt checked; answers to
        other steps are stale (pushed steps resent since) and skipped."""
        while True:
            result = await self._receive()
            if core.is_answer(index, result):
                self._check_receipt(result, manager)
                return result

    async def result(self, manager: RemoteSequenceManager) -> StepResult:
        """The next answer, its receipt checked (a session of one step: a check's)."""
        result = await self._receive()
        self._check_receipt(result, manager)
        return result

    async def _receive(self) -> StepResult:
        assert self.call is not None
        if self.unconfirmed:
            await self._confirm()
        reply = await self.call.receive()
        try:
            return StepResult.from_wire_untrusted(reply)
        except CodecError as exc:
            raise ServerError(
                f"server {self.state.peer} sent a malformed step result: {exc}"
            ) from None

    def _check_receipt(self, result: StepResult, manager: RemoteSequenceManager) -> None:
        """The server signed this output for this position of our session on its blocks (the
        input it names by digest: it may have come pushed from the previous server)."""
        signature = result.receipt
        if signature is None or signature.asked is None:
            raise ReceiptError(f"server {self.state.peer} answered a step without a receipt")
        assert manager.config.dht_prefix is not None
        span = self.state.span
        receipt = Receipt(
            kind="step",
            model=manager.config.dht_prefix,
            blocks=(span.start, span.end),
            adapter=manager.config.active_adapter or None,
            session=self.state.session_id,
            padding=self.state.padding,
            step=result.position,
            previous=signature.previous,
            compression=signature.compression,
            torch_dtype=signature.torch_dtype,
            quant_type=signature.quant_type,
            issued=signature.issued,
            asked=signature.asked,
            answered=digest_tensors({"hidden_states": result.hidden_states}),
        )
        if self._announced is None:  # once: reading the peer table costs a walk over it
            self._announced = manager.server_info(self.state.peer)
        check_receipt(receipt, signature, self.state.peer, announced=self._announced)
        self.receipts.append(
            SignedReceipt(peer=self.state.peer, receipt=receipt, signature=signature)
        )
        self._keep(receipt, signature)

    def _keep(self, receipt: Receipt, signature: Signature) -> None:
        asked, self._asked = self._asked, None
        if self.evidence is None:
            return
        kept = {} if asked is None else {n: t for n, t in asked.items() if t is not None}
        self._evidence_bytes += sum(t.numel() * t.element_size() for t in kept.values())
        if self._evidence_bytes > MAX_EVIDENCE_BYTES:
            self.evidence = None  # before hashing it: a long prefill is not hashed twice
            return
        if not kept or digest_tensors(kept) != receipt.asked:
            logger.debug("the session on %s cannot be reported: inputs differ", self.state.peer)
            self.evidence = None
            return
        assert receipt.step is not None
        self.evidence.append(
            StepEvidence(
                position=receipt.step, signature=signature, asked=kept, answered=receipt.answered
            )
        )

    def report(self, manager: RemoteSequenceManager, answer: torch.Tensor) -> FraudReport | None:
        """A fraud report on the step just answered with ``answer`` (as received), if this
        session's evidence was kept."""
        evidence = self.evidence
        if not evidence or evidence[-1].answered != digest_tensors({"hidden_states": answer}):
            return None
        last = evidence[-1]
        assert manager.config.dht_prefix is not None
        span = self.state.span
        report = FraudReport(
            accused=self.state.peer,
            kind="step",
            model=manager.config.dht_prefix,
            blocks=(span.start, span.end),
            adapter=manager.config.active_adapter or None,
            signature=last.signature,
            asked=last.asked,
            answered={"hidden_states": answer},
            session=self.state.session_id,
            padding=self.state.padding,
            position=last.position,
            steps=tuple(evidence[:-1]),
        )
        if not report.chained():
            # An answer was skipped (a stale one, after a resent step): a link is missing.
            logger.info("the session on %s cannot be reported: its chain has a gap", span)
            return None
        return report

    async def close(self) -> None:
        """End the session on its server, even when the caller is cancelled (else the server
        would hold its cache until the session times out)."""
        call, self.call = self.call, None
        with trio.move_on_after(_CLOSE_TIMEOUT_S, shield=True):
            if call is not None:
                try:
                    await call.send_eof()
                except TransportError:
                    pass
            try:
                await self.stack.aclose()
            except TransportError:
                pass
