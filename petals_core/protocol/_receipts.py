"""Signed answers: a server's receipt for what it was asked and what it answered.

Every answer of a forward, a backward and an inference step carries a signature by the server's
identity key (the Ed25519 key its PeerID names) over a :class:`Receipt`: the kind of answer, the
model (its DHT prefix), the blocks and adapter, the session, its left padding and the step where
there is one, the dtype and quantisation the server computed in, the time it was issued (Unix
seconds, on the server's clock), and sha2-256 digests of the tensors asked and answered
(:func:`digest_tensors`). On the wire a reply carries only the signer's public key, the time, the
dtype and quantisation and the signature (:class:`Signature`): the client knows the rest, since
it asked and it received, so it rebuilds the receipt and checks the signature
(:meth:`Receipt.verify`) and that the key is the server's (its PeerID names it). A receipt that
checks is evidence anyone can verify that this server gave this answer to this question, computed
in that dtype: a fraud report is one, with its tensors.

Digests are over the tensors as the receiver decodes them: a sender that compresses (lossy schemes)
digests its tensors after the same round trip (``petals_core.transport.as_received``), so both
sides hash the same bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, TypeGuard

import attrs
import cbor2
import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .._errors import CodecError

if TYPE_CHECKING:
    from ..transport import Identity

__all__ = [
    "DIGEST_BYTES",
    "FIRST_STEP",
    "Receipt",
    "Signature",
    "SignedReceipt",
    "digest_tensors",
]

DIGEST_BYTES: Final = 32
#: How an answer may travel besides as it is (the transport's compression schemes).
COMPRESSIONS: Final = ("float16", "blockwise8")
#: What a session's first step receipt names as the one before it.
FIRST_STEP: Final = bytes(32)
_KEY_BYTES: Final = 32
_SIGNATURE_BYTES: Final = 64
#: The longest dtype or quantisation name a receipt carries.
_MAX_NAME: Final = 32
#: What the signed bytes begin with: a signature over a receipt means nothing else.
_DOMAIN: Final = "petals_core receipt v2"

ReceiptKind = Literal["forward", "backward", "step"]
KINDS: Final = ("forward", "backward", "step")


def digest_tensors(tensors: Mapping[str, torch.Tensor | None]) -> bytes:
    """sha2-256 over the named tensors (absent ones skipped), in name order: each name, dtype,
    shape and the tensor's bytes in C order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, not {type(tensor).__name__}")
        tensor = tensor.detach().to("cpu").contiguous()
        header = cbor2.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
        digest.update(len(header).to_bytes(4, "big") + header)
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.digest()


@attrs.frozen(kw_only=True)
class Signature:
    """What a reply carries: the signer's raw Ed25519 public key and its signature."""

    what: ClassVar[str] = "receipt signature"

    signer: bytes
    signature: bytes
    #: When the server signed, Unix seconds on its clock.
    issued: int
    #: The digest of what the server computed from, where the client may not hold the same
    #: bytes (an inference step's input may come pushed from the previous server).
    asked: bytes | None = None
    #: A step's: the digest of the session's receipt before it (:meth:`Receipt.digest`;
    #: :data:`FIRST_STEP` for its first), so a session's receipts make one unbroken chain.
    previous: bytes | None = None
    #: How the answer travelled (the server's compression: None, ``"float16"``,
    #: ``"blockwise8"``): what a comparison of answers must allow for.
    compression: str | None = None
    #: What the server computed in (as it announces them, e.g. ``"bfloat16"`` and ``"none"``):
    #: what a check of the answer, even long after, compares it with.
    torch_dtype: str
    quant_type: str

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "signer": self.signer,
            "signature": self.signature,
            "issued": self.issued,
            "torch_dtype": self.torch_dtype,
            "quant_type": self.quant_type,
        }
        if self.asked is not None:
            wire["asked"] = self.asked
        if self.previous is not None:
            wire["previous"] = self.previous
        if self.compression is not None:
            wire["compression"] = self.compression
        return wire

    @classmethod
    def from_wire_untrusted(cls, value: object) -> Signature:
        if not isinstance(value, dict):
            raise CodecError("a receipt must be a map")
        signer, signature = value.get("signer"), value.get("signature")
        if not isinstance(signer, bytes) or len(signer) != _KEY_BYTES:
            raise CodecError(f"a receipt's signer must be {_KEY_BYTES} bytes")
        if not isinstance(signature, bytes) or len(signature) != _SIGNATURE_BYTES:
            raise CodecError(f"a receipt's signature must be {_SIGNATURE_BYTES} bytes")
        issued = value.get("issued")
        if not _is_time(issued):
            raise CodecError("a receipt's issued time must be an integer within [0, 2**63)")
        asked, previous = value.get("asked"), value.get("previous")
        if asked is not None and (not isinstance(asked, bytes) or len(asked) != DIGEST_BYTES):
            raise CodecError(f"a receipt's asked digest must be {DIGEST_BYTES} bytes")
        if previous is not None and (
            not isinstance(previous, bytes) or len(previous) != DIGEST_BYTES
        ):
            raise CodecError(f"a receipt's previous digest must be {DIGEST_BYTES} bytes")
        compression = value.get("compression")
        if compression is not None and compression not in COMPRESSIONS:
            raise CodecError(f"a receipt's compression is one of {COMPRESSIONS}")
        torch_dtype, quant_type = value.get("torch_dtype"), value.get("quant_type")
        if not _is_name(torch_dtype) or not _is_name(quant_type):
            raise CodecError(
                f"a receipt names its dtype and quantisation, each in 1 to {_MAX_NAME} characters"
            )
        return cls(
            signer=signer,
            signature=signature,
            issued=issued,
            asked=asked,
            previous=previous,
            compression=compression,
            torch_dtype=torch_dtype,
            quant_type=quant_type,
        )


