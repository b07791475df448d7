"""Node identity: an Ed25519 key, the PeerID that names it, and a TLS certificate bound to it.

A PeerID is the sha2-256 multihash of the node's raw 32-byte Ed25519 public key, printed in
base58btc (so it reads ``Qm...``).  The node's self-signed certificate carries that key; during the
QUIC handshake each end proves possession of its key (TLS CertificateVerify), and the other end
checks with :func:`check_certificate_identity` that the key hashes to the PeerID it meant to reach.
The certificate's own signature and validity dates carry no trust here: the key is the identity.

Identity files hold the private key as unencrypted PKCS#8 PEM and must be private to their owner.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import secrets
import stat
import threading
from pathlib import Path
from typing import Final

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from .._errors import ConfigError, IdentityFileError, IdentityMismatch

__all__ = [
    "Identity",
    "PeerID",
    "check_certificate_identity",
    "load_or_create_identity",
    "peer_id_from_certificate",
    "verify_signature",
]

_B58_ALPHABET: Final = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX: Final = {char: index for index, char in enumerate(_B58_ALPHABET)}

_SHA2_256_CODE: Final = 0x12
_SHA2_256_LENGTH: Final = 32
_MULTIHASH_PREFIX: Final = bytes([_SHA2_256_CODE, _SHA2_256_LENGTH])
_PEER_ID_BYTES: Final = len(_MULTIHASH_PREFIX) + _SHA2_256_LENGTH
# A 34-byte multihash prints as 46 base58 characters; the cap keeps decoding junk input cheap.
_MAX_PEER_ID_CHARS: Final = 64

_ED25519_KEY_BYTES: Final = 32
_CERT_NOT_BEFORE: Final = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
_CERT_NOT_AFTER: Final = datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)
_MAX_IDENTITY_FILE_BYTES: Final = 64 * 1024
_CREATE_ATTEMPTS: Final = 3


def _b58encode(data: bytes) -> str:
    zeros = len(data) - len(data.lstrip(b"\0"))
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, remainder = divmod(number, 58)
        digits.append(_B58_ALPHABET[remainder])
    return "1" * zeros + "".join(reversed(digits))


def _b58decode(text: str) -> bytes:
    """Decode base58btc; raises ValueError on a character outside the alphabet."""
    number = 0
    for position, char in enumerate(text):
        digit = _B58_INDEX.get(char)
        if digit is None:
            raise ValueError(f"{char!r} at position {position} is not a base58btc character")
        number = number * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return b"\0" * zeros + body


def _check_multihash(instance: PeerID, attribute: attrs.Attribute[bytes], value: bytes) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"PeerID wraps bytes, got {type(value).__name__}")
    if len(value) != _PEER_ID_BYTES or not value.startswith(_MULTIHASH_PREFIX):
        raise ConfigError(
            f"not a PeerID multihash: {len(value)} bytes starting with "
            f"{value[:2].hex() or 'nothing'} (expected {_PEER_ID_BYTES} bytes starting with "
            f"{_MULTIHASH_PREFIX.hex()}, a sha2-256 multihash)"
        )


@attrs.frozen(order=True, repr=False)
class PeerID:
    """The name of a node: the sha2-256 multihash of its raw Ed25519 public key.

    Compares, hashes and orders by the multihash bytes; ``str()`` gives the base58btc form.
    """

    _multihash: bytes = attrs.field(validator=_check_multihash)

    @classmethod
    def from_public_key(cls, key: Ed25519PublicKey | bytes) -> PeerID:
        """The PeerID of a public key, given as a key object or its raw 32 bytes."""
        if isinstance(key, Ed25519PublicKey):
            raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        elif isinstance(key, bytes):
            if len(key) != _ED25519_KEY_BYTES:
                raise ConfigError(
                    f"an Ed25519 public key is {_ED25519_KEY_BYTES} bytes, got {len(key)}"
                )
            raw = key
        else:
            raise TypeError(f"expected Ed25519PublicKey or bytes, got {type(key).__name__}")
        return cls(_MULTIHASH_PREFIX + hashlib.sha256(raw).digest())

    @classmethod
    def from_string(cls, text: str) -> PeerID:
        """Parse the base58btc form (``Qm...``); raises ConfigError naming the bad string."""
        if not isinstance(text, str):
            raise TypeError(f"expected str, got {type(text).__name__}")
        if not text or len(text) > _MAX_PEER_ID_CHARS:
            raise ConfigError(
                f"invalid PeerID {text!r}: expected a base58btc sha2-256 multihash (46 characters, "
                f"starting with 'Qm')"
            )
        try:
            raw = _b58decode(text)
        except ValueError as exc:
            raise ConfigError(f"invalid PeerID {text!r}: {exc}") from None
        if len(raw) != _PEER_ID_BYTES or not raw.startswith(_MULTIHASH_PREFIX):
            raise ConfigError(
                f"invalid PeerID {text!r}: expected a sha2-256 multihash ({_PEER_ID_BYTES} bytes "
                f"starting with {_MULTIHASH_PREFIX.hex()}), got {len(raw)} bytes starting with "
                f"{raw[:2].hex() or 'nothing'}"
            )
        return cls(raw)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> PeerID:
        """Wrap raw multihash bytes, checking that they are a sha2-256 multihash."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"expected bytes, got {type(data).__name__}")
        return cls(bytes(data))

    def to_bytes(self) -> bytes:
        return self._multihash

    def matches(self, public_key_bytes: bytes) -> bool:
        """Whether these raw Ed25519 public key bytes hash to this PeerID."""
        if len(public_key_bytes) != _ED25519_KEY_BYTES:
            return False
        return (
            hashlib.sha256(public_key_bytes).digest() == self._multihash[len(_MULTIHASH_PREFIX) :]
        )

    def __str__(self) -> str:
        return _b58encode(self._multihash)

    def __repr__(self) -> str:
        return f"PeerID({str(self)!r})"


