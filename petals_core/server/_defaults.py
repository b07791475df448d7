"""What a server serves when it is not told: its device, dtype, quantisation and number of blocks.

The defaults are those of Petals' server, so that a server started the way one starts Petals
does what its operator expects:

- device: ``cuda`` when torch has CUDA, else ``cpu``;
- ``torch_dtype="auto"``: float32 on the CPU (bf16 matmuls on CPUs without AMX are slower than
  fp32).  Elsewhere the checkpoint's own dtype when it is float16 or bfloat16, so the weights are
  served exactly as stored (float16 -> bfloat16 would round three bits off every weight), as
  transformers' and Petals' ``auto`` do; any other stored dtype (float32, or none) gives bfloat16;
- ``quant_type=None``: nf4 on CUDA when bitsandbytes runs there, else none;
- neither ``num_blocks`` nor ``block_indices``: on CUDA as many blocks as fit in the device's
  free memory; elsewhere every block of the model;
- ``attn_cache_tokens`` and ``inference_max_length``: 32768 and 8192 positions for a model with
  grouped-query attention (its keys and values take a group's fraction of a head's), 8192 and
  2048 for one without (BLOOM), as Petals sets them.

The memory of a block is counted as Petals counts it, from the model's config, allocating
nothing:

- weights: the parameters of one block, built on the ``meta`` device from our own block class.
  The weights of its linear layers count at their quantised size (one byte for int8, 4.25 bits
  for nf4: 4-bit codes plus per-64 scales, themselves quantised), the rest (norms, biases) at the
  dtype's, and 1% more for quantisation state and tensor metadata;
- attention cache: ``attn_cache_tokens`` positions of keys and values, what the server sets aside
  per block for sessions;
- LoRA adapters: the weights an adapter adds to one block (its rank times the adapted layers'
  inputs and outputs), for each adapter served;
- once per server, a reserve for autograd (what a backward pass holds at once): 2 GiB at
  BLOOM-176B's hidden size of 14336, in proportion to the hidden size for other models;
- once per server, what serving holds besides weights and caches, measured on the device before
  choosing (:func:`measure_overhead`): one block is built there, takes a prefill step of
  ``max_batch_tokens`` tokens (activations, the matmul library's workspace) and, with decode
  graphs, warms up and captures them as a server does at load (the graphs' memory pool, the
  attention kernels' partial results, the compiled kernels); the device's free memory before less
  after, less the block's own weights and cache.

Petals divides the device's total memory; we divide its free memory, so that what another server
or program holds on the same GPU stays theirs.

Deciding is pure (:func:`plan_defaults` and the functions it calls): figures in, a choice and
the reason for it out, so tests give them a CUDA device on machines without one.
:func:`choose_defaults` reads the figures (free CUDA memory, whether bitsandbytes runs) and logs
what was chosen and why.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Final

import attrs
import torch
from transformers import PretrainedConfig

from .._errors import ConfigError
from .._extras import require
from ..models import (
    Block,
    DecodeGraphs,
    DecodeGraphsConfig,
    QuantType,
    adapter_nbytes_per_block,
    new_block,
    quantize_block,
    quantized_linears,
)

if TYPE_CHECKING:
    from ._config import ServerConfig

__all__ = [
    "BlockBudget",
    "ServingDefaults",
    "autograd_reserve_nbytes",
    "bitsandbytes_problem",
    "block_nbytes",
    "cache_nbytes_per_token",
    "choose_defaults",
    "default_attn_cache_tokens",
    "default_inference_max_length",
    "grouped_query",
    "measure_overhead",
    "plan_defaults",
    "plan_num_blocks",
    "resolve_device",
    "resolve_dtype",
    "resolve_quant_type",
]

logger = logging.getLogger("petals_core.server")

#: Attention cache per served block, in positions of one row (``--attn_cache_tokens``), and the
#: longest session (``--inference_max_length``): with grouped-query attention, and without.
_ATTN_CACHE_TOKENS: Final = {True: 32768, False: 8192}
_INFERENCE_MAX_LENGTH: Final = {True: 8192, False: 2048}
#: Petals' reserve for autograd: 2 GiB at hidden size 14336 (BLOOM-176B), in proportion elsewhere.
_AUTOGRAD_RESERVE_NBYTES_PER_HIDDEN: Final = 2 * 2**30 / 14336
#: Bytes per weight of a quantised linear layer (nf4: 4 bits, and the double-quantised scales).
_QUANTISED_NBYTES_PER_WEIGHT: Final[dict[str, float]] = {"int8": 1.0, "nf4": 4.25 / 8}
#: Quantisation state (scales, tables) and tensor metadata, as a fraction of the weights.
_METADATA_FRACTION: Final = 0.01
#: What a server's compiled kernels and library handles take on the device outside torch's
#: allocator, at most: counted when other processes' allocations blur the device's free memory.
_CODE_ALLOWANCE: Final = 256 * 2**20


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def size_text(nbytes: float) -> str:
    """``nbytes`` for people: GiB, MiB or KiB with two decimals, or bytes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