def as_signature(value: object) -> Signature | None:
    """A field's converter: a :class:`Signature` as it is, a map from the wire parsed (a
    malformed one raises :class:`CodecError`)."""
    if value is None or isinstance(value, Signature):
        return value
    return Signature.from_wire_untrusted(value)


def _is_time(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _is_name(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 0 < len(value) <= _MAX_NAME and value.isprintable()


def _check_digest(name: str, value: bytes) -> None:
    if not isinstance(value, bytes) or len(value) != DIGEST_BYTES:
        raise ValueError(f"{name} must be a {DIGEST_BYTES}-byte digest")


@attrs.frozen(kw_only=True)
class Receipt:
    """What a server signs for one answer (see the module)."""

    kind: ReceiptKind
    model: str
    blocks: tuple[int, int]
    adapter: str | None = None
    session: str | None = None
    #: A session's left padding per row, as it was opened (None: none).
    padding: tuple[int, ...] | None = None
    step: int | None = None
    #: A step's: the digest of the session's receipt before it (see :class:`Signature`).
    previous: bytes | None = None
    #: How the answer travelled (see :class:`Signature`).
    compression: str | None = None
    #: What the server computed in (see :class:`Signature`).
    torch_dtype: str
    quant_type: str
    issued: int
    asked: bytes
    answered: bytes

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"a receipt's kind is one of {KINDS}, not {self.kind!r}")
        if not _is_time(self.issued):
            raise ValueError("a receipt's issued time is an integer within [0, 2**63)")
        _check_digest("asked", self.asked)
        _check_digest("answered", self.answered)
        if self.previous is not None:
            _check_digest("previous", self.previous)
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise ValueError(f"a receipt's compression is one of {COMPRESSIONS}")
        if not _is_name(self.torch_dtype) or not _is_name(self.quant_type):
            raise ValueError(
                f"a receipt names its dtype and quantisation, each in 1 to {_MAX_NAME} characters"
            )

    def signed_bytes(self) -> bytes:
        return cbor2.dumps(
            [
                _DOMAIN,
                self.kind,
                self.model,
                list(self.blocks),
                self.adapter,
                self.session,
                None if self.padding is None else list(self.padding),
                self.step,
                self.previous,
                self.compression,
                self.torch_dtype,
                self.quant_type,
                self.issued,
                self.asked,
                self.answered,
            ]
        )

    def sign(self, identity: Identity, *, with_asked: bool = False) -> Signature:
        """The signature of this receipt by ``identity`` (carrying the ``asked`` digest if
        ``with_asked``)."""
        return Signature(
            signer=identity.public_key_bytes,
            signature=identity.sign(self.signed_bytes()),
            issued=self.issued,
            asked=self.asked if with_asked else None,
            previous=self.previous,
            compression=self.compression,
            torch_dtype=self.torch_dtype,
            quant_type=self.quant_type,
        )

    def digest(self) -> bytes:
        """sha2-256 of what is signed: what the next step's receipt names as ``previous``."""
        return hashlib.sha256(self.signed_bytes()).digest()

    def verify(self, signature: Signature) -> bool:
        """Whether ``signature`` is its signer's over this receipt (who the signer is, the caller
        checks: a PeerID names the key, ``PeerID.from_public_key(signature.signer)``)."""
        try:
            key = Ed25519PublicKey.from_public_bytes(signature.signer)
            key.verify(signature.signature, self.signed_bytes())
        except (InvalidSignature, ValueError):
            return False
        return True


@attrs.frozen(kw_only=True)
class SignedReceipt:
    """A receipt whose signature checked, and the server (PeerID) that signed it: evidence that
    this server gave this answer to this question."""

    peer: str
    receipt: Receipt
    signature: Signature
