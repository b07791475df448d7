from __future__ import annotations

import datetime
import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID
from hypothesis import given, strategies as st

import petals_core
from petals_core._errors import ConfigError, IdentityFileError, IdentityMismatch
from petals_core.transport._identity import (
    Identity,
    PeerID,
    _b58decode,
    _b58encode,
    check_certificate_identity,
    load_or_create_identity,
    peer_id_from_certificate,
    verify_signature,
)

posix_only = pytest.mark.skipif(os.name != "posix", reason="file modes are a POSIX notion")

private_seeds = st.binary(min_size=32, max_size=32)


def _write_key_file(path: Path, key: object, mode: int = 0o600) -> None:
    assert isinstance(key, Ed25519PrivateKey | rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(mode)


# -- base58 ----------------------------------------------------------------------------------------

# Bitcoin Core's base58 test vectors.
BASE58_VECTORS = [
    ("", ""),
    ("61", "2g"),
    ("626262", "a3gV"),
    ("636363", "aPEr"),
    ("73696d706c792061206c6f6e6720737472696e67", "2cFupjhnEsSn59qHXstmK2ffpLv2"),
    ("00eb15231dfceb60925886b67d065299925915aeb172c06647", "1NS17iag9jJgTHD1VXjvLCEnZuQ3rJDE9L"),
    ("516b6fcd0f", "ABnLTmg"),
    ("bf4f89001e670274dd", "3SEo3LWLoPntC"),
    ("572e4794", "3EFU7m"),
    ("ecac89cad93923c02321", "EJDM8drfXA6uyA"),
    ("10c8511e", "Rt5zm"),
    ("00000000000000000000", "1111111111"),
]


@pytest.mark.parametrize(("hex_data", "encoded"), BASE58_VECTORS)
def test_base58_vectors(hex_data: str, encoded: str) -> None:
    assert _b58encode(bytes.fromhex(hex_data)) == encoded
    assert _b58decode(encoded) == bytes.fromhex(hex_data)


@given(st.binary(max_size=80))
def test_base58_round_trip(data: bytes) -> None:
    assert _b58decode(_b58encode(data)) == data


# -- PeerID ----------------------------------------------------------------------------------------


def test_peer_id_is_sha256_multihash_of_raw_public_key() -> None:
    identity = Identity.generate()
    expected = b"\x12\x20" + hashlib.sha256(identity.public_key_bytes).digest()
    assert identity.peer_id.to_bytes() == expected
    assert PeerID.from_public_key(identity.private_key.public_key()) == identity.peer_id
    assert PeerID.from_public_key(identity.public_key_bytes) == identity.peer_id
    text = str(identity.peer_id)
    assert text.startswith("Qm")
    assert len(text) == 46
    assert repr(identity.peer_id) == f"PeerID('{text}')"


@given(private_seeds)
def test_peer_id_string_and_bytes_round_trip(seed: bytes) -> None:
    peer_id = Identity.from_private_bytes(seed).peer_id
    assert PeerID.from_string(str(peer_id)) == peer_id
    assert PeerID.from_bytes(peer_id.to_bytes()) == peer_id
    assert hash(PeerID.from_string(str(peer_id))) == hash(peer_id)


@given(private_seeds, private_seeds)
def test_peer_id_orders_by_multihash_bytes(seed_a: bytes, seed_b: bytes) -> None:
    a = Identity.from_private_bytes(seed_a).peer_id
    b = Identity.from_private_bytes(seed_b).peer_id
    assert (a < b) == (a.to_bytes() < b.to_bytes())
    assert (a == b) == (seed_a == seed_b)


def test_peer_id_matches_only_its_key() -> None:
    identity, other = Identity.generate(), Identity.generate()
    assert identity.peer_id.matches(identity.public_key_bytes)
    assert not identity.peer_id.matches(other.public_key_bytes)
    assert not identity.peer_id.matches(identity.public_key_bytes[:31])
    assert not identity.peer_id.matches(b"")


def _libp2p_style_ed25519_peer_id() -> str:
    # libp2p prints Ed25519 PeerIDs as the identity multihash of a protobuf-wrapped key: 12D3KooW...
    raw = Identity.from_private_bytes(bytes(range(32))).public_key_bytes
    return _b58encode(b"\x00\x24\x08\x01\x12\x20" + raw)


VALID_PEER_ID = str(Identity.from_private_bytes(bytes(32)).peer_id)
VALID_PEER_ID_BYTES = PeerID.from_string(VALID_PEER_ID).to_bytes()


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Qm",
        VALID_PEER_ID[:-1],
        VALID_PEER_ID + "1",
        VALID_PEER_ID + "z",
        " " + VALID_PEER_ID,
        VALID_PEER_ID + "\n",
        VALID_PEER_ID.replace(VALID_PEER_ID[5], "0", 1),  # '0' is not in the alphabet
        "QmIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIIII",  # neither is 'I'
        "1" + VALID_PEER_ID,  # a leading zero byte
        _libp2p_style_ed25519_peer_id(),
        _b58encode(b"\x12\x1f" + bytes(31)),  # sha2-256 code with the wrong digest length
        _b58encode(b"\x13\x20" + bytes(32)),  # sha2-512 code
        "Qm" + "z" * 200,
    ],
)
def test_invalid_peer_id_strings_are_rejected(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        PeerID.from_string(text)
    assert f"invalid PeerID {text!r}" in str(info.value)


def test_invalid_peer_id_error_names_the_string() -> None:
    with pytest.raises(ConfigError, match="QmNotAPeer0"):
        PeerID.from_string("QmNotAPeer0")


@pytest.mark.parametrize(
    "data", [b"", bytes(34), b"\x12\x20" + bytes(31), b"\x12\x20" + bytes(33), b"\x00" * 36]
)
def test_invalid_peer_id_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(ConfigError):
        PeerID.from_bytes(data)


def test_peer_id_rejects_wrong_types() -> None:
    with pytest.raises(TypeError):
        PeerID.from_string(b"Qm")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        PeerID.from_public_key("key")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        PeerID.from_public_key(bytes(31))
    with pytest.raises(TypeError):
        PeerID.from_bytes(34)  # type: ignore[arg-type]
    assert PeerID.from_bytes(bytearray(VALID_PEER_ID_BYTES)).to_bytes() == VALID_PEER_ID_BYTES


def test_peer_id_is_frozen() -> None:
    peer_id = Identity.generate().peer_id
    with pytest.raises(AttributeError):
        peer_id._multihash = b""  # type: ignore[misc]


# -- Identity --------------------------------------------------------------------------------------


def test_identity_from_private_bytes_is_deterministic() -> None:
    seed = bytes(range(32))
    a, b = Identity.from_private_bytes(seed), Identity.from_private_bytes(seed)
    assert a.peer_id == b.peer_id
    assert a.public_key_bytes == b.public_key_bytes
    assert len(a.public_key_bytes) == 32
    with pytest.raises(ConfigError):
        Identity.from_private_bytes(seed[:31])


def test_identity_repr_does_not_leak_the_key() -> None:
    identity = Identity.generate()
    raw = identity.private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    assert repr(identity) == f"Identity(peer_id={identity.peer_id!r})"
    assert raw.hex() not in repr(identity)


# -- signatures ------------------------------------------------------------------------------------


@given(st.binary(max_size=256))
def test_signatures_verify(data: bytes) -> None:
    identity = Identity.from_private_bytes(bytes(32))
    signature = identity.sign(data)
    assert verify_signature(identity.public_key_bytes, signature, data)
    assert not verify_signature(identity.public_key_bytes, signature, data + b"x")


def test_tampered_signatures_do_not_verify() -> None:
    identity, other = Identity.generate(), Identity.generate()
    data = b"announce: blocks 0..8"
    signature = identity.sign(data)
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify_signature(identity.public_key_bytes, flipped, data)
    assert not verify_signature(identity.public_key_bytes, signature, b"announce: blocks 0..9")
    assert not verify_signature(other.public_key_bytes, signature, data)


@pytest.mark.parametrize(
    ("key", "signature"),
    [(b"", b""), (bytes(31), bytes(64)), (bytes(32), bytes(63)), (bytes(32), bytes(65))],
)
def test_verify_signature_never_raises_on_malformed_input(key: bytes, signature: bytes) -> None:
    assert verify_signature(key, signature, b"data") is False


# -- certificates ----------------------------------------------------------------------------------


def test_certificate_carries_the_key() -> None:
    identity = Identity.generate()
    cert = identity.certificate
    assert peer_id_from_certificate(cert) == identity.peer_id
    assert check_certificate_identity(cert, identity.peer_id) == identity.peer_id
    assert check_certificate_identity(cert, None) == identity.peer_id
    common_name = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
    assert common_name == str(identity.peer_id)
    cert.verify_directly_issued_by(cert)
    assert cert is identity.certificate


def test_certificate_validity_does_not_depend_on_clocks() -> None:
    cert = Identity.generate().certificate
    assert cert.not_valid_before_utc == datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    assert cert.not_valid_after_utc == datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC)


