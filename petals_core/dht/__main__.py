"""A standalone DHT node: a bootstrap peer for others, or a DHT-only member of a swarm.

``python -m petals_core.dht --identity_path node.key --host 0.0.0.0 --port 31337`` prints
``DHT node listening on <multiaddr>`` once it serves; other nodes pass that multiaddr in their
``initial_peers``.  It runs until SIGINT or SIGTERM and then exits 0.

``--port 0`` (the default) takes a free port, which changes each run: give a fixed port (and an
``--identity_path``, so that the PeerID stays too) to a bootstrap node whose address others
keep.  With a wildcard ``--host`` it prints one line per address of this machine (loopback
first); peers on other machines take one of this machine's public ones.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import trio

from .._cli import configure_logging
from .._errors import PetalsError
from ..transport import dialable_multiaddrs, load_or_create_identity
from ._node import open_dht_node

logger = logging.getLogger("petals_core.dht")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.dht", description="Run a standalone DHT node."
    )
    parser.add_argument(
        "--identity_path",
        help="private key file, created (mode 0600) if missing; default: a new identity each run",
    )
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=0, help="UDP port to listen on; 0 (default) picks a free one"
    )
    parser.add_argument(
        "--initial_peers",
        nargs="*",
        action="extend",
        default=[],
        metavar="MULTIADDR",
        help="multiaddrs of nodes to join through (repeatable); none starts a new network",
    )
    parser.add_argument("--log_level", default="INFO", help="logging level (default: INFO)")
    return parser.parse_args(argv)


async def _run(args: argparse.Namespace) -> None:
    identity = load_or_create_identity(args.identity_path) if args.identity_path else None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_dht_node(
            identity=identity, host=args.host, port=args.port, initial_peers=args.initial_peers
        ) as dht:
            for address in dialable_multiaddrs(dht.listen_multiaddr):
                print(f"DHT node listening on {address}", flush=True)
            async for signum in signals:
                logger.info("got %s, stopping", signal.Signals(signum).name)
                break


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    configure_logging(args.log_level.upper())
    try:
        trio.run(_run, args)
    except PetalsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
