# The names petals_core.dht exports, each loaded on first access (see petals_core._lazy).

from ._fraud import (
    MAX_EVIDENCE_BYTES as MAX_EVIDENCE_BYTES,
    MAX_LISTED as MAX_LISTED,
    Listing as Listing,
    ListingKey as ListingKey,
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
    MAX_ANNOUNCEMENT_S as MAX_ANNOUNCEMENT_S,
    MAX_RATE as MAX_RATE,
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
    host_of as host_of,
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
