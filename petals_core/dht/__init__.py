"""The peer table: Kademlia and gossip over the QUIC transport.

The sans-IO cores, each taking ``now`` (and a ``random.Random``) and returning actions for a
driver to carry out:

- the routing table: 160-bit node IDs derived from PeerIDs and record keys, the XOR metric, one
  k-bucket per distance bit with a replacement cache;
- iterative FIND_NODE / FIND_VALUE lookups with parallelism alpha, timeouts fed in as events;
- the record store: values and per-subkey dictionaries with expirations, newest wins, records
  under a PeerID signed by that peer, size / expiration / flood limits; ``ServerInfo`` is the
  value servers announce;
- push-pull gossip of announcements (digests, fan-out, TTL, de-duplication) and the immutable
  ``PeerTableSnapshot`` that routing reads.

``open_dht_node`` drives them over the QUIC transport with trio: the RPCs (ping, find_node,
find_value, store, gossip), bootstrap from initial peers, client mode, store / get, caching
along lookup paths, hand-off of records to nodes that join nearer their keys, republishing, and
``follow(prefix, num_blocks)``: a :class:`Topic` whose snapshot gossip and the DHT both feed.
Servers also file their model in the registry (:data:`MODELS_KEY`, :func:`register_model`), which
:func:`get_models` reads: how a monitor finds every model served.  Clients list fraud reports
and store their evidence under the model's prefix (``_fraud``).  Every node answers
``dht.dial_back`` (``_reachability``) and ``dht.speed_test`` (``_speed_test``: how fast bytes
move between a peer and us, :func:`measure_bandwidth`).

The trio side: ``_node`` (requests, lookups, bootstrap), ``_maintenance`` (expiry, bucket
refresh, republishing, hand-off), ``_peer_table`` (announcements read and written, followed
models), ``_topic``, ``_serving`` (the RPCs answered), ``_messages`` (what they carry).

Importing it imports no torch, and each name is imported on first use: the sans-IO cores, and
the records and snapshot that routing reads, import without trio or aioquic.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from ._fraud import (
        MAX_EVIDENCE_BYTES as MAX_EVIDENCE_BYTES,
        MAX_LISTED as MAX_LISTED,
        Listing as Listing,
        fetch_evidence as fetch_evidence,
        fetch_listings as fetch_listings,
        index_key as index_key,
        store_evidence as store_evidence,
        store_listings as store_listings,
    )
    from ._gossip import (
        Action as Action,
        Digest as Digest,
        DigestEntry as DigestEntry,
        Gossip as Gossip,
        GossipStatistics as GossipStatistics,
        PeerTableSnapshot as PeerTableSnapshot,
        Push as Push,
        Want as Want,
        build_snapshot as build_snapshot,
    )
    from ._lookup import (
        Lookup as Lookup,
        LookupResult as LookupResult,
        LookupStatistics as LookupStatistics,
        Query as Query,
    )
    from ._model_registry import (
        MAX_MODEL_BLOCKS as MAX_MODEL_BLOCKS,
        MODELS_KEY as MODELS_KEY,
        ModelInfo as ModelInfo,
        get_models as get_models,
        register_model as register_model,
    )
    from ._node import (
        DHTNode as DHTNode,
        DHTStatistics as DHTStatistics,
        open_dht_node as open_dht_node,
    )
    from ._reachability import (
        Reachability as Reachability,
        ReachabilityReport as ReachabilityReport,
        check_reachability as check_reachability,
    )
    from ._record_store import (
        RecordStore as RecordStore,
        RecordStoreStatistics as RecordStoreStatistics,
    )
    from ._records import (
        Entry as Entry,
        Record as Record,
        ServerInfo as ServerInfo,
        ServerState as ServerState,
        StoredValue as StoredValue,
        StoreRefusal as StoreRefusal,
        StoreResult as StoreResult,
        decode_record_untrusted as decode_record_untrusted,
        encode_record as encode_record,
        merge as merge,
        merge_records as merge_records,
    )
    from ._routing import (
        NODE_ID_BITS as NODE_ID_BITS,
        Contact as Contact,
        NodeID as NodeID,
        PingOldest as PingOldest,
        RoutingTable as RoutingTable,
        RoutingTableStatistics as RoutingTableStatistics,
        bucket_index as bucket_index,
        xor_distance as xor_distance,
    )
    from ._speed_test import (
        MAX_SPEED_TEST_BYTES as MAX_SPEED_TEST_BYTES,
        SPEED_TEST as SPEED_TEST,
        BandwidthReport as BandwidthReport,
        SpeedTestResult as SpeedTestResult,
        measure_bandwidth as measure_bandwidth,
    )
    from ._topic import Topic as Topic
else:
    __getattr__, __dir__, __all__ = lazy_exports(__name__)
