"""DHT records, sans-IO: a record and its signature, what a key holds, how answers from
several nodes merge, records on the wire, and :class:`ServerInfo`, the value servers announce.

A key holds either one value or a dictionary of subkeys, each entry with its own expiration; the
rules of storing them are :class:`RecordStore`'s (``_record_store``).

**Ownership.**  A name that parses as a PeerID (``PeerID.from_string``) belongs to that peer.  A
record whose subkey is a PeerID must be signed by that peer's key; a record whose key is a PeerID
must be too (and so has that PeerID as subkey).  Every signed record has its signer's PeerID as
subkey, so no one can file a record in another's name, and only the owner can replace its entry.
Anything else may be unsigned.  A signature covers key, subkey, value and expiration (a
canonical, domain-separated encoding), so none can be altered nor the record moved.
"""

from __future__ import annotations

import enum
import math
import struct
import types
from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple, TypeVar

import attrs

from .._errors import CodecError, ConfigError, LocalProtocolError
from ..transport import (
    CodecLimits,
    Identity,
    Multiaddr,
    PeerID,
    decode_message_untrusted,
    encode_message,
    verify_signature,
)

__all__ = [
    "DEFAULT_MAX_VALUE_BYTES",
    "MAX_ANNOUNCEMENT_S",
    "MAX_RATE",
    "Entry",
    "Record",
    "ServerInfo",
    "ServerState",
    "StoreRefusal",
    "StoreResult",
    "StoredValue",
    "decode_record_untrusted",
    "encode_record",
    "merge",
    "merge_records",
]

MAX_KEY_BYTES: Final = 512

MAX_SUBKEY_BYTES: Final = 128

DEFAULT_MAX_VALUE_BYTES: Final = 64 << 10

_PUBLIC_KEY_BYTES: Final = 32

_SIGNATURE_BYTES: Final = 64

# Domain separation: these signatures can never be mistaken for any other message signed with
# the node's key (the TLS handshake's, or a later record format's).
_SIGNATURE_DOMAIN: Final = b"petals-core/dht-record/v1\x00"


