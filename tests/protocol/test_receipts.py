"""Receipts: what a server signs for an answer, and how a client checks the signature."""

from __future__ import annotations

import time

import attrs
import pytest
import torch

from petals_core import ReceiptError
from petals_core._errors import CodecError
from petals_core.client._checks import CLOCK_SKEW_S, check_receipt
from petals_core.protocol import ForwardReply, Receipt, Signature, StepResult, digest_tensors
from petals_core.transport import Identity, as_received

from ..routing._servers import server as announcement

#: When the receipts of these tests were issued.
ISSUED = int(time.time())


def _receipt(**changes: object) -> Receipt:
    fields: dict[str, object] = {
        "kind": "forward",
        "model": "llama-hf",
        "blocks": (3, 6),
        "adapter": None,
        "torch_dtype": "float32",
        "quant_type": "none",
        "issued": ISSUED,
        "asked": digest_tensors({"hidden_states": torch.ones(1, 2, 4)}),
        "answered": digest_tensors({"hidden_states": torch.zeros(1, 2, 4)}),
    }
    fields.update(changes)
    return Receipt(**fields)  # type: ignore[arg-type]


def test_a_signed_receipt_checks_against_its_signer() -> None:
    server = Identity.generate()
    receipt = _receipt()
    check_receipt(receipt, receipt.sign(server), server.peer_id)
    check_receipt(receipt, receipt.sign(server), str(server.peer_id))


@pytest.mark.parametrize(
    "changed",
    [
        {"kind": "backward"},
        {"model": "bloom"},
        {"blocks": (3, 5)},
        {"adapter": "lora"},
        {"session": "s"},
        {"step": 0},
        {"issued": ISSUED - 1},
        {"padding": (0, 2)},
        {"previous": bytes(32)},
        {"torch_dtype": "bfloat16"},
        {"quant_type": "nf4"},
        {"asked": digest_tensors({"hidden_states": torch.ones(1, 2, 4) * 2})},
        {"answered": digest_tensors({"hidden_states": torch.ones(1, 2, 4)})},
    ],
)
def test_a_signature_over_anything_else_is_refused(changed: dict[str, object]) -> None:
    server = Identity.generate()
    signature = _receipt().sign(server)
    with pytest.raises(ReceiptError, match="not signed over what was asked and answered"):
        check_receipt(_receipt(**changed), signature, server.peer_id)


def test_a_signature_by_another_key_or_none_is_refused() -> None:
    server, other = Identity.generate(), Identity.generate()
    receipt = _receipt()
    with pytest.raises(ReceiptError, match="another peer's key"):
        check_receipt(receipt, receipt.sign(other), server.peer_id)
    # Another peer's signature presented with the server's key does not verify either.
    forged = attrs.evolve(receipt.sign(server), signature=receipt.sign(other).signature)
    with pytest.raises(ReceiptError, match="not signed over"):
        check_receipt(receipt, forged, server.peer_id)
    with pytest.raises(ReceiptError, match="without a receipt"):
        check_receipt(receipt, None, server.peer_id)


def test_a_receipt_dated_far_from_the_clients_clock_is_refused() -> None:
    server = Identity.generate()
    receipt = _receipt()
    signature = receipt.sign(server)
    check_receipt(receipt, signature, server.peer_id, now=ISSUED + CLOCK_SKEW_S)
    with pytest.raises(ReceiptError, match="clocks is wrong"):
        check_receipt(receipt, signature, server.peer_id, now=ISSUED + CLOCK_SKEW_S + 1)
    with pytest.raises(ReceiptError, match=r"\+3601 s from this machine's clock"):
        check_receipt(receipt, signature, server.peer_id, now=ISSUED - CLOCK_SKEW_S - 1)


def test_digests_cover_names_dtypes_shapes_and_values() -> None:
    x = torch.arange(8, dtype=torch.float32).view(2, 4)
    base = digest_tensors({"a": x})
    assert len(base) == 32
    assert digest_tensors({"a": x.clone()}) == base
    assert digest_tensors({"a": x, "b": None}) == base  # absent tensors are skipped
    assert digest_tensors({"b": x}) != base
    assert digest_tensors({"a": x.double()}) != base
    assert digest_tensors({"a": x.view(4, 2)}) != base
    assert digest_tensors({"a": x.t().contiguous().t()}) == base  # layout does not matter
    changed = x.clone()
    changed[1, 3] = torch.nextafter(changed[1, 3], torch.tensor(100.0))
    assert digest_tensors({"a": changed}) != base
    assert digest_tensors({"a": x, "b": x}) == digest_tensors({"b": x, "a": x})
    assert digest_tensors({"a": x.bfloat16()}) != digest_tensors({"a": x.half()})


