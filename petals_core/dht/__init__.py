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

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__)
