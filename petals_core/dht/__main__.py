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

from .._cli import Refused, configure_logging, one_address
from .._errors import InvalidMultiaddr, PetalsError
from ..transport import RelayLimits, dialable_multiaddrs, load_or_create_identity
from ._node import open_dht_node

logger = logging.getLogger("petals_core.dht")

#: The routing table's refresh interval by default (``open_dht_node``'s).
_REFRESH_S = 60.0
#: Petals' ``run_dht`` flags that mean nothing here: how many values each takes, and why.
_PETALS_ONLY_FLAGS: dict[str, tuple[int | str, str]] = {
    "--announce_maddrs": (
        "+",
        "peers record the address a node's requests come from; behind port forwarding, listen "
        "on the forwarded port (--port)",
    ),
    "--use_ipfs": (0, "there is no IPFS bootstrap; give --initial_peers"),
    "--use_auto_relay": (
        0,
        "a DHT node is where others start: it must be dialled directly (servers behind a NAT "
        "use relays, and DHT nodes relay for them)",
    ),
}


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
    parser.add_argument(
        "--host_maddrs",
        nargs="+",
        metavar="MULTIADDR",
        help="Petals' form of --host / --port: the one address to listen on, as "
        "/ip4/HOST/udp/PORT/quic-v1 (or /ip6/...)",
    )
    parser.add_argument(
        "--refresh_period",
        type=float,
        default=_REFRESH_S,
        help="seconds between refreshes of the routing table's quiet buckets "
        f"(default: {_REFRESH_S:g})",
    )
    parser.add_argument(
        "--use_relay",
        action="store_true",
        default=True,
        help="relay for servers that cannot be dialled (behind a NAT); the default",
    )
    parser.add_argument(
        "--no_relay", action="store_false", dest="use_relay", help="relay for nobody"
    )
    for flag, (nargs, reason) in _PETALS_ONLY_FLAGS.items():
        parser.add_argument(
            flag, nargs=nargs, help=argparse.SUPPRESS, action=Refused, reason=reason
        )
    parser.add_argument("--log_level", default="INFO", help="logging level (default: INFO)")
    args = parser.parse_args(argv)
    if not args.refresh_period > 0:
        parser.error(f"--refresh_period must be positive, not {args.refresh_period:g}")
    if args.host_maddrs is not None:
        if args.host != parser.get_default("host") or args.port != parser.get_default("port"):
            parser.error("give --host_maddrs or --host / --port, not both")
        try:
            args.host, args.port = one_address("--host_maddrs", args.host_maddrs)
        except InvalidMultiaddr as exc:
            parser.error(str(exc))
    return args


async def _run(args: argparse.Namespace) -> None:
    identity = load_or_create_identity(args.identity_path) if args.identity_path else None
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_dht_node(
            identity=identity,
            host=args.host,
            port=args.port,
            initial_peers=args.initial_peers,
            refresh_interval_s=args.refresh_period,
            relay=RelayLimits() if args.use_relay else None,
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