def test_a_compressed_tensor_is_digested_as_its_receiver_decodes_it() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64)
    for scheme in ("float16", "blockwise8"):
        decoded = as_received(x, scheme)
        assert decoded.shape == x.shape and not torch.equal(decoded, x)
        assert torch.equal(as_received(x, scheme), decoded)  # the round trip is deterministic
    assert as_received(x, None) is x


def test_replies_carry_the_signature_and_refuse_a_malformed_one() -> None:
    server = Identity.generate()
    signature = _receipt().sign(server)
    reply = ForwardReply(hidden_states=torch.zeros(1, 2, 4), receipt=signature)
    meta, tensors = reply.to_wire()
    assert meta["receipt"] == {
        "signer": signature.signer,
        "signature": signature.signature,
        "issued": ISSUED,
        "torch_dtype": "float32",
        "quant_type": "none",
    }
    assert ForwardReply.from_wire_untrusted(meta, tensors) == reply
    assert ForwardReply.from_wire_untrusted({}, tensors).receipt is None
    for bad, reason in [
        ([1], "a receipt must be a map"),
        ({"signer": b"x" * 31, "signature": b"y" * 64}, "signer must be 32 bytes"),
        ({"signer": b"x" * 32, "signature": "y" * 64}, "signature must be 64 bytes"),
        ({"signer": b"x" * 32, "signature": b"y" * 64}, "issued time must be an integer"),
        ({"signer": b"x" * 32, "signature": b"y" * 64, "issued": -1}, "issued time"),
        ({"signer": b"x" * 32, "signature": b"y" * 64, "issued": True}, "issued time"),
        (
            {"signer": b"x" * 32, "signature": b"y" * 64, "issued": 1, "previous": b"z"},
            "previous digest must be 32 bytes",
        ),
        ({**meta["receipt"], "torch_dtype": None}, "names its dtype and quantisation"),
        ({**meta["receipt"], "quant_type": "x" * 33}, "names its dtype and quantisation"),
        ({**meta["receipt"], "torch_dtype": "float\n32"}, "names its dtype and quantisation"),
    ]:
        with pytest.raises(CodecError, match=reason):
            ForwardReply.from_wire_untrusted({"receipt": bad}, tensors)


def test_receipts_refuse_what_they_cannot_mean() -> None:
    with pytest.raises(ValueError, match="kind is one of"):
        _receipt(kind="push")
    with pytest.raises(ValueError, match="32-byte digest"):
        _receipt(asked=b"short")
    with pytest.raises(ValueError, match="issued time"):
        _receipt(issued=1.5)
    with pytest.raises(ValueError, match="names its dtype and quantisation"):
        _receipt(torch_dtype="")
    assert attrs.evolve(_receipt(), step=3).step == 3


def test_step_results_carry_the_signature_with_the_digest_of_the_input() -> None:
    server = Identity.generate()
    receipt = _receipt(kind="step", session="s", step=4)
    signature = receipt.sign(server, with_asked=True)
    assert signature.asked == receipt.asked
    assert receipt.sign(server).asked is None
    result = StepResult(hidden_states=torch.zeros(1, 1, 4), position=4, receipt=signature)
    wire = result.to_wire()
    assert wire["receipt"]["asked"] == receipt.asked
    assert StepResult.from_wire_untrusted(wire) == result
    check_receipt(receipt, StepResult.from_wire_untrusted(wire).receipt, server.peer_id)
    with pytest.raises(CodecError, match="asked digest must be 32 bytes"):
        StepResult.from_wire_untrusted({**wire, "receipt": {**wire["receipt"], "asked": b"x"}})


def test_a_step_receipt_names_the_one_before_it() -> None:
    server = Identity.generate()
    first = _receipt(kind="step", session="s", step=2, previous=bytes(32))
    second = _receipt(kind="step", session="s", step=3, previous=first.digest())
    signature = second.sign(server, with_asked=True)
    assert signature.previous == first.digest() and len(first.digest()) == 32
    assert Signature.from_wire_untrusted(signature.to_wire()) == signature
    check_receipt(second, signature, server.peer_id)
    assert first.digest() != _receipt(kind="step", session="s", step=2).digest()


def test_a_receipt_must_name_the_dtype_its_server_announces() -> None:
    """Checks compare a server with servers of the dtype it announces, and judges of a report
    recompute in the dtype it signed: the two must be the same."""
    server = Identity.generate()
    receipt = _receipt()
    announced = announcement(3, 6)  # float32, no quantisation
    check_receipt(receipt, receipt.sign(server), server.peer_id, announced=announced)
    for other in ({"torch_dtype": "bfloat16"}, {"quant_type": "nf4"}):
        with pytest.raises(ReceiptError, match="signed its forward as computed in float32"):
            check_receipt(
                receipt,
                receipt.sign(server),
                server.peer_id,
                announced=attrs.evolve(announced, **other),
            )
