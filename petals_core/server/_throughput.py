"""How many requests per second a server can take: measured once per host, cached on disk.

A server announces one number, ``throughput`` (tokens per second through the whole span it
serves), and clients weigh routes by it.  It is made of three parts:

- ``inference_rps``: single-token decode steps per second through one block, with a KV cache
  already holding a prefix (what a client generating text sees);
- ``forward_rps``: tokens per second through one block for a forward pass of a batch of tokens
  without a cache (fine-tuning, prompt processing);
- ``network_rps``: tokens per second the network can carry, hidden states travelling in 16 bits.

The announced figure follows Petals (``src/petals/server/throughput.py``): a request starts at some
block of the span and uses every later block the server holds, so with the start uniformly
distributed a request uses ``E[Uniform{1..num_blocks}] = (num_blocks + 1) / 2`` blocks on average;

    throughput = min(forward_rps / ((num_blocks + 1) / 2), network_rps)

Like Petals, we use ``forward_rps`` (not ``inference_rps``) for the compute part: it is the
token-throughput of the hardware with the batching a busy server gets, while ``inference_rps`` is a
latency figure, reported alongside.

Measuring builds a block with random weights and times it, which takes seconds for real models, so
the compute figures are cached in ``throughput_v1.json`` under an exclusive ``fcntl.flock`` (two
servers starting at once on one host measure once).  The network part is never cached: it is
recomputed on every call from the bandwidth the caller passes.  A server passes what it measured
to peers at start (``dht.speed_test``: see :mod:`petals_core.server._bandwidth`), or what
``--network_bandwidth`` says; without either (a dry run, a server no peer answered) it is
:data:`DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S`.  A bandwidth measured on loopback or a LAN can be
gigabits: the ``min`` then leaves the compute part to decide.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch
from transformers import PretrainedConfig

from .._errors import ConfigError
from ..models import (
    CpuDecode,
    EagerSteps,
    FalconBlock,
    QuantType,
    SpanSteps,
    new_block,
    quantize_block,
)

__all__ = [
    "CACHE_FILE_NAME",
    "DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S",
    "ComputeMeasure",
    "LOCK_FILE_NAME",
    "ThroughputInfo",
    "get_server_throughput",
    "measure_compute_rps",
    "throughput_cache_key",
]

logger = logging.getLogger(__name__)

# An assumption, not a measurement: a modest home or cloud uplink (Petals' fallback too).
DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S = 100e6
BITS_PER_HIDDEN_VALUE = 16  # clients send hidden states in 16-bit floats
CACHE_FILE_NAME = "throughput_v1.json"
LOCK_FILE_NAME = "throughput.lock"
_CACHE_VERSION = 1


def _positive_finite(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a positive finite number, got {value!r}")


#: The share of its network rate a server reached only through a relay announces.
RELAY_PENALTY = 0.2


@attrs.frozen(kw_only=True)
class ThroughputInfo:
    """What a server measured (or assumed) and the throughput it announces, all per second."""

    inference_rps: float = attrs.field(converter=float, validator=_positive_finite)
    """Single-token decode steps per second through one block, with a filled KV cache."""
    forward_rps: float = attrs.field(converter=float, validator=_positive_finite)
    """Tokens per second through one block for a forward pass of a batch of tokens."""
    network_rps: float = attrs.field(converter=float, validator=_positive_finite)
    """Tokens per second the network carries: ``bandwidth_bits_per_s / (hidden_size * 16)``."""
    throughput: float = attrs.field(converter=float, validator=_positive_finite)
    """Announced: ``min(forward_rps / ((num_blocks + 1) / 2), network_rps)``."""

    def through_relay(self) -> float:
        """What to announce when every byte goes through a relay (behind a symmetric NAT):
        the network's share counts :data:`RELAY_PENALTY` of itself, as the relay's extra leg
        and its link, shared with others, slow it down."""
        return min(self.throughput, self.network_rps * RELAY_PENALTY)


class ComputeMeasure(Protocol):
    """Measures ``(inference_rps, forward_rps)`` of one block, as :func:`measure_compute_rps`."""

    def __call__(
        self,
        config: PretrainedConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        quant_type: QuantType,
    ) -> tuple[float, float]: ...


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(
    step: Callable[[], object], max_steps: int, budget_s: float, device: torch.device
) -> tuple[int, float]:
    """Run ``step`` up to ``max_steps`` times (at least once) within ``budget_s``.

    Returns (steps run, seconds taken).  The device is synchronised before starting the clock and
    before checking it, so queued GPU work is counted where it ran.
    """
    _synchronize(device)
    start = time.perf_counter()
    steps = 0
    elapsed_s = 0.0
    while steps < max_steps:
        step()
        steps += 1
        _synchronize(device)
        elapsed_s = time.perf_counter() - start
        if elapsed_s >= budget_s:
            break
    return steps, max(elapsed_s, 1e-9)


def measure_compute_rps(
    config: PretrainedConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_type: QuantType,
    n_tokens: int = 1024,
    n_steps: int = 8,
    n_decode_steps: int = 64,
    phase_budget_s: float = 4.0,
) -> tuple[float, float]:
    """Time one block with random weights: returns ``(inference_rps, forward_rps)``.

    ``inference_rps``: ``n_decode_steps`` single-token steps, batch 1, after a prefill of
    ``n_tokens`` positions into the KV cache.  ``forward_rps``: ``n_steps`` forward passes of
    ``(1, n_tokens, hidden)`` without a cache, counted in tokens.  Both start with an untimed
    warm-up call (allocations, lazy kernel loading).  Each timed phase stops early, after at
    least one step, once it has run ``phase_budget_s``, so a big block on a slow CPU still takes
    seconds, not minutes.  Runs under ``torch.inference_mode()`` on however many threads torch is
    set to use; the global RNG state is left as it was.
    """
    for name, value in (
        ("n_tokens", n_tokens),
        ("n_steps", n_steps),
        ("n_decode_steps", n_decode_steps),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    device = torch.device(device)
    rng_devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), torch.inference_mode():
        torch.manual_seed(0)
        with torch.device(device):  # random weights drawn where they are measured
            block = new_block(config, purpose="measure the throughput").to(dtype=dtype).eval()
        quantize_block(block, quant_type)  # in place
        hidden = config.hidden_size
        prompt = torch.randn(1, n_tokens, hidden, device=device, dtype=dtype)  # (1, T, hidden)
        token = torch.randn(1, 1, hidden, device=device, dtype=dtype)  # (1, 1, hidden)

        # Decode: prefill (also the warm-up), one untimed step, then the timed steps.
        cache = block.allocate_cache(1, n_tokens + 1 + n_decode_steps)
        # Decode steps as a server computes them by default: with numpy where it can.
        decode: SpanSteps = (
            CpuDecode([block])
            if CpuDecode.unsupported_reason([block]) is None
            else EagerSteps([block])
        )
        block(prompt, cache=cache)
        decode.step(0, 1, [token], [[cache]])
        steps, elapsed_s = _timed(
            lambda: decode.step(0, 1, [token], [[cache]]), n_decode_steps, phase_budget_s, device
        )
        inference_rps = steps / elapsed_s

        # Forward of a batch of tokens without a cache (the fine-tuning path), after a warm-up.
        block(prompt)
        steps, elapsed_s = _timed(lambda: block(prompt), n_steps, phase_budget_s, device)
        forward_rps = steps * n_tokens / elapsed_s

    logger.info(
        "Compute throughput of one %s block on %s (%s): %.1f decode steps/s, "
        "%.1f tokens/s forward (%d tokens)",
        config.model_type,
        _device_name(device),
        _dtype_name(dtype, quant_type),
        inference_rps,
        forward_rps,
        n_tokens,
    )
    return inference_rps, forward_rps


def get_server_throughput(
    config: PretrainedConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_type: QuantType,
    num_blocks: int,
    cache_dir: str | os.PathLike[str],
    network_bandwidth_bits_per_s: float | None = None,
    force_eval: bool = False,
    measure: ComputeMeasure = measure_compute_rps,
) -> ThroughputInfo:
    """The throughput a server of ``num_blocks`` blocks announces, measuring compute if needed.

    Compute figures are read from ``cache_dir/throughput_v1.json`` under
    :func:`throughput_cache_key`, or measured with ``measure`` and stored there when absent,
    unreadable, or ``force_eval`` (``--throughput eval``).  The whole read-measure-write runs under
    an exclusive lock on ``cache_dir/throughput.lock``, so concurrent servers on one host measure
    once and never measure each other's load.  A corrupt cache file is logged and replaced, never
    fatal.

    ``network_bandwidth_bits_per_s`` is the bandwidth measured or stated by the operator (see
    :mod:`petals_core.server._bandwidth`); without it we *assume*
    :data:`DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S` (100 Mbit/s).  Measuring it takes peers, so it
    is done by the caller, and it is never cached here.
    """
    if num_blocks < 1:
        raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
    bandwidth = (
        DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S
        if network_bandwidth_bits_per_s is None
        else network_bandwidth_bits_per_s
    )
    if not (math.isfinite(bandwidth) and bandwidth > 0):
        raise ConfigError(f"network bandwidth must be a positive number of bits/s, got {bandwidth}")
    if network_bandwidth_bits_per_s is None:
        logger.info("No network bandwidth given: assuming %.0f Mbit/s", bandwidth / 1e6)

    key = throughput_cache_key(config, device=device, dtype=dtype, quant_type=quant_type)
    directory = Path(cache_dir)
    directory.mkdir(parents=True, exist_ok=True)
    cache_path = directory / CACHE_FILE_NAME
    with _exclusive_lock(directory / LOCK_FILE_NAME):
        entries = _read_cache(cache_path)
        entry = None if force_eval else _valid_entry(entries.get(key), key)
        if entry is None:
            logger.info("Measuring compute throughput (cached for later runs under %s)", key)
            inference_rps, forward_rps = measure(
                config, device=device, dtype=dtype, quant_type=quant_type
            )
            entry = _valid_entry({"inference_rps": inference_rps, "forward_rps": forward_rps}, key)
            if entry is None:
                raise ValueError(
                    f"the compute measurement returned ({inference_rps!r}, {forward_rps!r}); "
                    "both must be positive finite numbers"
                )
            entries[key] = {"inference_rps": entry[0], "forward_rps": entry[1]}
            _write_cache(cache_path, entries)
        else:
            logger.info("Using cached compute throughput for %s", key)

    inference_rps, forward_rps = entry
    network_rps = bandwidth / (config.hidden_size * BITS_PER_HIDDEN_VALUE)
    average_blocks_used = (num_blocks + 1) / 2
    throughput = min(forward_rps / average_blocks_used, network_rps)
    logger.info("Reporting throughput: %.1f tokens/s for %d blocks", throughput, num_blocks)
    return ThroughputInfo(
        inference_rps=inference_rps,
        forward_rps=forward_rps,
        network_rps=network_rps,
        throughput=throughput,
    )


def throughput_cache_key(
    config: PretrainedConfig,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    quant_type: QuantType,
) -> str:
    """A stable key naming everything the compute figures depend on.

    The block's shape (not the checkpoint: two models of one shape run at one speed), the device
    (model name, and on CPU the torch thread count), dtype, quantisation and torch version.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layout: list[str] = []
    if config.model_type == "falcon":  # its own names for the MLP width and key/value heads
        with torch.device("meta"):
            falcon = new_block(config, purpose="measure the throughput")
        assert isinstance(falcon, FalconBlock)
        kv_heads = falcon.self_attention.n_kv_head
        intermediate = falcon.mlp.dense_h_to_4h.out_features
        arrangement = (
            "two-norms" if falcon.two_norms else "parallel" if falcon.parallel else "sequential"
        )
        positions = "rotary" if falcon.rotary is not None else "alibi"
        layout = [f"layout={arrangement}", f"positions={positions}"]
    experts = getattr(config, "num_local_experts", None)
    if experts is not None:
        layout.append(f"experts={experts}/{config.num_experts_per_tok}")
    device = torch.device(device)
    device_part = _device_name(device)
    if device.type == "cpu":
        device_part += f"|threads={torch.get_num_threads()}"
    return "|".join(
        [
            f"{config.model_type}",
            f"hidden={config.hidden_size}",
            f"intermediate={intermediate}",
            f"heads={heads}",
            f"kv_heads={kv_heads}",
            f"head_dim={head_dim}",
            *layout,
            f"device={device_part}",
            f"dtype={_dtype_name(dtype, quant_type)}",
            f"torch={torch.__version__}",
        ]
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    if device.type == "cpu":
        return f"cpu:{_cpu_model()}"
    return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _dtype_name(dtype: torch.dtype, quant_type: QuantType) -> str:
    name = str(dtype).removeprefix("torch.")
    return name if quant_type == "none" else f"{name}+{quant_type}"


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold ``flock(LOCK_EX)`` on ``path``; the OS drops it if the process dies."""
    with open(path, "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; an unreadable or malformed file is logged and treated as empty."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not (
            isinstance(data, dict)
            and data.get("version") == _CACHE_VERSION
            and isinstance(data.get("entries"), dict)
        ):
            raise ValueError(f"not a version {_CACHE_VERSION} throughput cache")
        entries: dict[str, Any] = data["entries"]
        return entries
    except (OSError, UnicodeDecodeError, ValueError) as error:  # JSONDecodeError is a ValueError
        logger.warning("Ignoring the throughput cache %s (it will be rewritten): %s", path, error)
        return {}


def _valid_entry(entry: object, key: str) -> tuple[float, float] | None:
    if entry is None:
        return None
    try:
        info = (float(entry["inference_rps"]), float(entry["forward_rps"]))  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        info = (math.nan, math.nan)
    if not all(math.isfinite(value) and value > 0 for value in info):
        logger.warning("Ignoring a malformed throughput cache entry for %s: %r", key, entry)
        return None
    return info


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    """Replace the cache file atomically; failing to save is logged (we can measure again)."""
    data = {"version": _CACHE_VERSION, "entries": entries}
    try:
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".throughput-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(data, file, indent=2, sort_keys=True)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
    except OSError:
        logger.exception("Failed to save the throughput cache %s", path)
