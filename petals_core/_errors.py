"""One exception tree for the whole package.

Errors are grouped by what failed, in the manner of httpcore: the codec, the peer's behaviour
(protocol errors, remote errors), the network (timeouts, unreachable peers, resets), or the caller
(using something already closed).  Foreign exceptions (trio, aioquic, cbor2, cryptography) are
translated at the boundary and chained as ``__cause__``; none escapes the public API.
"""

from __future__ import annotations

from collections.abc import Sequence


class PetalsError(Exception):
    """Root of every error this package raises on purpose."""


class ConfigError(PetalsError, ValueError):
    """A configuration value, address or file is invalid."""


class MissingExtra(PetalsError, ImportError):
    """A part of the package needs an optional dependency that is not installed; the message
    names the extra that brings it (``pip install 'petals_core[http]'``)."""


class InvalidMultiaddr(ConfigError):
    """A multiaddr string does not follow ``/ip4|ip6/<host>/udp/<port>/quic-v1[/p2p/<PeerID>]``."""


class IdentityFileError(ConfigError):
    """An identity file cannot be read, written or parsed."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be loaded as asked.

    It is missing, not in safetensors, lacks a tensor or block, or the block index is out of
    range; Hub and cache failures are chained as ``__cause__``.
    """


class TransportError(PetalsError):
    """Something went wrong moving bytes between peers."""


class ProtocolError(TransportError):
    """A peer (or we) broke the wire protocol."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol does not allow (e.g. an unencodable value)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol does not allow."""


class CodecError(ProtocolError):
    """Bytes could not be decoded (or a value could not be encoded) as a wire message.

    This is the only exception type that the ``*_untrusted`` decoders raise.
    """


class NetworkError(TransportError):
    """The network or the peer's connection failed."""


class ConnectTimeout(NetworkError, TimeoutError):
    """No handshake completed within the connect timeout."""


class PeerUnreachable(NetworkError):
    """The peer could not be reached (no route, refused, or it stopped answering)."""


class RelayRefused(PeerUnreachable):
    """A relay refused to hold a reservation or open a circuit: it is at one of its bounds, it
    does not relay, or it holds no reservation for the peer asked for."""


class IdentityMismatch(NetworkError):
    """The peer proved a key other than the one its PeerID names."""


class ConnectionClosed(NetworkError):
    """The QUIC connection ended; ``reason`` says why and ``error_code`` carries the wire code."""

    def __init__(self, message: str, *, error_code: int | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


class StreamReset(NetworkError):
    """The peer reset the stream (e.g. it cancelled its side of a call)."""

    def __init__(self, message: str, *, error_code: int | None = None) -> None:
        super().__init__(message)
        self.error_code = error_code


class ClosedResourceError(TransportError):
    """*You* closed this object (node, connection or call) and then used it."""


class CallEnded(TransportError):
    """The other side of a call finished its messages: there is nothing more to receive.

    Iterating over a call (``async for message in call``) stops here instead of raising.
    """


class RemoteError(TransportError):
    """A remote handler raised; the caller sees its type name and message.

    The remote side keeps serving; only this call failed.
    """

    def __init__(self, remote_type: str, message: str) -> None:
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type
        self.remote_message = message


class AdapterError(ConfigError):
    """An adapter cannot be loaded (not PEFT LoRA, not safetensors, wrong shapes) or is unknown."""


class MissingBlocksError(PetalsError):
    """No usable server holds some of the blocks a route needs; ``blocks`` lists them, and
    ``servers_seen`` describes the servers of the peer table (when the sequence manager knows
    them: each one's PeerID, span, and why it is not used if it is not)."""

    def __init__(
        self,
        blocks: Sequence[int],
        start: int,
        end: int,
        *,
        dht_prefix: str | None = None,
        servers_seen: Sequence[str] | None = None,
    ) -> None:
        self.blocks: tuple[int, ...] = tuple(blocks)
        self.start = start
        self.end = end
        self.dht_prefix = dht_prefix
        self.servers_seen = None if servers_seen is None else tuple(servers_seen)
        noun = "block" if len(self.blocks) == 1 else "blocks"
        listed = ", ".join(str(block) for block in self.blocks)
        message = f"no server holds {noun} {listed} (of [{start}, {end}))"
        if dht_prefix is not None:
            message += f" of the model {dht_prefix!r}"
        if self.servers_seen:
            message += "; servers seen: " + "; ".join(self.servers_seen)
        elif self.servers_seen is not None:
            message += (
                "; no server of it seen: check that initial_peers name a peer of its swarm and "
                "that dht_prefix is the one its servers announce"
            )
        super().__init__(message)


class ServerError(PetalsError):
    """A server refused or failed a request; the message says why (clients see it remotely)."""


class AllocationFailed(ServerError):
    """The attention cache cannot hold what a session asks for, now or within its timeout."""


class SessionTooLarge(AllocationFailed):
    """A session larger than the server ever takes: longer than its longest session, more rows
    than it batches, or more attention cache than it has.  A client routes such a session to
    other servers and blames this one for nothing."""


class WrongAnswer(ServerError):
    """A server's answer disagreed with two other servers' computing the same: the server is no
    longer used, and its answer is computed again elsewhere."""


class ReceiptError(ServerError):
    """A server's answer came without a valid signature of its receipt: missing, made with
    another key than the server's, or over something else than what was asked and answered."""


class ReportRefused(PetalsError):
    """A fraud report about a server was refused, and why: malformed or oversized, forged (not
    signed by the accused over its question and answer), expired, about another model, or about
    an answer that other servers reproduce."""
