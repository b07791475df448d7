"""When two servers' answers to the same question agree.

Two honest servers computing the same blocks on the same input differ by their arithmetic: the
order of sums (thread counts, kernels, GPUs) and the dtype they compute in.  An answer agrees with
another when, for every token, the difference of the two hidden states is small against the
state itself (relative L2 norm, :func:`disagreement`), within a bound set by the dtype the servers
compute in (:data:`TOLERANCE`; servers are only compared with servers of the same dtype and
quantisation).  A server that changes what it computes by more than that bound is caught; one
that changes it by less is not, and its answers stay within what an honest server of a coarser
dtype could return.

Answers travel as their servers compress them (their receipts sign how).  Two answers are
compared like with like (:func:`compare`): each passes through the other's compression too, so
rounding that only one of them went through is no difference.  Where a second opinion comes from
a chain of servers, the hidden states between them travelled compressed as well; each such hop
widens the bound by what its scheme may change (:data:`COMPRESSION_ALLOWANCE`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final, Literal

import torch

from .._errors import ReceiptError
from ..dht import ServerInfo
from ..protocol import Receipt, Signature
from ..transport import PeerID, as_received

__all__ = [
    "CLOCK_SKEW_S",
    "COMPRESSION_ALLOWANCE",
    "TOLERANCE",
    "agree",
    "compare",
    "check_receipt",
    "disagreement",
    "hops_allowance",
    "majority",
    "slice_allowance",
    "tolerance",
]

#: The largest relative difference per token (L2) between two honest servers' answers, by the
#: dtype they compute in.
TOLERANCE: Final = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
#: How far a receipt's time may be from the client's clock, either way, in seconds.
CLOCK_SKEW_S: Final = 3600.0
#: The most an answer's compression may change it, relative L2 per token: float16 rounds each
#: element to 2**-11 of itself; blockwise8 to 1/254 of its block's largest magnitude, at most
#: 16/254 of a 256-element block's norm.
COMPRESSION_ALLOWANCE: Final = {"float16": 1e-3, "blockwise8": 7e-2}
#: For a dtype not listed (or a server not announced): the loosest bound.
_DEFAULT: Final = max(TOLERANCE.values())


def tolerance(*servers: ServerInfo | None) -> float:
    """The bound for comparing answers of ``servers`` (the loosest of their dtypes')."""
    return max(
        TOLERANCE.get(info.torch_dtype, _DEFAULT) if info is not None else _DEFAULT
        for info in servers
    )


def disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest, over tokens, of ``|a - b| / max(|a|, |b|)`` (L2 norms over the hidden
    dimension); infinite where the shapes differ or a value is not finite (unless both are
    identical)."""
    if a.shape != b.shape:
        return float("inf")
    x, y = a.detach().float().reshape(-1, a.shape[-1]), b.detach().float().reshape(-1, b.shape[-1])
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        return 0.0 if torch.equal(x, y) else float("inf")
    if x.numel() == 0:
        return 0.0
    scale = torch.maximum(x.norm(dim=-1), y.norm(dim=-1)).clamp_min(torch.finfo(torch.float32).tiny)
    return float(((x - y).norm(dim=-1) / scale).max())


def compare(
    a: torch.Tensor, a_signature: Signature | None, b: torch.Tensor, b_signature: Signature | None
) -> float:
    """:func:`disagreement` of two answers, each passed through the other's compression (as
    their signatures say it travelled)."""
    a_scheme = None if a_signature is None else a_signature.compression
    b_scheme = None if b_signature is None else b_signature.compression
    if a_scheme != b_scheme:
        if b_scheme is not None:
            a = as_received(a.detach(), b_scheme)
        if a_scheme is not None:
            b = as_received(b.detach(), a_scheme)
    return disagreement(a, b)


def hops_allowance(signatures: Sequence[Signature | None]) -> float:
    """What compression between the servers of a chain (all but its last answer) may have
    changed its final answer."""
    return sum(
        COMPRESSION_ALLOWANCE.get(signature.compression, 0.0)
        for signature in signatures[:-1]
        if signature is not None and signature.compression is not None
    )


def slice_allowance(signature: Signature | None) -> float:
    """What compression may change in part of an answer compared on its own (its blocks were
    cut over the whole answer, not over the part)."""
    if signature is None or signature.compression is None:
        return 0.0
    return COMPRESSION_ALLOWANCE.get(signature.compression, 0.0)


def agree(a: torch.Tensor, b: torch.Tensor, bound: float) -> bool:
    return disagreement(a, b) <= bound


def majority(
    third_to_first: float, third_to_second: float, bound: float
) -> Literal["first", "second"] | None:
    """Which of two disagreeing answers a third one sides with, given how far the third is from
    each (:func:`disagreement`): the one it alone agrees with; None where it agrees with both or
    neither, so no majority decides."""
    with_first, with_second = third_to_first <= bound, third_to_second <= bound
    if with_first == with_second:
        return None
    return "first" if with_first else "second"


def check_receipt(
    receipt: Receipt,
    signature: Signature | None,
    peer_id: str | PeerID,
    *,
    now: float | None = None,
    announced: ServerInfo | None = None,
) -> None:
    """Raise :class:`ReceiptError` unless ``signature`` is by ``peer_id``'s key, over
    ``receipt``, dated within :data:`CLOCK_SKEW_S` of ``now`` (default: this machine's clock),
    and names the dtype and quantisation the server ``announced`` (if given: checks compare it
    with servers of those, and judges of a report recompute in what it signed).  A receipt
    dated far away could not be reported while it matters (reports expire)."""
    if signature is None:
        raise ReceiptError(f"server {peer_id} answered a {receipt.kind} without a receipt")
    if announced is not None and (signature.torch_dtype, signature.quant_type) != (
        announced.torch_dtype,
        announced.quant_type,
    ):
        raise ReceiptError(
            f"server {peer_id} signed its {receipt.kind} as computed in {signature.torch_dtype} "
            f"({signature.quant_type} quantisation) but announces {announced.torch_dtype} "
            f"({announced.quant_type})"
        )
    now = time.time() if now is None else now
    if abs(receipt.issued - now) > CLOCK_SKEW_S:
        raise ReceiptError(
            f"server {peer_id} dated its {receipt.kind} receipt {receipt.issued - now:+.0f} s "
            f"from this machine's clock (at most {CLOCK_SKEW_S:.0f} s either way): one of the "
            "two clocks is wrong"
        )
    if str(PeerID.from_public_key(signature.signer)) != str(peer_id):
        raise ReceiptError(
            f"server {peer_id} signed its {receipt.kind} receipt with another peer's key"
        )
    if not receipt.verify(signature):
        raise ReceiptError(
            f"server {peer_id}'s {receipt.kind} receipt is not signed over what was asked and "
            "answered"
        )
