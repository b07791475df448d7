"""QUIC transport on trio: authenticated peers, multiplexed RPC streams, CBOR-framed tensors.

Embeddable on its own: importing it imports neither torch nor transformers (torch is imported only
when a tensor is actually encoded or built).  Each name is imported on first use: identities,
multiaddrs and the codec import without trio or aioquic.

A server::

    handlers = Handlers()

    @handlers.unary("echo")
    async def echo(request, call):
        return request

    async with open_node(load_or_create_identity("node.key"), host="0.0.0.0", port=31337) as node:
        print(node.listen_multiaddr)
        await serve_rpc(node, handlers)

A client::

    async with open_node() as node:
        connection = await node.connect("/ip4/10.0.0.2/udp/31337/quic-v1/p2p/Qm...")
        with trio.fail_after(5):
            reply = await call_unary(connection, "echo", {"x": torch.ones(3)})

Its modules, bottom up (docs/how-it-works.md says how each works):

- ``_identity``: the Ed25519 identity file, PeerIDs, self-signed certificates carrying the key;
- ``_multiaddr``: ``/ip4|ip6|dns*/<host>/udp/<port>/quic-v1[/p2p/<PeerID>]``, relayed
  addresses (``.../p2p/<relay>/p2p-circuit/p2p/<peer>``), a wildcard listener's addresses;
- ``_codec`` (with ``_codec_format``, ``_codec_tensors``, ``_codec_writer``, ``_codec_checks``):
  length-prefixed CBOR with a tensor tag, compression, and the ``*_untrusted`` decoders;
- ``_quic`` and ``_quic_path``: the only modules that reach into aioquic (client certificates,
  flow control that follows the application, congestion control kept across idle gaps, pacing,
  path MTU discovery);
- ``_endpoint`` (events in ``_endpoint_events``): sans-IO, many connections behind one socket;
- ``_udp``: the socket, with segmentation and receive offload where Linux allows;
- ``_node``: the trio edge (one socket, one pump task), ``connect_any``;
- ``_relay_wire``, ``_relay``, ``_punch``: relayed datagrams, relay reservations and circuits,
  hole punching;
- ``_connection`` (a peer and its streams), ``_rpc`` (unary and streaming calls), ``_config``.
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
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
else:
    __getattr__, __dir__, __all__ = lazy_exports(__name__)