def _utf8_bytes(text: str) -> int:
    try:
        return len(text.encode())
    except UnicodeEncodeError:
        raise LocalProtocolError(f"{text!r} is not valid UTF-8 text") from None


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _to_float(value: Any) -> Any:
    """Ints become floats; anything else is left for the validator to refuse."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return math.inf
    return value


def peer_id_or_none(name: str | None) -> PeerID | None:
    if name is None:
        return None
    try:
        return PeerID.from_string(name)
    except ConfigError:
        return None


def _signed_bytes(key: str, subkey: str | None, value: bytes, expiration: float) -> bytes:
    """The canonical bytes a record's signature covers: the domain, then each field behind its
    length (the subkey behind a presence flag), then the expiration as a big-endian double."""
    key_bytes = key.encode()
    subkey_part = b"\x00" if subkey is None else b"\x01" + _length_prefixed(subkey.encode())
    return b"".join(
        (
            _SIGNATURE_DOMAIN,
            _length_prefixed(key_bytes),
            subkey_part,
            _length_prefixed(value),
            struct.pack(">d", expiration),
        )
    )


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


class StoreRefusal(enum.Enum):
    """Why a :class:`RecordStore` refused a record."""

    EXPIRED = "expired"
    EXPIRATION_TOO_FAR = "expiration too far"
    VALUE_TOO_LARGE = "value too large"
    #: The key or subkey is a PeerID, and the record is not signed.
    UNSIGNED_PROTECTED = "unsigned protected"
    #: Signed by a key whose PeerID is not the record's subkey (or not its PeerID key).
    WRONG_SIGNER = "wrong signer"
    #: The signature does not match the record's contents.
    BAD_SIGNATURE = "bad signature"
    #: A single value for a key that holds unexpired dictionary entries.
    KEY_HOLDS_DICTIONARY = "key holds dictionary"
    #: What we hold for that key and subkey is newer.
    OLDER = "older"
    #: The sending peer holds its quota of records or bytes here.
    PEER_QUOTA = "peer quota"
    #: The key holds ``max_subkeys_per_key`` entries, none expiring sooner than this one.
    KEY_FULL = "key full"
    #: The store is full of entries none of which expires sooner than this one.
    STORE_FULL = "store full"


@attrs.frozen
class StoreResult:
    """What :meth:`RecordStore.store` did: ``reason`` is None when the record was accepted."""

    reason: StoreRefusal | None = None
    message: str = ""

    @property
    def accepted(self) -> bool:
        return self.reason is None


ACCEPTED: Final = StoreResult()


def _check_record(record: Record) -> None:
    if not isinstance(record.key, str):
        raise LocalProtocolError(f"a record key is str, not {type(record.key).__name__}")
    if not 1 <= _utf8_bytes(record.key) <= MAX_KEY_BYTES:
        raise LocalProtocolError(f"a record key is 1 to {MAX_KEY_BYTES} bytes of UTF-8")
    if record.subkey is not None:
        if not isinstance(record.subkey, str):
            raise LocalProtocolError(f"a subkey is str or None, not {type(record.subkey).__name__}")
        if not 1 <= _utf8_bytes(record.subkey) <= MAX_SUBKEY_BYTES:
            raise LocalProtocolError(f"a subkey is 1 to {MAX_SUBKEY_BYTES} bytes of UTF-8")
    if not isinstance(record.value, bytes):
        raise LocalProtocolError(f"a record value is bytes, not {type(record.value).__name__}")
    if not isinstance(record.expiration, float) or not math.isfinite(record.expiration):
        raise LocalProtocolError(f"an expiration is a finite number, not {record.expiration!r}")
    if (record.signer is None) != (record.signature is None):
        raise LocalProtocolError("a record has both a signer and a signature, or neither")
    if record.signer is not None and (
        not isinstance(record.signer, bytes) or len(record.signer) != _PUBLIC_KEY_BYTES
    ):
        raise LocalProtocolError(f"a signer is a raw {_PUBLIC_KEY_BYTES}-byte Ed25519 key")
    if record.signature is not None and (
        not isinstance(record.signature, bytes) or len(record.signature) != _SIGNATURE_BYTES
    ):
        raise LocalProtocolError(f"a signature is {_SIGNATURE_BYTES} bytes")


@attrs.frozen
class Record:
    """One entry under ``key`` (and ``subkey``, None for a single value), as stored and sent.

    ``expiration`` is absolute, in seconds on the clock that ``now`` uses.  A signed record
    carries its signer's raw Ed25519 public key; build one with :meth:`signed`.  A record the
    protocol cannot carry (wrong types, sizes, a non-finite expiration) raises
    :class:`LocalProtocolError`.
    """

    key: str
    subkey: str | None
    value: bytes = attrs.field(repr=lambda value: f"<{len(value)} bytes>")
    expiration: float = attrs.field(converter=_to_float)
    signer: bytes | None = attrs.field(default=None, repr=False)
    signature: bytes | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        _check_record(self)

    @classmethod
    def signed(cls, identity: Identity, key: str, value: bytes, expiration: float) -> Record:
        """A record filed under ``identity``'s PeerID as subkey, signed by its key."""
        subkey = str(identity.peer_id)
        unsigned = cls(key, subkey, value, expiration)  # validates before anything is signed
        signature = identity.sign(_signed_bytes(key, subkey, value, unsigned.expiration))
        return attrs.evolve(unsigned, signer=identity.public_key_bytes, signature=signature)

    @property
    def entry(self) -> Entry:
        return Entry(self.value, self.expiration, self.signer, self.signature)

    def verify(self) -> bool:
        """Whether the record's authorship holds: see the ownership rule in the module docstring.

        An unsigned record verifies unless its key or subkey is a PeerID; a signed one only if
        its signer's PeerID is its subkey (and its key, if that is a PeerID) and the signature
        matches.  Expiration and size are the store's business, not this.
        """
        return authorship_problem(self) is None


def authorship_problem(record: Record) -> StoreResult | None:
    key_owner = peer_id_or_none(record.key)
    if record.signer is None or record.signature is None:
        if key_owner is not None or peer_id_or_none(record.subkey) is not None:
            return StoreResult(
                StoreRefusal.UNSIGNED_PROTECTED,
                f"key {record.key!r} / subkey {record.subkey!r} names a peer, and the record is "
                f"not signed",
            )
        return None
    signer = PeerID.from_public_key(record.signer)
    if record.subkey != str(signer) or key_owner not in (None, signer):
        return StoreResult(
            StoreRefusal.WRONG_SIGNER,
            f"signed by {signer}, which may file records only under its own PeerID, not under "
            f"key {record.key!r} / subkey {record.subkey!r}",
        )
    data = _signed_bytes(record.key, record.subkey, record.value, record.expiration)
    if not verify_signature(record.signer, record.signature, data):
        return StoreResult(StoreRefusal.BAD_SIGNATURE, f"signature by {signer} does not match")
    return None


