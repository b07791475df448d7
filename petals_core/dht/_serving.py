"""The DHT's server side: the ``dht.*`` RPCs a node answers from its table, records and topics.

Every request carries the caller's listen multiaddr, noted in the routing table, or
``"client": true`` from a client-mode node, which is not.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .._errors import CodecError
from ..transport import Handlers, Multiaddr, PeerID, ServerCall
from ._messages import (
    MAX_RECORDS_PER_REPLY,
    caller_contact_untrusted,
    decode_records_untrusted,
    encode_contacts,
    key_untrusted,
    target_untrusted,
)
from ._record_store import RecordStore
from ._records import encode_record
from ._routing import Contact, NodeID, RoutingTable
from ._topic import Topic, reply_for

__all__ = ["DHTService"]

logger = logging.getLogger(__name__)


@attrs.define(kw_only=True, eq=False)
class DHTService:
    """Answers ``dht.ping``, ``dht.find_node``, ``dht.find_value``, ``dht.store`` and
    ``dht.gossip``; the node it belongs to acts on what callers reveal (``observe``)."""

    _peer_id: PeerID
    _table: RoutingTable
    _records: RecordStore
    _topics: Mapping[str, Topic]
    _k: int
    _clock: Callable[[], float]
    _observe: Callable[[Contact, float], None]
    #: Requests answered or refused so far.
    served: int = attrs.field(default=0, init=False)
    #: Requests from server-mode callers not noted in the routing table (see
    #: ``caller_contact_untrusted``).
    unnoted: int = attrs.field(default=0, init=False)

    def handlers(self) -> Handlers:
        handlers = Handlers()
        handlers.add_unary("dht.ping", self._ping)
        handlers.add_unary("dht.find_node", self._find_node)
        handlers.add_unary("dht.find_value", self._find_value)
        handlers.add_unary("dht.store", self._store)
        handlers.add_unary("dht.gossip", self._gossip)
        return handlers

    def _caller(self, request: object, call: ServerCall) -> dict[str, Any]:
        """Check the fields every request carries and note the caller in the routing table."""
        if not isinstance(request, dict):
            raise CodecError("a request is a map")
        self.served += 1
        now = self._clock()
        remote_host = None if call.connection.relay is not None else call.remote_address[0]
        contact = caller_contact_untrusted(request, call.peer_id, remote_host, now)
        if contact is not None:
            self._observe(contact, now)
        elif request.get("client") is not True:
            self.unnoted += 1
            logger.debug(
                "%s calls from %s but names %s: served, not noted",
                call.peer_id,
                "a relay" if remote_host is None else remote_host,
                request.get("address"),
            )
        return request

    async def _ping(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        self._caller(request, call)
        reply: dict[str, Any] = {"peer_id": str(self._peer_id)}
        if call.connection.relay is None:
            # Where the caller's datagrams come from: behind a NAT, its public mapping.
            reply["observed"] = str(Multiaddr.from_socket_address(*call.connection.current_address))
        return reply

    async def _find_node(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        self._caller(request, call)
        closest = self._table.closest(target_untrusted(request), self._k)
        return {"contacts": encode_contacts(closest)}

    async def _find_value(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        self._caller(request, call)
        key = key_untrusted(request)
        held = self._records.get(key, self._clock())
        kept = held.records(key) if held else ()
        if len(kept) > MAX_RECORDS_PER_REPLY:  # a store allowed more: those expiring last
            kept = tuple(sorted(kept, key=lambda r: -r.expiration)[:MAX_RECORDS_PER_REPLY])
        records = [encode_record(r) for r in kept]
        closest = self._table.closest(NodeID.from_key(key), self._k)
        return {"records": records, "contacts": encode_contacts(closest)}

    async def _store(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        self._caller(request, call)
        records = decode_records_untrusted(request.get("records"))
        now = self._clock()
        results = []
        for record in records:
            outcome = self._records.store(record, now, from_peer=str(call.peer_id))
            reason = outcome.reason
            results.append(None if reason is None else f"{reason.value}: {outcome.message}")
        return {"results": results}

    async def _gossip(self, request: dict[str, Any], call: ServerCall) -> dict[str, Any]:
        self._caller(request, call)
        prefix = request.get("prefix")
        topic = self._topics.get(prefix) if isinstance(prefix, str) else None
        if topic is None:
            raise CodecError(f"this node does not follow {prefix!r}")
        caller = str(call.peer_id)
        reply, others = reply_for(caller, topic.on_message(caller, request))
        for action in others:
            topic.send_soon(action)
        return reply