class Identity:
    """A node's Ed25519 private key, with its PeerID and a self-signed certificate for TLS."""

    __slots__ = (
        "_certificate",
        "_certificate_lock",
        "peer_id",
        "private_key",
        "public_key_bytes",
    )

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError(f"expected Ed25519PrivateKey, got {type(private_key).__name__}")
        self.private_key: Final = private_key
        #: The raw 32-byte Ed25519 public key.
        self.public_key_bytes: Final = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.peer_id: Final = PeerID.from_public_key(self.public_key_bytes)
        self._certificate: x509.Certificate | None = None
        self._certificate_lock = threading.Lock()

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        """Build from the raw 32-byte Ed25519 private key (seed)."""
        if not isinstance(raw, bytes):
            raise TypeError(f"expected bytes, got {type(raw).__name__}")
        if len(raw) != _ED25519_KEY_BYTES:
            raise ConfigError(
                f"an Ed25519 private key is {_ED25519_KEY_BYTES} raw bytes, got {len(raw)}"
            )
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    @property
    def certificate(self) -> x509.Certificate:
        """A self-signed certificate carrying this key, built on first use and then reused.

        Valid 2020-01-01 to 2100-01-01 so that no peer's clock can make it look expired.
        """
        with self._certificate_lock:
            if self._certificate is None:
                self._certificate = self._build_certificate()
            return self._certificate

    @property
    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def private_key_pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM: the identity file format."""
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def _build_certificate(self) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, str(self.peer_id))])
        return (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.private_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_CERT_NOT_BEFORE)
            .not_valid_after(_CERT_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.private_key, algorithm=None)
        )

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id!r})"


def verify_signature(public_key_bytes: bytes, signature: bytes, data: bytes) -> bool:
    """Whether ``signature`` is a valid Ed25519 signature of ``data`` by this raw public key.

    A malformed key or signature is simply not valid: this returns False rather than raising.
    """
    try:
        Ed25519PublicKey.from_public_bytes(public_key_bytes).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def peer_id_from_certificate(cert: x509.Certificate) -> PeerID:
    """The PeerID of the key a certificate carries; IdentityMismatch if it is not an Ed25519 key."""
    try:
        key = cert.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise IdentityMismatch(f"peer certificate carries an unreadable public key: {exc}") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise IdentityMismatch(
            f"peer certificate carries a {type(key).__name__}, expected an Ed25519 public key"
        )
    return PeerID.from_public_key(key)


def check_certificate_identity(cert: x509.Certificate, expected: PeerID | None) -> PeerID:
    """The peer's PeerID, after checking that it is ``expected`` (when one is given)."""
    actual = peer_id_from_certificate(cert)
    if expected is not None and actual != expected:
        raise IdentityMismatch(f"expected peer {expected}, but the peer proved the key of {actual}")
    return actual