def test_certificate_pem_round_trips() -> None:
    identity = Identity.generate()
    loaded = x509.load_pem_x509_certificate(identity.certificate_pem)
    assert peer_id_from_certificate(loaded) == identity.peer_id


def test_certificate_of_another_key_is_a_mismatch() -> None:
    identity, impostor = Identity.generate(), Identity.generate()
    with pytest.raises(IdentityMismatch) as info:
        check_certificate_identity(impostor.certificate, identity.peer_id)
    assert str(identity.peer_id) in str(info.value)
    assert str(impostor.peer_id) in str(info.value)


def test_certificate_without_ed25519_key_is_a_mismatch() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "not a peer")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
        .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=datetime.UTC))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(IdentityMismatch, match="Ed25519"):
        peer_id_from_certificate(cert)
    with pytest.raises(IdentityMismatch):
        check_certificate_identity(cert, None)


# -- identity files --------------------------------------------------------------------------------


@posix_only
def test_identity_file_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "nested" / "identity.pem"
    identity = load_or_create_identity(path)
    assert path.exists()
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["identity.pem"]  # no temporary left
    loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
    assert isinstance(loaded, Ed25519PrivateKey)
    assert Identity(loaded).peer_id == identity.peer_id


@posix_only
def test_identity_file_is_private_even_with_permissive_umask(tmp_path: Path) -> None:
    previous = os.umask(0)
    try:
        load_or_create_identity(tmp_path / "identity.pem")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "identity.pem").st_mode & 0o777 == 0o600


