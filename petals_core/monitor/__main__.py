"""``python -m petals_core.monitor --initial_peers MULTIADDR [--host 127.0.0.1] [--port 8000]``:
the swarm monitor's page and API.

It prints ``Monitor listening on http://HOST:PORT`` once it serves (``--port 0`` takes a free
port, which that line names), runs until SIGINT or SIGTERM and then exits 0.  Bad flags exit 2
saying what is wrong; a swarm none of whose initial peers answers, or an address it cannot
listen on, exits 1.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial

import attrs
import trio

from .._cli import configure_logging
from .._errors import ConfigError, PetalsError
from .._groups import raising_single_error
from .._http import http_bind, shutdown_on_signals
from ._app import serve_monitor
from ._monitor import MonitorConfig

READY = "Monitor listening on "


def _parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, MonitorConfig]:
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.monitor",
        description="Serve a live web page (and JSON API) showing a swarm's models and servers.",
    )
    parser.add_argument(
        "--initial_peers",
        nargs="+",
        action="extend",
        required=True,
        metavar="MULTIADDR",
        help="multiaddrs of peers of the swarm to join through (repeatable)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address the page is served on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8000,
        help="TCP port of the page; 0 picks a free one (default: 8000)",
    )
    defaults = attrs.fields(MonitorConfig)
    parser.add_argument(
        "--refresh_period",
        type=float,
        default=defaults.refresh_period_s.default,
        help="seconds between looks at the swarm (registry, pings) "
        f"(default: {defaults.refresh_period_s.default:g})",
    )
    parser.add_argument(
        "--ping_timeout",
        type=float,
        default=defaults.ping_timeout_s.default,
        help="seconds a server has to answer a ping before it counts as unreachable "
        f"(default: {defaults.ping_timeout_s.default:g})",
    )
    parser.add_argument(
        "--dht_host",
        help="address the monitor's DHT node binds (it only dials out; default: loopback when "
        "every initial peer is there, else every interface)",
    )
    parser.add_argument("--log_level", default="INFO", help="logging level (default: INFO)")
    args = parser.parse_args(argv)
    for flag, value in [
        ("--refresh_period", args.refresh_period),
        ("--ping_timeout", args.ping_timeout),
    ]:
        if not value > 0:
            parser.error(f"{flag} must be positive, not {value:g}")
    try:
        http_bind(args.host, args.port)
        config = MonitorConfig(
            initial_peers=args.initial_peers,
            refresh_period_s=args.refresh_period,
            ping_timeout_s=args.ping_timeout,
            dht_host=args.dht_host,
        )
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    return args, config


async def _run(args: argparse.Namespace, config: MonitorConfig) -> None:
    with raising_single_error():
        async with trio.open_nursery() as nursery:
            serve = partial(
                serve_monitor,
                config,
                host=args.host,
                port=args.port,
                shutdown_trigger=shutdown_on_signals,
            )
            urls = await nursery.start(serve)
            print(f"{READY}{urls[0]}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args, config = _parse_args(argv)
    configure_logging(args.log_level.upper())
    try:
        trio.run(_run, args, config)
    except PetalsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130  # interrupted before the page was served
    return 0


if __name__ == "__main__":
    sys.exit(main())