def load_or_create_identity(path: str | os.PathLike[str]) -> Identity:
    """Load the identity stored at ``path``, or create one there (mode 0600) if there is none.

    Refuses, with IdentityFileError, a file that is unreadable, is not an Ed25519 private key in
    unencrypted PKCS#8 PEM, or (on POSIX) is accessible to group or others.
    """
    file_path = Path(path)
    for _ in range(_CREATE_ATTEMPTS):
        try:
            return _read_identity_file(file_path)
        except FileNotFoundError:
            pass
        created = _create_identity_file(file_path)
        if created is not None:
            return created
        # Another process created the file between our read and our create: use theirs.
    raise IdentityFileError(
        f"identity file {file_path} keeps appearing and disappearing; is another process "
        f"deleting it?"
    )


def _read_identity_file(path: Path) -> Identity:
    """Read and check an identity file; FileNotFoundError passes through when it does not exist."""
    # O_NONBLOCK only matters if someone put a FIFO there: we refuse it instead of hanging.
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise IdentityFileError(f"cannot read identity file {path}: {exc.strerror}") from exc
    try:
        # Check the file we actually opened, so that it cannot be swapped after the check.
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise IdentityFileError(f"identity file {path} is not a regular file")
        if os.name == "posix" and mode & 0o077:
            raise IdentityFileError(
                f"identity file {path} is accessible to group or others (mode "
                f"{stat.S_IMODE(mode):03o}); it holds a private key, so restrict it with "
                f"`chmod 600 {path}`"
            )
        pem = _read_at_most(fd, _MAX_IDENTITY_FILE_BYTES + 1)
    except OSError as exc:
        raise IdentityFileError(f"cannot read identity file {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(pem) > _MAX_IDENTITY_FILE_BYTES:
        raise IdentityFileError(f"identity file {path} is too large to be a private key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise IdentityFileError(
            f"identity file {path} is not an unencrypted PEM private key ({exc}); move it away "
            f"to have a new identity created there"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityFileError(
            f"identity file {path} holds a {type(key).__name__}, but an identity is an Ed25519 "
            f"private key; move it away to have a new identity created there"
        )
    return Identity(key)


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks = []
    while limit > 0:
        chunk = os.read(fd, limit)
        if not chunk:
            break
        chunks.append(chunk)
        limit -= len(chunk)
    return b"".join(chunks)


def _create_identity_file(path: Path) -> Identity | None:
    """Write a fresh identity to ``path``; None if another process created that file first.

    The key goes to a private temporary file first and is then hard-linked into place, so the file
    never exists with other permissions, and no reader ever sees it half-written.
    """
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise IdentityFileError(
            f"cannot create the directory for identity file {path}: {exc.strerror}"
        ) from exc
    identity = Identity.generate()
    pem = identity.private_key_pem()
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    _write_private_file(path, temporary, pem)
    try:
        os.link(temporary, path)
    except FileExistsError:
        return None
    except OSError:
        # No hard links on this filesystem: fall back to creating the file exclusively in place.
        try:
            _write_private_file(path, path, pem)
        except FileExistsError:
            return None
    finally:
        temporary.unlink(missing_ok=True)
    return identity


def _write_private_file(identity_path: Path, target: Path, data: bytes) -> None:
    """Create ``target`` with mode 0600 and write ``data``; FileExistsError if it already exists."""
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(target, flags, 0o600)
    except FileExistsError:
        raise
    except OSError as exc:
        raise IdentityFileError(
            f"cannot create identity file {identity_path}: {exc.strerror}"
        ) from exc
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except OSError as exc:
        target.unlink(missing_ok=True)
        raise IdentityFileError(
            f"cannot write identity file {identity_path}: {exc.strerror}"
        ) from exc