# -- device, dtype, quantisation ---------------------------------------------------------------


def resolve_device(name: str | None, *, cuda_available: bool) -> tuple[torch.device, str]:
    """The device to serve on, and why."""
    if name is not None:
        device = torch.device(name)
        if device.type == "cuda" and not cuda_available:
            raise ConfigError(f"device {name!r}: torch has no CUDA here")
        return device, "asked for"
    if cuda_available:
        return torch.device("cuda"), "CUDA is available"
    return torch.device("cpu"), "CUDA is not available"


def resolve_dtype(
    name: str, model_config: PretrainedConfig, device: torch.device
) -> tuple[torch.dtype, str]:
    """The dtype of the blocks for ``torch_dtype=name``, and why (see the module's docstring)."""
    if name != "auto":
        return getattr(torch, name), "asked for"
    if device.type == "cpu":
        return torch.float32, "auto on cpu: without AMX, bfloat16 matmuls are slower there"
    stored = getattr(model_config, "dtype", None)
    if isinstance(stored, str) and isinstance(getattr(torch, stored, None), torch.dtype):
        stored = getattr(torch, stored)
    if stored in (torch.float16, torch.bfloat16):
        assert isinstance(stored, torch.dtype)
        return stored, f"auto: the checkpoint stores {_dtype_name(stored)}, served as stored"
    what = (
        f"stores {_dtype_name(stored)}"
        if isinstance(stored, torch.dtype)
        else "does not say its dtype"
    )
    return torch.bfloat16, f"auto on {device.type}: the checkpoint {what}"


def resolve_quant_type(
    requested: QuantType | None, device: torch.device, *, bitsandbytes_problem: str | None
) -> tuple[QuantType, str]:
    """The quantisation of the blocks' linear layers, and why.

    ``requested`` None means auto: nf4 on CUDA, unless ``bitsandbytes_problem`` says why
    bitsandbytes cannot run there; none elsewhere.
    """
    if requested is not None:
        return requested, "asked for"
    if device.type != "cuda":
        return "none", f"auto on {device.type}: quantised by default on CUDA only"
    if bitsandbytes_problem is not None:
        return "none", f"auto on cuda, but bitsandbytes cannot run there: {bitsandbytes_problem}"
    return "nf4", "auto on cuda: 4-bit weights take about a quarter of 16-bit ones' memory"


def bitsandbytes_problem(device: torch.device) -> str | None:
    """Why bitsandbytes cannot quantise to nf4 on ``device``, or None if it can.

    It is imported and quantises 64 values there: an import that succeeds is not enough, since a
    build without kernels for this device fails only when first used.
    """
    try:
        require("quant", "nf4 quantisation")
        from bitsandbytes.functional import quantize_4bit

        quantize_4bit(torch.ones(64, device=device), quant_type="nf4")
    except Exception as exc:  # whatever stops it, the server serves unquantised blocks instead
        return f"{type(exc).__name__}: {exc}"
    return None


# -- memory ------------------------------------------------------------------------------------


def _meta_block(model_config: PretrainedConfig) -> Block:
    """One block of the model with parameters on "meta": shapes without memory."""
    with torch.device("meta"):
        return new_block(model_config, purpose="size blocks")


def block_nbytes(
    model_config: PretrainedConfig, *, dtype: torch.dtype, quant_type: QuantType
) -> int:
    """Device memory the weights of one block take, in ``dtype`` and quantised by ``quant_type``."""
    block = _meta_block(model_config)
    linear = sum(module.weight.numel() for _, _, module in quantized_linears(block))
    other = sum(parameter.numel() for parameter in block.parameters()) - linear
    per_weight = _QUANTISED_NBYTES_PER_WEIGHT.get(quant_type, dtype.itemsize)
    return math.ceil((linear * per_weight + other * dtype.itemsize) * (1 + _METADATA_FRACTION))


def cache_nbytes_per_token(model_config: PretrainedConfig, *, dtype: torch.dtype) -> int:
    """Attention cache of one block for one position of one row: its keys and values."""
    block = _meta_block(model_config)
    return block.allocate_cache(1, 1, dtype=dtype, device="meta").nbytes