def test_identity_file_is_reused(tmp_path: Path) -> None:
    path = tmp_path / "identity.pem"
    first = load_or_create_identity(path)
    second = load_or_create_identity(str(path))
    assert first.peer_id == second.peer_id


def test_identity_file_written_by_hand_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "identity.pem"
    key = Ed25519PrivateKey.generate()
    _write_key_file(path, key)
    assert load_or_create_identity(path).peer_id == Identity(key).peer_id


def test_concurrent_creators_agree_on_one_identity(tmp_path: Path) -> None:
    path = tmp_path / "identity.pem"
    results: list[PeerID] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(load_or_create_identity(path).peer_id)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8
    assert set(results) == {load_or_create_identity(path).peer_id}


@posix_only
def test_identity_file_without_hard_links_is_still_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "identity.pem"
    identity = load_or_create_identity(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["identity.pem"]
    assert load_or_create_identity(path).peer_id == identity.peer_id


@posix_only
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602, 0o666])
def test_identity_file_accessible_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "identity.pem"
    _write_key_file(path, Ed25519PrivateKey.generate(), mode=mode)
    with pytest.raises(IdentityFileError) as info:
        load_or_create_identity(path)
    assert str(path) in str(info.value)
    assert f"chmod 600 {path}" in str(info.value)
    assert os.stat(path).st_mode & 0o777 == mode  # left alone: the owner decides


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not a key at all\n",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        bytes(range(256)),
    ],
)
def test_identity_file_with_garbage_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "identity.pem"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(IdentityFileError, match="not an unencrypted PEM private key") as info:
        load_or_create_identity(path)
    assert str(path) in str(info.value)
    assert path.read_bytes() == content  # never overwritten


@pytest.mark.parametrize(
    "key",
    [
        pytest.param(rsa.generate_private_key(public_exponent=65537, key_size=2048), id="rsa"),
        pytest.param(ec.generate_private_key(ec.SECP256R1()), id="ec"),
    ],
)
def test_identity_file_with_other_key_type_is_refused(tmp_path: Path, key: object) -> None:
    path = tmp_path / "identity.pem"
    _write_key_file(path, key)
    with pytest.raises(IdentityFileError, match="Ed25519") as info:
        load_or_create_identity(path)
    assert str(path) in str(info.value)


def test_encrypted_identity_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.pem"
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"secret"),
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    with pytest.raises(IdentityFileError, match="unencrypted"):
        load_or_create_identity(path)


def test_identity_path_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.pem"
    path.mkdir(mode=0o700)
    with pytest.raises(IdentityFileError) as info:
        load_or_create_identity(path)
    assert str(path) in str(info.value)


def test_identity_file_under_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    with pytest.raises(IdentityFileError):
        load_or_create_identity(blocker / "identity.pem")


# -- import hygiene --------------------------------------------------------------------------------


def test_importing_identity_and_multiaddr_does_not_import_torch() -> None:
    root = Path(petals_core.__file__).resolve().parents[1]
    code = (
        "import sys\n"
        "import petals_core.transport._identity, petals_core.transport._multiaddr\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