class Entry(NamedTuple):
    """One value with its expiration, and its signer and signature when signed."""

    value: bytes
    expiration: float
    signer: bytes | None = None
    signature: bytes | None = None


def rank(entry: Entry) -> tuple[float, bytes, bytes, bytes]:
    return (entry.expiration, entry.value, entry.signer or b"", entry.signature or b"")


def _frozen_entries(entries: Mapping[str | None, Entry]) -> Mapping[str | None, Entry]:
    return types.MappingProxyType(dict(entries))


@attrs.frozen
class StoredValue:
    """What a key holds: ``{None: entry}`` for a single value, ``{subkey: entry, ...}`` for a
    dictionary (never both kinds).  Compares by contents; read-only."""

    entries: Mapping[str | None, Entry] = attrs.field(converter=_frozen_entries, hash=False)

    def __attrs_post_init__(self) -> None:
        if not self.entries or (None in self.entries and len(self.entries) > 1):
            raise LocalProtocolError("a stored value is one single value or a dictionary")

    @property
    def is_dictionary(self) -> bool:
        return None not in self.entries

    @property
    def expiration(self) -> float:
        """The latest expiration among the entries."""
        return max(entry.expiration for entry in self.entries.values())

    def records(self, key: str) -> tuple[Record, ...]:
        """The entries as records under ``key``, ready for :func:`encode_record`."""
        return tuple(Record(key, subkey, *entry) for subkey, entry in self.entries.items())


def merge(a: StoredValue | None, b: StoredValue | None) -> StoredValue | None:
    """Merge what several nodes hold for one key: per subkey (or for the single value) the
    highest-ranking entry wins, and a dictionary wins over a single value.

    Commutative and associative, with None as the identity, so answers merge in any order.
    """
    if a is None:
        return b
    if b is None:
        return a
    if a.is_dictionary != b.is_dictionary:
        return a if a.is_dictionary else b
    entries = dict(a.entries)
    for subkey, entry in b.entries.items():
        mine = entries.get(subkey)
        if mine is None or rank(entry) > rank(mine):
            entries[subkey] = entry
    return StoredValue(entries)


def merge_records(key: str, records: Iterable[Record], now: float) -> StoredValue | None:
    """Merge records that peers returned for ``key``, keeping only those under ``key``, unexpired
    at ``now`` and passing :meth:`Record.verify`."""
    merged: StoredValue | None = None
    for record in records:
        if record.key == key and record.expiration > now and record.verify():
            merged = merge(merged, StoredValue({record.subkey: record.entry}))
    return merged


def encode_record(record: Record) -> dict[str, Any]:
    """The record as a CBOR-ready map; absent subkey, signer and signature are left out."""
    message: dict[str, Any] = {
        "key": record.key,
        "value": record.value,
        "expiration": record.expiration,
    }
    if record.subkey is not None:
        message["subkey"] = record.subkey
    if record.signer is not None:
        message["signer"] = record.signer
        message["signature"] = record.signature
    return message


def decode_record_untrusted(
    obj: object, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
) -> Record:
    """A record from a map a peer sent (as :func:`decode_message_untrusted` returns it).

    Checks every field's type and size and nothing about authorship (see :meth:`Record.verify`).
    Unknown fields are ignored; a missing or null subkey, signer or signature is None.  Raises
    only :class:`CodecError`.
    """
    if not isinstance(obj, dict):
        raise CodecError(f"a record is a map, not {type(obj).__name__}")
    key: Any = obj.get("key")
    value: Any = obj.get("value")
    if isinstance(value, bytes) and len(value) > max_value_bytes:
        raise CodecError(f"a record value of {len(value)} bytes exceeds {max_value_bytes}")
    expiration = obj.get("expiration")
    if not _is_number(expiration):
        raise CodecError(f"a record's expiration is a number, not {type(expiration).__name__}")
    try:
        return Record(
            key, obj.get("subkey"), value, expiration, obj.get("signer"), obj.get("signature")
        )
    except LocalProtocolError as exc:
        raise CodecError(f"invalid record: {exc}") from None