def grouped_query(model_config: PretrainedConfig) -> bool:
    """Whether the model's attention has fewer key/value heads than query heads (grouped-query
    or multi-query attention)."""
    block = _meta_block(model_config)
    for module in block.modules():
        heads = getattr(module, "n_head", None)
        if isinstance(heads, int):
            kv_heads = getattr(module, "n_kv_head", heads)
            return isinstance(kv_heads, int) and kv_heads < heads
    return False


def default_attn_cache_tokens(model_config: PretrainedConfig) -> int:
    """The attention cache per block, in positions of one row, when not told (Petals')."""
    return _ATTN_CACHE_TOKENS[grouped_query(model_config)]


def default_inference_max_length(model_config: PretrainedConfig) -> int:
    """The longest session, in positions, when not told (Petals')."""
    return _INFERENCE_MAX_LENGTH[grouped_query(model_config)]


def autograd_reserve_nbytes(model_config: PretrainedConfig) -> int:
    """Device memory kept free for what backward passes hold (Petals' estimate)."""
    return math.ceil(_AUTOGRAD_RESERVE_NBYTES_PER_HIDDEN * int(model_config.hidden_size))


@attrs.frozen(kw_only=True)
class BlockBudget:
    """How many blocks fit in a device's free memory, with the figures it follows from."""

    num_blocks: int
    #: Blocks that would fit; ``num_blocks`` is this, at most the model's number of blocks.
    fitting_blocks: int
    total_blocks: int
    free_nbytes: int
    reserve_nbytes: int
    #: What serving holds besides weights and caches, measured (see :func:`measure_overhead`).
    overhead_nbytes: int
    weights_nbytes_per_block: int
    cache_nbytes_per_block: int
    adapters_nbytes_per_block: int
    attn_cache_tokens: int

    @property
    def nbytes_per_block(self) -> int:
        return (
            self.weights_nbytes_per_block
            + self.cache_nbytes_per_block
            + self.adapters_nbytes_per_block
        )

    @property
    def reason(self) -> str:
        """The arithmetic, in one line."""
        fit = (
            f"{self.fitting_blocks} fit, the model has {self.total_blocks}"
            if self.fitting_blocks > self.total_blocks
            else f"{self.fitting_blocks} of the model's {self.total_blocks} fit"
        )
        adapters = (
            f" + {size_text(self.adapters_nbytes_per_block)} of adapters"
            if self.adapters_nbytes_per_block
            else ""
        )
        return (
            f"({size_text(self.free_nbytes)} free - {size_text(self.reserve_nbytes)} reserved "
            f"for autograd - {size_text(self.overhead_nbytes)} measured for activations, "
            f"workspaces and decode graphs) / ({size_text(self.weights_nbytes_per_block)} of "
            f"weights + {size_text(self.cache_nbytes_per_block)} of attention cache for "
            f"{self.attn_cache_tokens} tokens{adapters} per block): {fit}"
        )


