# The names petals_core.transport exports, each loaded on first access (see petals_core._lazy).

from .._errors import (
    CallEnded as CallEnded,
    ClosedResourceError as ClosedResourceError,
    CodecError as CodecError,
    ConnectionClosed as ConnectionClosed,
    ConnectTimeout as ConnectTimeout,
    IdentityMismatch as IdentityMismatch,
    LocalProtocolError as LocalProtocolError,
    PeerUnreachable as PeerUnreachable,
    ProtocolError as ProtocolError,
    RelayRefused as RelayRefused,
    RemoteError as RemoteError,
    RemoteProtocolError as RemoteProtocolError,
    StreamReset as StreamReset,
    TransportError as TransportError,
)
from ._codec import (
    FrameDecoder as FrameDecoder,
    decode_message_untrusted as decode_message_untrusted,
    encode_frame as encode_frame,
    encode_message as encode_message,
)
from ._codec_format import SCHEMES as SCHEMES, CodecLimits as CodecLimits, Scheme as Scheme
from ._codec_tensors import (
    Compressed as Compressed,
    RawTensor as RawTensor,
    as_received as as_received,
    compress as compress,
    compress_floats as compress_floats,
)
from ._config import ALPN as ALPN, TransportConfig as TransportConfig
from ._connection import Connection as Connection, Stream as Stream
from ._identity import (
    Identity as Identity,
    PeerID as PeerID,
    load_or_create_identity as load_or_create_identity,
    verify_signature as verify_signature,
)
from ._multiaddr import (
    Multiaddr as Multiaddr,
    client_listen_host as client_listen_host,
    dialable_multiaddrs as dialable_multiaddrs,
)
from ._node import Node as Node, NodeStatistics as NodeStatistics, open_node as open_node
from ._punch import PunchService as PunchService
from ._quic_path import PathInfo as PathInfo
from ._relay import (
    RelayLimits as RelayLimits,
    RelayService as RelayService,
    RelayStatistics as RelayStatistics,
    Reservation as Reservation,
    hold_reservation as hold_reservation,
)
from ._rpc import (
    Call as Call,
    Handlers as Handlers,
    ServerCall as ServerCall,
    call_unary as call_unary,
    open_call as open_call,
    serve_rpc as serve_rpc,
)
