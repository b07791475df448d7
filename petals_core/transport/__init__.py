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
- ``_endpoint`` (events in ``_endpoint_events``, one connection's state, close codes and end
  in ``_endpoint_conn``, who may connect in ``_endpoint_admission``): sans-IO, many
  connections behind one socket;
- ``_repair``: repair datagrams on lossy paths (a lost datagram rebuilt without a round trip);
- ``_udp``: the socket, with segmentation and receive offload where Linux allows;
- ``_node``: the trio edge (one socket, one pump task), ``connect_any``;
- ``_relay_wire``, ``_relay``, ``_punch``: relayed datagrams, relay reservations and circuits,
  hole punching;
- ``_connection`` (a peer and its streams), ``_rpc`` (unary and streaming calls), ``_config``.
"""

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__)
