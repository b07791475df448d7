"""The flags of ``python -m petals_core.server``: their types, the parser, and the
:class:`ServerConfig` they describe.  A bad value exits 2 with argparse's message."""

from __future__ import annotations

import argparse
import logging
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, get_args

import attrs

from .._cli import Refused, one_address
from .._errors import InvalidMultiaddr
from ..demo import SMOLLM2, resolve_alias
from ..models import CpuDecodeChoice, QuantType
from ._config import ServerConfig
from ._handler import ServingLimits

__all__ = ["PETALS_ONLY_FLAGS", "build_parser", "config_from_args", "parse_args", "parse_nbytes"]

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
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*")

_Number = TypeVar("_Number", int, float)


# -- argument types --------------------------------------------------------------------------


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


def _number(
    text: str,
    convert: Callable[[str], _Number],
    not_a_number: str,
    valid: Callable[[_Number], bool],
    out_of_range: str,
) -> _Number:
    """``convert(text)`` if ``valid``; else the error ``{text!r} <not_a_number>`` or
    ``out_of_range`` (a format string of ``text`` and ``value``)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} {not_a_number}") from None
    if not valid(value):
        raise argparse.ArgumentTypeError(out_of_range.format(text=text, value=value))
    return value


def _positive_int(text: str) -> int:
    return _number(text, int, "is not an integer", lambda v: v >= 1, "must be >= 1, got {value}")


def _port(text: str) -> int:
    return _number(
        text,
        int,
        "is not a port number",
        lambda v: 0 <= v <= 65535,
        "a UDP port is 0..65535, got {value}",
    )


def _positive_float(text: str) -> float:
    return _number(
        text,
        float,
        "is not a number",
        lambda v: math.isfinite(v) and v > 0,
        "must be a positive number, got {text}",
    )


def _non_negative_float(text: str, not_a_number: str = "is not a number") -> float:
    return _number(
        text,
        float,
        not_a_number,
        lambda v: math.isfinite(v) and v >= 0,
        "must be a number >= 0, got {text}",
    )


def _fraction(text: str) -> float:
    return _number(
        text, float, "is not a number", lambda v: 0.0 <= v <= 1.0, "must be in [0, 1], got {text}"
    )


#: ``--compression`` values (Petals' names, any case) and the scheme each means here.
_COMPRESSIONS = {
    "none": "none",
    "float16": "float16",
    "blockwise_8bit": "blockwise8",
    "blockwise8": "blockwise8",
}


def _compression(text: str) -> str:
    scheme = _COMPRESSIONS.get(text.lower())
    if scheme is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: petals_core compresses with NONE, FLOAT16 or BLOCKWISE_8BIT"
        )
    return scheme


def _throughput(text: str) -> str | float:
    if text in ("auto", "eval", "dry_run"):
        return text
    return _non_negative_float(text, "is neither auto, eval, dry_run nor a number")


def _log_level(text: str) -> str:
    level = text.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise argparse.ArgumentTypeError(f"{text!r} is not a logging level (DEBUG, INFO, ...)")
    return level


# -- the parser ------------------------------------------------------------------------------

#: Petals' flags that mean nothing here: the flag, how many values it takes, and why.
PETALS_ONLY_FLAGS: dict[str, tuple[int | str, str]] = {
    "--num_handlers": (1, "one trio loop serves every request; there are no handler processes"),
    "--max_chunk_size_bytes": (
        1,
        "tensors always travel in parts of a fixed size; there is nothing to set",
    ),
    "--stats_report_interval": (1, "batch statistics are logged at DEBUG level instead"),
    "--prefetch_batches": (1, "batches are formed when a worker is free; none are prefetched"),
    "--sender_threads": (1, "results go back on the network loop; there are no sender threads"),
    "--min_batch_size": (1, "a batch is whatever is waiting; there is no minimum"),
    "--increase_file_limit": (1, "the server uses one UDP socket; no file limit is raised"),
    "--daemon_startup_timeout": (1, "there is no libp2p daemon to wait for"),
    "--tensor_parallel_devices": ("+", "blocks are not split across GPUs"),
    "--custom_module_path": (1, "custom modules are not loaded"),
    "--config": (1, "flags are read from the command line only, not from a config file"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags of ``argv``, Petals' forms brought to ours (MODEL or
    ``--converted_model_name_or_path``; ``--host_maddrs``, ``--announce_maddrs`` and
    ``--public_ip``); exits 2 with a message for flags that clash or cannot mean anything."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.model is None) == (args.converted_model_name_or_path is None):
        parser.error("give the model once: MODEL or --converted_model_name_or_path (Petals' name)")
    if args.model is None:
        args.model = args.converted_model_name_or_path
    try:
        if args.host_maddrs is not None:
            host, port = one_address("--host_maddrs", args.host_maddrs)
            if args.host != parser.get_default("host") or args.port != parser.get_default("port"):
                parser.error("give --host_maddrs or --host / --port, not both")
            args.host, args.port = host, port
        announced = [
            flag
            for flag in ("--announce_host", "--announce_maddrs", "--public_ip")
            if getattr(args, flag[2:]) is not None
        ]
        if len(announced) > 1:
            parser.error(f"give one of {', '.join(announced)}: they all set the announced address")
        if args.public_ip is not None:
            args.announce_host = args.public_ip
        if args.announce_maddrs is not None:
            host, port = one_address("--announce_maddrs", args.announce_maddrs)
            if args.announce_port is not None:
                parser.error("give --announce_maddrs or --announce_port, not both")
            if port != args.port:
                if args.port == 0:
                    parser.error(
                        f"--announce_maddrs names UDP port {port}, but the server listens on a "
                        "random port: give the port it listens on (--port), which the router "
                        f"forwards {port} to"
                    )
                args.announce_port = port
            args.announce_host = host
    except InvalidMultiaddr as exc:
        parser.error(str(exc))
    return args


def _defaulted(kind: Callable[[str], object], default: float, text: str) -> dict[str, Any]:
    """The options of a flag of type ``kind`` whose help ends with its default."""
    return {"type": kind, "default": default, "help": f"{text} (default: {default:g})"}


def _repeatable(metavar: str, text: str) -> dict[str, Any]:
    """The options of a flag taking any number of values, given once or more."""
    return {
        "nargs": "*",
        "action": "extend",
        "default": [],
        "metavar": metavar,
        "help": f"{text} (repeatable)",
    }


def build_parser() -> argparse.ArgumentParser:
    limits = ServingLimits()
    config = ServerConfig(model="-", new_swarm=True)  # the defaults, for the help texts
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.server",
        description="Serve a span of transformer blocks of a model in a swarm.",
    )
    add = parser.add_argument
    add("--converted_model_name_or_path", help=argparse.SUPPRESS)

    add(
        "model",
        metavar="MODEL",
        nargs="?",
        help=f"Hugging Face repo id, local folder, or {SMOLLM2!r}",
    )

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
        **_repeatable("NAME", "LoRA adapters (Hub repo ids or folders) to serve beside the blocks"),
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
        "--host_maddrs",
        nargs="+",
        metavar="MULTIADDR",
        help="Petals' form of --host / --port: the one address to listen on, as "
        "/ip4/HOST/udp/PORT/quic-v1 (or /ip6/...)",
    )
    network.add_argument(
        "--announce_maddrs",
        nargs="+",
        metavar="MULTIADDR",
        help="Petals' form of --announce_host (and --announce_port): the address others "
        "should dial, as /ip4/HOST/udp/PORT/quic-v1",
    )
    network.add_argument(
        "--announce_port",
        type=_port,
        help="the UDP port others should dial, when a router forwards another port than "
        "--port to this machine (default: --port)",
    )
    network.add_argument("--public_ip", help="Petals' name for --announce_host")
    network.add_argument(
        "--skip_reachability_check",
        action="store_true",
        help="do not ask peers whether they can dial this server (at start and every 10 "
        "minutes); it then neither relays for others nor uses relays",
    )
    network.add_argument(
        "--use_relay",
        action="store_true",
        default=config.relay,
        help="relay for servers that cannot be dialled, when peers can dial this one (default)",
    )
    network.add_argument(
        "--no_relay", action="store_false", dest="use_relay", help="relay for nobody"
    )
    network.add_argument(
        "--use_auto_relay",
        action="store_true",
        default=config.auto_relay,
        help="when peers cannot dial this server (behind a NAT), serve through relays (default)",
    )
    network.add_argument(
        "--no_auto_relay",
        action="store_false",
        dest="use_auto_relay",
        help="never serve through relays: behind a NAT, clients will not reach this server",
    )
    network.add_argument(
        "--initial_peers", **_repeatable("MULTIADDR", "multiaddrs of peers of the swarm to join")
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
        "(default: measured to peers at start, else assume 100e6)",
    )
    network.add_argument(
        "--update_period",
        **_defaulted(_positive_float, config.update_period_s, "seconds between announcements"),
    )
    network.add_argument(
        "--expiration",
        type=_positive_float,
        help="seconds an announcement stays valid (default: max(2 * update_period, 300))",
    )
    network.add_argument(
        "--balance_quality",
        **_defaulted(
            _fraction,
            config.balance_quality,
            "move to other blocks only if that raises the swarm's throughput to more than "
            "1 / this of now; 0 never moves",
        ),
    )
    network.add_argument(
        "--mean_balance_check_period",
        **_defaulted(
            _positive_float,
            config.mean_balance_check_period_s,
            "mean seconds between checks of the swarm's balance",
        ),
    )

    serving = parser.add_argument_group("serving limits")
    serving.add_argument(
        "--attn_cache_tokens",
        type=_positive_int,
        help="attention cache, in tokens (positions of one row) per served block (default: "
        "32768 for models with grouped-query attention, 8192 for others, as in Petals)",
    )
    serving.add_argument(
        "--max_batch_size",
        **_defaulted(
            _positive_int,
            limits.max_batch_tokens,
            "tokens (rows x positions) one inference job, a batch of steps included, "
            "processes at most; longer steps go in chunks (and more rows of a forward in "
            "further jobs)",
        ),
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
        "--compression",
        type=_compression,
        default="none",
        help="how this server's outputs travel: NONE (default), FLOAT16 (half the bytes of "
        "float32) or BLOCKWISE_8BIT (8 bits per value and a scale per 256)",
    )
    serving.add_argument(
        "--inference_max_length",
        type=_positive_int,
        help="longest inference session, in tokens (default: 8192 for models with grouped-query "
        "attention, 2048 for others, as in Petals)",
    )
    serving.add_argument(
        "--max_alloc_timeout",
        **_defaulted(
            _positive_float,
            limits.max_alloc_timeout_s,
            "longest wait of a session for attention cache, in seconds",
        ),
    )
    serving.add_argument(
        "--request_timeout",
        **_defaulted(
            _positive_float, limits.request_timeout_s, "longest forward/backward call, in seconds"
        ),
    )
    serving.add_argument(
        "--session_timeout",
        **_defaulted(
            _positive_float, limits.session_timeout_s, "longest inference session, in seconds"
        ),
    )
    serving.add_argument(
        "--step_timeout",
        **_defaulted(
            _positive_float,
            limits.step_timeout_s,
            "longest wait for a session's next step, in seconds",
        ),
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
        help="the model's files in the cache take at most SIZE (e.g. 10GB, 500MB): before a "
        "download would pass it, the model's least recently used shards (not those being loaded) "
        "are deleted, and the disk keeps 1 GiB free; a server that moves to other blocks stays "
        "within it (default: no limit, nothing deleted)",
    )
    token = files.add_mutually_exclusive_group()
    token.add_argument("--token", help="Hugging Face token for private or gated repos")
    token.add_argument(
        "--use_auth_token",
        action="store_true",
        help="use the token saved by `huggingface-cli login` (what happens without --token anyway)",
    )
    files.add_argument("--revision", help="branch, tag or commit of the repo (default: main)")

    for flag, (nargs, reason) in PETALS_ONLY_FLAGS.items():
        add(flag, nargs=nargs, help=argparse.SUPPRESS, action=Refused, reason=reason)
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
    ``--initial_peers``.  MODEL ``smollm2`` is the packaged SmolLM2-135M-Instruct, prepared in
    the cache here (see :func:`~petals_core.demo.resolve_alias`) and loaded from there only.
    """
    new_swarm = args.new_swarm or (args.throughput == "dry_run" and not args.initial_peers)
    config = ServerConfig(
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
        announce_port=args.announce_port,
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
            compression=args.compression,
        ),
        adapters=tuple(args.adapters),
        public_name=args.public_name,
        check_reachability=not args.skip_reachability_check,
        relay=args.use_relay,
        auto_relay=args.use_auto_relay,
        update_period_s=args.update_period,
        expiration_s=args.expiration,
        balance_quality=args.balance_quality,
        mean_balance_check_period_s=args.mean_balance_check_period,
        cache_dir=args.cache_dir,
        max_disk_space=args.max_disk_space,
        token=args.token,
        revision=args.revision,
    )
    prepared = resolve_alias(config.model, config.cache_dir)
    if prepared is None:
        return config
    return attrs.evolve(config, model=prepared, local_files_only=True)