def plan_num_blocks(
    model_config: PretrainedConfig,
    *,
    dtype: torch.dtype,
    quant_type: QuantType,
    attn_cache_tokens: int,
    free_nbytes: int,
    overhead_nbytes: int = 0,
    adapters_nbytes_per_block: int = 0,
) -> BlockBudget:
    """How many blocks of the model fit in ``free_nbytes`` of device memory, besides
    ``overhead_nbytes`` that serving holds whatever the blocks and the reserve for autograd.

    Raises :class:`ConfigError` if not even one does.
    """
    weights = block_nbytes(model_config, dtype=dtype, quant_type=quant_type)
    cache = attn_cache_tokens * cache_nbytes_per_token(model_config, dtype=dtype)
    reserve = autograd_reserve_nbytes(model_config)
    per_block = weights + cache + adapters_nbytes_per_block
    fitting = max(0, (free_nbytes - reserve - overhead_nbytes) // per_block)
    if fitting < 1:
        adapters = (
            f" + {size_text(adapters_nbytes_per_block)} of adapters"
            if adapters_nbytes_per_block
            else ""
        )
        raise ConfigError(
            f"not even one block fits in the device's free memory: {size_text(free_nbytes)} "
            f"free, one block needs {size_text(per_block)} ({size_text(weights)} of "
            f"{_dtype_name(dtype)} weights, quant_type {quant_type}, + {size_text(cache)} of "
            f"attention cache for {attn_cache_tokens} tokens{adapters}) besides "
            f"{size_text(reserve)} reserved for autograd and {size_text(overhead_nbytes)} "
            "measured for activations, workspaces and decode graphs; free memory on the device, "
            "quantise (--quant_type nf4) or give fewer --attn_cache_tokens"
        )
    total = int(model_config.num_hidden_layers)
    return BlockBudget(
        num_blocks=min(fitting, total),
        fitting_blocks=fitting,
        total_blocks=total,
        free_nbytes=free_nbytes,
        reserve_nbytes=reserve,
        overhead_nbytes=overhead_nbytes,
        weights_nbytes_per_block=weights,
        cache_nbytes_per_block=cache,
        adapters_nbytes_per_block=adapters_nbytes_per_block,
        attn_cache_tokens=attn_cache_tokens,
    )


def measure_overhead(
    model_config: PretrainedConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    quant_type: QuantType,
    max_batch_tokens: int,
    decode_graphs: DecodeGraphsConfig | None,
) -> int:
    """Device memory (bytes) that serving holds besides the blocks' weights and caches, measured
    on ``device`` (CUDA) with one block of the model (random weights, quantised as served): a
    prefill step of ``max_batch_tokens`` tokens (activations, the matmul library's workspace),
    then, with ``decode_graphs``, their warm-up and captures at load (memory pool, the attention
    kernels' partial results, compiled kernels).  Everything made is freed again.

    Two measures, of which the smaller counts: the device's free memory before less after (all
    of it, the compiled kernels' code too, but also whatever other processes took meanwhile),
    and this process's allocator at its peak (its own only, but not the code) plus
    :data:`_CODE_ALLOWANCE`; each less the block's weights and cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    reserved_before = torch.cuda.memory_reserved(device)
    allocated_before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.device("meta"):
        block = new_block(model_config, 0, purpose="measure serving memory")
    block = block.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.02)
    quantize_block(block, quant_type)
    block.requires_grad_(False).eval()
    cache = block.allocate_cache(1, max_batch_tokens + 1)
    held = torch.cuda.memory_allocated(device) - allocated_before  # weights and cache
    with torch.inference_mode():
        hidden = torch.randn(1, max_batch_tokens, int(model_config.hidden_size), device=device)
        block(hidden.to(dtype), cache=cache)
    graphs = None
    if decode_graphs is not None and DecodeGraphs.unsupported_reason([block]) is None:
        graphs = DecodeGraphs([block], config=decode_graphs)
        if graphs.warm_up():
            graphs.capture_ahead()
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    own = torch.cuda.max_memory_reserved(device) - reserved_before + _CODE_ALLOWANCE
    del graphs, cache, block, hidden
    torch.cuda.empty_cache()
    return max(0, min(free_before - free_after, own) - held)


# -- all together ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ServingDefaults:
    """What a server serves, each with the reason it was chosen."""

    device: torch.device
    dtype: torch.dtype
    quant_type: QuantType
    #: How many blocks to serve (the server then chooses which).
    num_blocks: int
    #: Attention cache per served block, in positions of one row.
    attn_cache_tokens: int
    #: The longest session, in positions.
    inference_max_length: int
    device_reason: str
    dtype_reason: str
    quant_type_reason: str
    num_blocks_reason: str
    #: The memory arithmetic, when the number of blocks was chosen by it.
    budget: BlockBudget | None = None


def plan_defaults(
    config: ServerConfig,
    model_config: PretrainedConfig,
    *,
    cuda_available: bool,
    free_nbytes: int | None,
    bitsandbytes_problem: str | None,
    overhead_nbytes: int = 0,
    adapters_nbytes_per_block: int = 0,
) -> ServingDefaults:
    """The device, dtype, quantisation, number of blocks, attention cache and longest session
    for ``config``, logged with why.

    ``free_nbytes`` is the free memory of the device ``config`` resolves to, needed when that is
    CUDA and neither ``num_blocks`` nor ``block_indices`` is given, and then ``overhead_nbytes``
    (:func:`measure_overhead`) and ``adapters_nbytes_per_block`` (what the served adapters add
    to a block) count against it; ``bitsandbytes_problem`` says why bitsandbytes cannot run there
    (None if it can; see :func:`bitsandbytes_problem`).
    """
    device, device_reason = resolve_device(config.device, cuda_available=cuda_available)
    dtype, dtype_reason = resolve_dtype(config.torch_dtype, model_config, device)
    quant_type, quant_reason = resolve_quant_type(
        config.quant_type, device, bitsandbytes_problem=bitsandbytes_problem
    )
    grouped = grouped_query(model_config)
    attention = "grouped-query attention" if grouped else "no grouped-query attention"
    attn_cache_tokens = config.attn_cache_tokens or _ATTN_CACHE_TOKENS[grouped]
    cache_reason = "asked for" if config.attn_cache_tokens else f"the default for {attention}"
    length = config.limits.inference_max_length or _INFERENCE_MAX_LENGTH[grouped]
    length_reason = (
        "asked for" if config.limits.inference_max_length else f"the default for {attention}"
    )
    total = int(model_config.num_hidden_layers)
    budget = None
    if config.block_indices is not None:
        start, end = config.block_indices
        if end > total:
            raise ConfigError(
                f"--block_indices {start}:{end} goes beyond the model's {total} blocks"
            )
        num_blocks, blocks_reason = end - start, f"asked for blocks {start}:{end}"
    elif config.num_blocks is not None:
        num_blocks = min(config.num_blocks, total)
        blocks_reason = "asked for" + (
            f" {config.num_blocks}, the model has {total}" if config.num_blocks > total else ""
        )
    elif device.type == "cuda":
        if free_nbytes is None:
            raise ValueError("the device's free memory is needed to choose how many blocks fit")
        budget = plan_num_blocks(
            model_config,
            dtype=dtype,
            quant_type=quant_type,
            attn_cache_tokens=attn_cache_tokens,
            free_nbytes=free_nbytes,
            overhead_nbytes=overhead_nbytes,
            adapters_nbytes_per_block=adapters_nbytes_per_block,
        )
        num_blocks, blocks_reason = (
            budget.num_blocks,
            f"as many as fit in {device}: {budget.reason}",
        )
    else:
        num_blocks = total
        blocks_reason = (
            f"all of the model's, on {device.type} (free memory is counted on CUDA only; "
            "--num_blocks serves fewer)"
        )
    defaults = ServingDefaults(
        device=device,
        dtype=dtype,
        quant_type=quant_type,
        num_blocks=num_blocks,
        attn_cache_tokens=attn_cache_tokens,
        inference_max_length=length,
        device_reason=device_reason,
        dtype_reason=dtype_reason,
        quant_type_reason=quant_reason,
        num_blocks_reason=blocks_reason,
        budget=budget,
    )
    logger.info("device %s: %s", device, device_reason)
    logger.info("dtype %s: %s", _dtype_name(dtype), dtype_reason)
    if config.quant_type is None and device.type == "cuda" and bitsandbytes_problem is not None:
        logger.warning("quant_type %s: %s", quant_type, quant_reason)
    else:
        logger.info("quant_type %s: %s", quant_type, quant_reason)
    logger.info("attention cache of %d tokens per block: %s", attn_cache_tokens, cache_reason)
    logger.info("sessions of up to %d tokens: %s", length, length_reason)
    logger.info("%d blocks: %s", num_blocks, blocks_reason)
    return defaults


def choose_defaults(config: ServerConfig, model_config: PretrainedConfig) -> ServingDefaults:
    """:func:`plan_defaults` with the figures of this machine: whether torch has CUDA, the free
    memory of the device (``torch.cuda.mem_get_info``), whether bitsandbytes runs there, and,
    when the number of blocks follows from the free memory, what serving holds besides the
    blocks (:func:`measure_overhead`) and what the adapters add to each block."""
    cuda_available = torch.cuda.is_available()
    device, _ = resolve_device(config.device, cuda_available=cuda_available)
    problem = None
    if device.type == "cuda" and config.quant_type is None:
        problem = bitsandbytes_problem(device)
    free_nbytes = None
    overhead = adapters = 0
    if device.type == "cuda" and config.num_blocks is None and config.block_indices is None:
        dtype, _ = resolve_dtype(config.torch_dtype, model_config, device)
        quant_type, _ = resolve_quant_type(config.quant_type, device, bitsandbytes_problem=problem)
        length = config.limits.inference_max_length or default_inference_max_length(model_config)
        free_nbytes, _ = torch.cuda.mem_get_info(device)
        overhead = measure_overhead(
            model_config,
            device=device,
            dtype=dtype,
            quant_type=quant_type,
            max_batch_tokens=config.limits.max_batch_tokens,
            decode_graphs=DecodeGraphsConfig(ahead_max_length=length)
            if config.cuda_graphs
            else None,
        )
        for name in config.adapters:
            adapters += adapter_nbytes_per_block(
                name,
                config=model_config,
                dtype=dtype,
                token=config.token,
                cache_dir=config.cache_dir,
                local_files_only=config.local_files_only,
            )
    return plan_defaults(
        config,
        model_config,
        cuda_available=cuda_available,
        free_nbytes=free_nbytes,
        bitsandbytes_problem=problem,
        overhead_nbytes=overhead,
        adapters_nbytes_per_block=adapters,
    )
