"""What the DHT's requests and replies carry: contacts, records, keys and the caller's address.

Readers of what a peer sent end in ``_untrusted`` and raise :class:`CodecError` only: a request
that fails them is refused, and a reply that fails them counts as the peer's failure.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any, Final

import attrs

from .._errors import CodecError, ConfigError
from .._ip import ip_of
from ..transport import Multiaddr, PeerID
from ._records import Record, decode_record_untrusted
from ._routing import NODE_ID_BITS, Contact, NodeID

__all__ = ["MAX_RECORDS_PER_REPLY", "MAX_RECORDS_PER_REQUEST"]

#: Records one STORE request may carry.
MAX_RECORDS_PER_REQUEST: Final = 64
#: Records one FIND_VALUE reply may carry: every entry of a key (a block served by many servers,
#: a registry of many models), up to the record store's default ``max_subkeys_per_key``.
MAX_RECORDS_PER_REPLY: Final = 1024
#: Contacts we read from one reply (a peer returns at most its ``k``; more is padding).
_MAX_CONTACTS_PER_REPLY: Final = 64
_NODE_ID_BYTES: Final = NODE_ID_BITS // 8


def encode_contacts(contacts: Iterable[Contact]) -> list[list[str]]:
    return [[str(contact.peer_id), contact.address] for contact in contacts]


def decode_contacts_untrusted(obj: object, now: float) -> list[Contact]:
    if not isinstance(obj, list) or len(obj) > _MAX_CONTACTS_PER_REPLY:
        raise CodecError(f"contacts are a list of at most {_MAX_CONTACTS_PER_REPLY}")
    contacts = []
    for item in obj:
        if not (
            isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)
        ):
            raise CodecError("a contact is [peer_id, multiaddr]")
        try:
            peer_id = PeerID.from_string(item[0])
            address = Multiaddr.parse(item[1]).with_peer_id(peer_id)
        except (ConfigError, ValueError, TypeError) as exc:
            raise CodecError(f"invalid contact {item!r}: {exc}") from None
        contacts.append(Contact.from_peer_id(peer_id, str(address), last_seen=now))
    return contacts


def decode_records_untrusted(obj: object, limit: int = MAX_RECORDS_PER_REQUEST) -> list[Record]:
    if not isinstance(obj, list) or len(obj) > limit:
        raise CodecError(f"records are a list of at most {limit}")
    return [decode_record_untrusted(item) for item in obj]


def key_untrusted(request: dict[str, Any]) -> str:
    key = request.get("key")
    if not isinstance(key, str) or not key:
        raise CodecError("'key' must be a non-empty str")
    return key


def target_untrusted(request: dict[str, Any]) -> NodeID:
    target = request.get("target")
    if not isinstance(target, bytes) or len(target) != _NODE_ID_BYTES:
        raise CodecError(f"'target' must be {_NODE_ID_BYTES} bytes")
    return NodeID.from_bytes(target)


def caller_address_untrusted(
    request: dict[str, Any], peer_id: PeerID, alternative: str
) -> Multiaddr:
    """The ``address`` a request from ``peer_id`` gives for its caller; :class:`CodecError` if
    it is missing (the message names ``alternative``), malformed, or names another PeerID."""
    address = request.get("address")
    if not isinstance(address, str):
        raise CodecError(f"a request carries 'address' (a multiaddr str) {alternative}".strip())
    try:
        maddr = Multiaddr.parse(address)
    except ConfigError as exc:
        raise CodecError(f"invalid 'address': {exc}") from None
    if maddr.peer_id not in (None, peer_id):
        raise CodecError("'address' names a PeerID other than the caller's")
    return maddr


def caller_contact_untrusted(
    request: dict[str, Any], peer_id: PeerID, remote_host: str | None, now: float
) -> Contact | None:
    """The caller of ``request`` (``peer_id``, as its connection proved, calling from
    ``remote_host``; None when it came through a relay) as a contact for the routing table,
    placed by :func:`seen_from`.  None for a client-mode caller, which serves nothing, and for a
    caller that calls through a relay or names another host: it is served, but not handed to
    others as a contact."""
    if request.get("client") is True:
        return None
    maddr = caller_address_untrusted(request, peer_id, "or 'client': true")
    if remote_host is None:
        return None
    return seen_from(
        Contact.from_peer_id(peer_id, str(maddr.with_peer_id(peer_id)), last_seen=now),
        remote_host,
    )


def seen_from(contact: Contact, host: str) -> Contact | None:
    """``contact`` (at the address it named, or a third party named for it) as the routing table
    keeps it, given the ``host`` its connection really reaches: at the address it names if that
    is ``host``; at ``host`` with the port it names if it names a DNS name or a wildcard; None if
    it names another host or a relayed address (else anyone could have every node that learns
    of it dial a host of its choice)."""
    try:
        maddr = Multiaddr.parse(contact.address)
        if maddr.is_relayed:
            return None
        if maddr.dns is not None or ipaddress.ip_address(maddr.host).is_unspecified:
            moved = Multiaddr.from_socket_address(host, maddr.port, contact.peer_id)
            return attrs.evolve(contact, address=str(moved))
        return contact if _same_host(maddr.host, host) else None
    except (ConfigError, ValueError):
        # A host no multiaddr can name (an IPv6 zone), or an address that is not an IP.
        return None


def _same_host(a: str, b: str) -> bool:
    """Whether two IP addresses are one host's: equal, or in one IPv6 /64 (a host sends from
    temporary addresses of its /64); an IPv4-mapped IPv6 address is its IPv4 address."""
    first, second = ip_of(a), ip_of(b)
    if isinstance(first, ipaddress.IPv6Address) and isinstance(second, ipaddress.IPv6Address):
        return first.packed[:8] == second.packed[:8]
    return first == second