class ServerState(enum.StrEnum):
    """What a server announces about itself."""

    JOINING = "joining"
    ONLINE = "online"
    OFFLINE = "offline"


_MAX_NAME_BYTES: Final = 256

_MAX_ADAPTERS: Final = 64

_MAX_PINGS: Final = 256

_MAX_ADDRESSES: Final = 8

#: The most throughput or requests per second an announcement may claim: far beyond any
#: device, and small enough that sums over every server of a block stay finite.
MAX_RATE: Final = 1e9
#: The longest a server's announcement may last: peer tables keep none longer, so a flood of
#: made-up announcements holds a block's key for an hour at most.
MAX_ANNOUNCEMENT_S: Final = 3600.0
_MAX_BLOCKS: Final = 2**32

_MAX_TOKENS: Final = 2**63

_Record = TypeVar("_Record", bound=attrs.AttrsInstance)

# An announcement is small: these bound the work of decoding one whatever a peer sends.  Tensors
# are left raw, so decoding never imports torch.
_SERVER_INFO_LIMITS: Final = CodecLimits(
    max_frame_bytes=DEFAULT_MAX_VALUE_BYTES,
    max_depth=8,
    max_container_items=4096,
    max_string_bytes=4096,
).without_tensors()


def _to_state(value: Any) -> Any:
    if isinstance(value, str) and value in ServerState._value2member_map_:
        return ServerState(value)
    return value


def _to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list | tuple) else value


def _to_pings(value: Any) -> Any:
    if isinstance(value, Mapping):
        return types.MappingProxyType({peer: _to_float(rtt) for peer, rtt in value.items()})
    return value


def decode_value_untrusted(
    cls: type[_Record], what: str, data: bytes | bytearray | memoryview, limits: CodecLimits
) -> _Record:
    """The attrs record ``cls`` (called ``what`` in errors) from a value a peer stored: fields
    it does not know are ignored and a null field counts as absent.  Raises only
    :class:`CodecError`."""
    message = decode_message_untrusted(data, limits=limits, tensors="raw")
    fields = attrs.fields(cls)
    missing = [f.name for f in fields if f.default is attrs.NOTHING and message.get(f.name) is None]
    if missing:
        raise CodecError(f"{what} lacks {', '.join(missing)}")
    known = {f.name: message[f.name] for f in fields if message.get(f.name) is not None}
    try:
        return cls(**known)
    except LocalProtocolError as exc:
        raise CodecError(f"invalid {what}: {exc}") from None


def _check_name(field: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str):
        raise LocalProtocolError(f"{field} is text, not {type(value).__name__}")
    if _utf8_bytes(value) > _MAX_NAME_BYTES:
        raise LocalProtocolError(f"{field} is longer than {_MAX_NAME_BYTES} bytes")


def _check_rate(field: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, float) or not 0 <= value <= MAX_RATE:
        raise LocalProtocolError(f"{field} is a number from 0 to {MAX_RATE:g}, not {value!r}")


def _check_count(field: str, value: object, low: int, high: int, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise LocalProtocolError(f"{field} is an integer in [{low}, {high}), not {value!r}")


def _check_server_info(info: ServerInfo) -> None:
    if not isinstance(info.state, ServerState):
        raise LocalProtocolError(
            f"state is one of {[state.value for state in ServerState]}, not {info.state!r}"
        )
    _check_rate("throughput", info.throughput)
    _check_count("start_block", info.start_block, 0, _MAX_BLOCKS)
    _check_count("end_block", info.end_block, info.start_block + 1, _MAX_BLOCKS + 1)
    _check_name("version", info.version)
    _check_name("torch_dtype", info.torch_dtype)
    _check_name("quant_type", info.quant_type)
    _check_name("public_name", info.public_name, optional=True)
    _check_name("reachability", info.reachability, optional=True)
    if info.relay is not None and not isinstance(info.relay, bool):
        raise LocalProtocolError(f"relay is true or false, not {info.relay!r}")
    _check_count("push_grants", info.push_grants, 1, 2**16, optional=True)
    _check_rate("inference_rps", info.inference_rps, optional=True)
    _check_rate("forward_rps", info.forward_rps, optional=True)
    if not isinstance(info.adapters, tuple) or len(info.adapters) > _MAX_ADAPTERS:
        raise LocalProtocolError(f"adapters are a list of at most {_MAX_ADAPTERS} names")
    for adapter in info.adapters:
        _check_name("an adapter name", adapter)
    _check_count("cache_tokens_left", info.cache_tokens_left, 0, _MAX_TOKENS, optional=True)
    _check_count("inference_max_length", info.inference_max_length, 1, _MAX_TOKENS, optional=True)
    if not isinstance(info.addresses, tuple) or len(info.addresses) > _MAX_ADDRESSES:
        raise LocalProtocolError(f"addresses are a list of at most {_MAX_ADDRESSES} multiaddrs")
    for address in info.addresses:
        _check_name("an address", address)
        try:
            Multiaddr.parse(address)
        except ConfigError as exc:
            raise LocalProtocolError(f"an address is not a multiaddr: {exc}") from None
    if not isinstance(info.next_pings, Mapping) or len(info.next_pings) > _MAX_PINGS:
        raise LocalProtocolError(f"next_pings maps at most {_MAX_PINGS} PeerIDs to seconds")
    for peer, rtt in info.next_pings.items():
        if not isinstance(peer, str) or peer_id_or_none(peer) is None:
            raise LocalProtocolError(f"next_pings keys are PeerIDs, not {peer!r}")
        _check_rate(f"the ping to {peer}", rtt)


@attrs.frozen(kw_only=True)
class ServerInfo:
    """What a server announces under each of its blocks' keys, with its PeerID as subkey.

    Blocks ``start_block`` to ``end_block`` (exclusive) are served; ``throughput`` and the
    ``*_rps`` are requests per second; ``next_pings`` maps the PeerIDs of servers this one could
    pass activations to onto round-trip times in seconds; ``addresses`` are the multiaddrs
    (with its PeerID) where clients and other servers dial it, best first (relayed ones first
    for a server behind a NAT).  None means unknown.
    Readers ignore fields they do not know, so newer servers may add some.  Invalid fields raise
    :class:`LocalProtocolError`.
    """

    state: ServerState = attrs.field(converter=_to_state)
    throughput: float = attrs.field(converter=_to_float)
    start_block: int
    end_block: int
    version: str
    torch_dtype: str
    quant_type: str = "none"
    public_name: str | None = None
    inference_rps: float | None = attrs.field(default=None, converter=_to_float)
    forward_rps: float | None = attrs.field(default=None, converter=_to_float)
    adapters: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    cache_tokens_left: int | None = None
    #: The longest session it opens and the longest sequence it computes, in positions.
    inference_max_length: int | None = None
    next_pings: Mapping[str, float] = attrs.field(factory=dict, converter=_to_pings, hash=False)
    addresses: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple)
    #: How others reach it: "public" (dialled directly), "cone" or "symmetric" (behind such a
    #: NAT: through a relay, or a punched hole from behind a cone NAT), "unknown" (not checked).
    reachability: str | None = None
    #: Whether it relays for servers that cannot be dialled.
    relay: bool | None = None
    #: The form of its clients' push grants it passes on and checks (see
    #: ``protocol._inference``); None: a server from before them, which drops them.
    push_grants: int | None = None

    def __attrs_post_init__(self) -> None:
        _check_server_info(self)

    def to_bytes(self) -> bytes:
        """The announcement as a CBOR map (fields that are None are left out)."""
        message: dict[str, Any] = {}
        for field in _SERVER_INFO_FIELDS:
            value = getattr(self, field)
            if value is not None:
                message[field] = value
        message["state"] = self.state.value
        message["next_pings"] = dict(self.next_pings)
        return encode_message(message)

    @classmethod
    def from_bytes_untrusted(cls, data: bytes | bytearray | memoryview) -> ServerInfo:
        """Read an announcement a peer published; unknown fields are ignored, and a null field
        counts as absent.  Raises only :class:`CodecError`."""
        return decode_value_untrusted(cls, "server info", data, _SERVER_INFO_LIMITS)


_SERVER_INFO_FIELDS: Final = tuple(field.name for field in attrs.fields(ServerInfo))
