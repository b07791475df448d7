"""A server's defaults: dtype, quantisation and how many blocks fit, decided from given figures.

Deciding touches no GPU, so the CUDA cases run here with a ``torch.device("cuda")`` and a free
memory figure.  Block sizes are checked against published parameter counts of real models (built
on "meta", nothing allocated) and against what quantised blocks take once built.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from transformers import BloomConfig, FalconConfig, GPT2Config, LlamaConfig, PretrainedConfig
from transformers.models.falcon.modeling_falcon import FalconDecoderLayer

from petals_core import ConfigError
from petals_core.models import DecodeGraphsConfig, QuantType, new_block, quantize_block
from petals_core.server._config import ServerConfig
from petals_core.server._defaults import (
    ServingDefaults,
    autograd_reserve_nbytes,
    bitsandbytes_problem,
    block_nbytes,
    cache_nbytes_per_token,
    choose_defaults,
    default_attn_cache_tokens,
    default_inference_max_length,
    grouped_query,
    measure_overhead,
    plan_defaults,
    plan_num_blocks,
    resolve_device,
    resolve_dtype,
    resolve_quant_type,
)
from petals_core.server._handler import ServingLimits
from petals_core.testing import (
    bloom_560m_config,
    falcon_7b_config,
    mixtral_8x7b_config,
    tiny_falcon_config,
    tiny_mixtral_config,
    tinyllama_1b_config,
)

from .._cuda import needs_cuda
from ..models.conftest import tiny_bloom_config, tiny_llama_config

CPU = torch.device("cpu")
CUDA = torch.device("cuda")
GIB = 2**30
LOGGER = "petals_core.server"


def llama2_70b() -> LlamaConfig:
    """Llama-2-70B: 68,976,648,192 parameters, 80 blocks (TinyLlama's vocabulary)."""
    return tinyllama_1b_config(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_hidden_layers=80,
    )


def bloom_176b() -> BloomConfig:
    """BLOOM: 176,247,271,424 parameters, 70 blocks."""
    return BloomConfig(hidden_size=14336, n_head=112, n_layer=70, vocab_size=250880)


def falcon_40b() -> FalconConfig:
    """Falcon-40B: 60 blocks of the new decoder architecture, 128 heads over 8 key/value heads
    (Falcon-7B's vocabulary)."""
    return falcon_7b_config(
        hidden_size=8192,
        num_attention_heads=128,
        num_kv_heads=8,
        new_decoder_architecture=True,
        num_hidden_layers=60,
    )


def _per_block(total: int, outside_blocks: int, blocks: int) -> int:
    assert (total - outside_blocks) % blocks == 0
    return (total - outside_blocks) // blocks


# Published totals less the embeddings, output head and final norms, per block.
PARAMETERS_PER_BLOCK = {
    "tinyllama_1b": _per_block(1_100_048_384, 2 * 32000 * 2048 + 2048, 22),
    "llama2_70b": _per_block(68_976_648_192, 2 * 32000 * 8192 + 8192, 80),
    "bloom_560m": _per_block(559_214_592, 250880 * 1024 + 2 * 2 * 1024, 24),
    "bloom_176b": _per_block(176_247_271_424, 250880 * 14336 + 2 * 2 * 14336, 70),
    # Mixtral-8x7B: 46,702,792,704 parameters, most of them its 8 experts per block.
    "mixtral_8x7b": _per_block(46_702_792_704, 2 * 32000 * 4096 + 4096, 32),
}
MODELS = {
    "tinyllama_1b": tinyllama_1b_config,
    "llama2_70b": llama2_70b,
    "bloom_560m": bloom_560m_config,
    "bloom_176b": bloom_176b,
    "mixtral_8x7b": mixtral_8x7b_config,
}


def _server_config(**overrides: Any) -> ServerConfig:
    return ServerConfig(**{"model": "m", "new_swarm": True, **overrides})


# -- block memory --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unquantised_block_bytes_follow_published_parameter_counts(name: str) -> None:
    config = MODELS[name]()
    parameters = PARAMETERS_PER_BLOCK[name]
    for dtype in (torch.float32, torch.bfloat16):
        expected = math.ceil(parameters * dtype.itemsize * 1.01)  # 1% for metadata
        assert block_nbytes(config, dtype=dtype, quant_type="none") == expected


@pytest.mark.parametrize("config", [falcon_7b_config(), falcon_40b()], ids=["7b", "40b"])
def test_falcon_block_bytes_are_those_of_transformers_layers(config: FalconConfig) -> None:
    config._attn_implementation = "eager"
    with torch.device("meta"):
        layer = FalconDecoderLayer(config)
    parameters = sum(p.numel() for p in layer.parameters())
    assert block_nbytes(config, dtype=torch.bfloat16, quant_type="none") == math.ceil(
        parameters * 2 * 1.01
    )


def test_a_quantised_mixtral_block_keeps_its_router_and_counts_every_expert() -> None:
    config = mixtral_8x7b_config()
    router = 8 * 4096
    norms = 2 * 4096
    linear = PARAMETERS_PER_BLOCK["mixtral_8x7b"] - router - norms
    assert block_nbytes(config, dtype=torch.bfloat16, quant_type="nf4") == math.ceil(
        (linear * 4.25 / 8 + (router + norms) * 2) * 1.01
    )


def test_quantised_linear_weights_count_at_their_quantised_size() -> None:
    """Llama-2-70B's linear weights are all its parameters but two RMSNorms of 8192."""
    config = llama2_70b()
    norms = 2 * 8192
    linear = PARAMETERS_PER_BLOCK["llama2_70b"] - norms
    nf4 = block_nbytes(config, dtype=torch.bfloat16, quant_type="nf4")
    int8 = block_nbytes(config, dtype=torch.bfloat16, quant_type="int8")
    assert nf4 == math.ceil((linear * 4.25 / 8 + norms * 2) * 1.01)
    assert int8 == math.ceil((linear * 1 + norms * 2) * 1.01)
    # The dtype changes only what stays unquantised.
    nf4_fp32 = block_nbytes(config, dtype=torch.float32, quant_type="nf4")
    assert nf4_fp32 == math.ceil((linear * 4.25 / 8 + norms * 4) * 1.01)


def _stored_nbytes(block: torch.nn.Module) -> int:
    """Bytes a built block holds: parameters, buffers and bitsandbytes' quantisation state."""
    total = sum(t.nbytes for t in [*block.parameters(), *block.buffers()])
    for module in block.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None:  # nf4: per-64 absmax (quantised) and its own absmax, code tables
            total += state.absmax.nbytes + state.code.nbytes
            if state.state2 is not None:
                total += state.state2.absmax.nbytes + state.state2.code.nbytes
        scales = getattr(weight, "SCB", None)
        if scales is not None:  # int8: one float32 scale per output row
            total += scales.nbytes
    return total


@pytest.mark.parametrize(
    ("family", "quant_type"),
    [
        ("llama", "nf4"),
        ("bloom", "int8"),
        ("llama", "none"),
        ("falcon", "nf4"),
        ("falcon", "int8"),
        ("mixtral", "nf4"),
    ],
)
def test_estimate_covers_what_a_built_block_holds_within_five_percent(
    family: str, quant_type: QuantType
) -> None:
    config = {
        "llama": lambda: LlamaConfig(
            hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4
        ),
        "bloom": lambda: BloomConfig(hidden_size=1024, n_head=16),
        "falcon": lambda: tiny_falcon_config(hidden_size=1024, num_attention_heads=16),
        "mixtral": lambda: tiny_mixtral_config(hidden_size=1024, intermediate_size=1024),
    }[family]()
    block = new_block(config)
    quantize_block(block.to(torch.bfloat16), quant_type)
    held = _stored_nbytes(block)
    estimate = block_nbytes(config, dtype=torch.bfloat16, quant_type=quant_type)
    assert held <= estimate <= 1.05 * held


@pytest.mark.parametrize(
    "config",
    [
        tiny_llama_config(),
        tiny_bloom_config(),
        tiny_falcon_config(),
        tiny_falcon_config(alibi=True),
        tiny_mixtral_config(),
    ],
    ids=["llama", "bloom", "falcon", "falcon-alibi", "mixtral"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_per_token_are_what_a_block_allocates(
    config: PretrainedConfig, dtype: torch.dtype
) -> None:
    block = new_block(config)
    assert (
        cache_nbytes_per_token(config, dtype=dtype)
        == block.allocate_cache(1, 1, dtype=dtype).nbytes
    )


def test_cache_bytes_per_token_of_real_shapes() -> None:
    # Keys and values: 2 x kv heads x head_dim x itemsize.
    assert cache_nbytes_per_token(llama2_70b(), dtype=torch.bfloat16) == 2 * 8 * 128 * 2
    assert cache_nbytes_per_token(tinyllama_1b_config(), dtype=torch.float32) == 2 * 4 * 64 * 4
    assert cache_nbytes_per_token(bloom_176b(), dtype=torch.bfloat16) == 2 * 14336 * 2
    # Falcon caches each key/value head once: 1 for 7B (multi-query), 8 for 40B.
    assert cache_nbytes_per_token(falcon_7b_config(), dtype=torch.bfloat16) == 2 * 1 * 64 * 2
    assert cache_nbytes_per_token(falcon_40b(), dtype=torch.bfloat16) == 2 * 8 * 64 * 2
    assert cache_nbytes_per_token(mixtral_8x7b_config(), dtype=torch.bfloat16) == 2 * 8 * 128 * 2


def test_autograd_reserve_is_two_gib_at_bloom_176b_and_proportional() -> None:
    assert autograd_reserve_nbytes(bloom_176b()) == 2 * GIB
    assert autograd_reserve_nbytes(llama2_70b()) == math.ceil(2 * GIB * 8192 / 14336)
    assert autograd_reserve_nbytes(tinyllama_1b_config()) == math.ceil(2 * GIB * 2048 / 14336)


def test_other_model_types_cannot_be_sized() -> None:
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        block_nbytes(GPT2Config(), dtype=torch.float32, quant_type="none")


# -- how many blocks fit -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("quant_type", ["none", "int8", "nf4"])
@pytest.mark.parametrize("tokens", [4096, 32768])
@pytest.mark.parametrize("free_gib", [23, 79])
@pytest.mark.parametrize(("overhead", "adapters"), [(0, 0), (3 * GIB // 2, 50 * 2**20)])
def test_the_blocks_chosen_fit_and_one_more_would_not(
    name: str, quant_type: QuantType, tokens: int, free_gib: int, overhead: int, adapters: int
) -> None:
    """Besides the weights and cache of each block: the reserve for autograd, what serving was
    measured to hold, and what adapters add to each block."""
    config = MODELS[name]()
    free = free_gib * GIB
    weights = block_nbytes(config, dtype=torch.bfloat16, quant_type=quant_type)
    cache = tokens * cache_nbytes_per_token(config, dtype=torch.bfloat16)
    reserve = autograd_reserve_nbytes(config)
    per_block = weights + cache + adapters
    figures: dict[str, Any] = {
        "dtype": torch.bfloat16,
        "quant_type": quant_type,
        "attn_cache_tokens": tokens,
        "free_nbytes": free,
        "overhead_nbytes": overhead,
        "adapters_nbytes_per_block": adapters,
    }
    if reserve + overhead + per_block > free:
        with pytest.raises(ConfigError, match="not even one block fits"):
            plan_num_blocks(config, **figures)
        return
    budget = plan_num_blocks(config, **figures)
    assert (budget.weights_nbytes_per_block, budget.cache_nbytes_per_block) == (weights, cache)
    assert (budget.reserve_nbytes, budget.overhead_nbytes) == (reserve, overhead)
    assert budget.nbytes_per_block == per_block
    fitting = budget.fitting_blocks
    fixed = reserve + overhead
    assert fixed + fitting * per_block <= free < fixed + (fitting + 1) * per_block
    assert budget.num_blocks == min(fitting, config.num_hidden_layers)


def test_worked_examples() -> None:
    """Llama-2-70B, nf4, bfloat16, 16384 tokens: a 24 GB card with 23 GiB free holds 44 blocks
    of 0.43 GiB weights + 64 MiB cache, after a reserve of 8192 / 14336 x 2 GiB."""
    worked: dict[str, Any] = dict(dtype=torch.bfloat16, quant_type="nf4", attn_cache_tokens=16384)
    budget = plan_num_blocks(llama2_70b(), free_nbytes=23 * GIB, **worked)
    assert budget.weights_nbytes_per_block == 459_136_369
    assert budget.cache_nbytes_per_block == 64 * 2**20
    assert budget.reserve_nbytes == 1_227_133_514
    assert (budget.num_blocks, budget.fitting_blocks) == (44, 44)
    assert budget.reason == (
        "(23.00 GiB free - 1.14 GiB reserved for autograd - 0 B measured for activations, "
        "workspaces and decode graphs) / (437.87 MiB of weights + 64.00 MiB of attention cache "
        "for 16384 tokens per block): 44 of the model's 80 fit"
    )
    # What serving was measured to hold, and a LoRA adapter of rank 16 on every projection.
    served = plan_num_blocks(
        llama2_70b(),
        free_nbytes=23 * GIB,
        overhead_nbytes=2 * GIB,
        adapters_nbytes_per_block=30 * 2**20,
        **worked,
    )
    assert (served.num_blocks, served.fitting_blocks) == (38, 38)  # 19.86 GiB / 531.87 MiB
    assert "- 2.00 GiB measured for activations" in served.reason
    assert "+ 30.00 MiB of adapters per block" in served.reason
    # TinyLlama on an H200: every block, with room to spare.
    small = plan_num_blocks(tinyllama_1b_config(), free_nbytes=139 * GIB, **worked)
    assert small.num_blocks == 22 < small.fitting_blocks
    assert small.reason.endswith(f"{small.fitting_blocks} fit, the model has 22")


def test_not_even_one_block_says_what_is_free_and_what_one_needs() -> None:
    config = bloom_176b()
    weights = block_nbytes(config, dtype=torch.bfloat16, quant_type="none")
    cache = 16384 * cache_nbytes_per_token(config, dtype=torch.bfloat16)
    needed = autograd_reserve_nbytes(config) + weights + cache
    common: dict[str, Any] = {
        "dtype": torch.bfloat16,
        "quant_type": "none",
        "attn_cache_tokens": 16384,
    }
    assert plan_num_blocks(config, free_nbytes=needed, **common).num_blocks == 1
    with pytest.raises(ConfigError) as raised:
        plan_num_blocks(config, free_nbytes=needed - 1, **common)
    message = str(raised.value)
    assert "not even one block fits in the device's free memory: 7.52 GiB free" in message
    assert "one block needs 5.52 GiB (4.64 GiB of bfloat16 weights" in message
    assert "2.00 GiB reserved for autograd" in message
    assert "--quant_type nf4" in message and "--attn_cache_tokens" in message
    with pytest.raises(ConfigError, match="0 B free"):
        plan_num_blocks(config, free_nbytes=0, **common)


# -- device, dtype, quantisation -----------------------------------------------------------------


def test_device() -> None:
    assert resolve_device(None, cuda_available=True) == (CUDA, "CUDA is available")
    assert resolve_device(None, cuda_available=False) == (CPU, "CUDA is not available")
    assert resolve_device("cuda:1", cuda_available=True) == (torch.device("cuda:1"), "asked for")
    assert resolve_device("cpu", cuda_available=True) == (CPU, "asked for")
    with pytest.raises(ConfigError, match="device 'cuda:0': torch has no CUDA here"):
        resolve_device("cuda:0", cuda_available=False)


@pytest.mark.parametrize(
    ("stored", "device", "expected"),
    [
        (None, CPU, torch.float32),
        (torch.bfloat16, CPU, torch.float32),
        (torch.float16, CUDA, torch.float16),
        ("float16", CUDA, torch.float16),
        (torch.bfloat16, CUDA, torch.bfloat16),
        (torch.float32, CUDA, torch.bfloat16),
        (torch.float64, CUDA, torch.bfloat16),
        (None, CUDA, torch.bfloat16),
    ],
)
def test_auto_dtype(stored: Any, device: torch.device, expected: torch.dtype) -> None:
    config = tiny_llama_config(dtype=stored)
    dtype, reason = resolve_dtype("auto", config, device)
    assert dtype == expected
    assert reason.startswith("auto")


def test_auto_dtype_reasons() -> None:
    assert resolve_dtype("auto", tiny_llama_config(dtype="float16"), CUDA) == (
        torch.float16,
        "auto: the checkpoint stores float16, served as stored",
    )
    assert resolve_dtype("auto", tiny_llama_config(dtype="float32"), CUDA) == (
        torch.bfloat16,
        "auto on cuda: the checkpoint stores float32",
    )
    assert resolve_dtype("auto", tiny_llama_config(), CUDA)[1] == (
        "auto on cuda: the checkpoint does not say its dtype"
    )
    assert "without AMX" in resolve_dtype("auto", tiny_llama_config(), CPU)[1]


def test_a_dtype_asked_for_is_kept_anywhere() -> None:
    config = tiny_llama_config(dtype="bfloat16")
    assert resolve_dtype("float16", config, CPU) == (torch.float16, "asked for")
    assert resolve_dtype("float32", config, CUDA) == (torch.float32, "asked for")


def test_auto_quantisation() -> None:
    assert resolve_quant_type(None, CPU, bitsandbytes_problem=None)[0] == "none"
    assert resolve_quant_type(None, CUDA, bitsandbytes_problem=None)[0] == "nf4"
    quant_type, reason = resolve_quant_type(
        None, CUDA, bitsandbytes_problem="ModuleNotFoundError: No module named 'bitsandbytes'"
    )
    assert quant_type == "none"
    assert reason == (
        "auto on cuda, but bitsandbytes cannot run there: "
        "ModuleNotFoundError: No module named 'bitsandbytes'"
    )
    asked_for: list[QuantType] = ["none", "int8", "nf4"]
    for asked in asked_for:
        assert resolve_quant_type(asked, CUDA, bitsandbytes_problem=None) == (asked, "asked for")
        assert resolve_quant_type(asked, CPU, bitsandbytes_problem="x") == (asked, "asked for")


def test_bitsandbytes_runs_on_the_cpu() -> None:
    assert bitsandbytes_problem(CPU) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bitsandbytes_on_cuda_without_cuda_says_why() -> None:
    problem = bitsandbytes_problem(CUDA)
    assert problem is not None and "CUDA" in problem


def test_server_config_quant_type_is_checked() -> None:
    assert _server_config().quant_type is None
    with pytest.raises(ConfigError, match="quant_type 'int4' is not one of none, int8, nf4"):
        _server_config(quant_type="int4")


# -- all together, and the log -------------------------------------------------------------------


def _on_cuda(
    model: PretrainedConfig,
    free_nbytes: int | None = None,
    *,
    bitsandbytes_problem: str | None = None,
    **config: Any,
) -> ServingDefaults:
    """The defaults of a server of ``model`` (``config``: its settings) on a CUDA machine with
    ``free_nbytes`` of device memory free (None: not measured) and bitsandbytes working unless
    there is a ``bitsandbytes_problem``."""
    return plan_defaults(
        _server_config(**config),
        model,
        cuda_available=True,
        free_nbytes=free_nbytes,
        bitsandbytes_problem=bitsandbytes_problem,
    )


def _messages(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_defaults_on_cuda_are_logged_with_the_arithmetic(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        defaults = _on_cuda(llama2_70b(), 23 * GIB)
    assert (defaults.device, defaults.dtype, defaults.quant_type) == (CUDA, torch.bfloat16, "nf4")
    # Grouped-query attention: 32768 tokens of cache per block (128 MiB for Llama-2-70B's 8
    # key/value heads), sessions of up to 8192; 21.86 GiB / 565.87 MiB per block.
    assert (defaults.attn_cache_tokens, defaults.inference_max_length) == (32768, 8192)
    assert defaults.num_blocks == 39
    assert defaults.budget is not None and defaults.budget.num_blocks == 39
    assert _messages(caplog) == [
        (logging.INFO, "device cuda: CUDA is available"),
        (logging.INFO, "dtype bfloat16: auto on cuda: the checkpoint does not say its dtype"),
        (
            logging.INFO,
            "quant_type nf4: auto on cuda: "
            "4-bit weights take about a quarter of 16-bit ones' memory",
        ),
        (
            logging.INFO,
            "attention cache of 32768 tokens per block: the default for grouped-query attention",
        ),
        (logging.INFO, "sessions of up to 8192 tokens: the default for grouped-query attention"),
        (logging.INFO, f"39 blocks: as many as fit in cuda: {defaults.budget.reason}"),
    ]


def test_models_without_grouped_query_attention_get_smaller_caches_and_sessions() -> None:
    """Petals' defaults: BLOOM's keys and values take as much as its queries, so its cache and
    longest session default to a quarter of a grouped-query model's."""
    assert [grouped_query(config()) for config in (bloom_176b, llama2_70b, falcon_7b_config)] == [
        False,
        True,
        True,
    ]
    assert default_attn_cache_tokens(bloom_176b()) == 8192
    assert default_inference_max_length(bloom_176b()) == 2048
    assert default_attn_cache_tokens(llama2_70b()) == 32768
    assert default_inference_max_length(llama2_70b()) == 8192
    bloom = _on_cuda(bloom_176b(), num_blocks=2)
    assert (bloom.attn_cache_tokens, bloom.inference_max_length) == (8192, 2048)
    asked = _on_cuda(
        bloom_176b(),
        num_blocks=2,
        attn_cache_tokens=100,
        limits=ServingLimits(inference_max_length=300),
    )
    assert (asked.attn_cache_tokens, asked.inference_max_length) == (100, 300)


def test_without_bitsandbytes_cuda_serves_unquantised_blocks_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        defaults = _on_cuda(llama2_70b(), 79 * GIB, bitsandbytes_problem="ImportError: no kernels")
    assert defaults.quant_type == "none"
    assert defaults.budget is not None
    assert defaults.budget.weights_nbytes_per_block == block_nbytes(
        llama2_70b(), dtype=torch.bfloat16, quant_type="none"
    )
    assert (
        logging.WARNING,
        "quant_type none: auto on cuda, but bitsandbytes cannot run there: ImportError: no kernels",
    ) in _messages(caplog)


def test_what_is_asked_for_is_served_and_no_memory_is_needed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        defaults = _on_cuda(llama2_70b(), num_blocks=8, torch_dtype="float16", quant_type="int8")
    assert (defaults.dtype, defaults.quant_type, defaults.num_blocks) == (torch.float16, "int8", 8)
    assert defaults.budget is None
    assert _messages(caplog)[1:] == [
        (logging.INFO, "dtype float16: asked for"),
        (logging.INFO, "quant_type int8: asked for"),
        (
            logging.INFO,
            "attention cache of 32768 tokens per block: the default for grouped-query attention",
        ),
        (logging.INFO, "sessions of up to 8192 tokens: the default for grouped-query attention"),
        (logging.INFO, "8 blocks: asked for"),
    ]
    too_many = _on_cuda(llama2_70b(), num_blocks=100)
    assert too_many.num_blocks == 80
    assert too_many.num_blocks_reason == "asked for 100, the model has 80"
    span = _on_cuda(llama2_70b(), block_indices=(10, 14))
    assert (span.num_blocks, span.num_blocks_reason) == (4, "asked for blocks 10:14")
    with pytest.raises(ConfigError, match="--block_indices 78:81 goes beyond the model's 80"):
        _on_cuda(llama2_70b(), block_indices=(78, 81))


def test_not_even_one_block_on_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not even one block fits"):
        _on_cuda(bloom_176b(), 3 * GIB)


def test_defaults_on_this_machine(caplog: pytest.LogCaptureFixture) -> None:
    """Without CUDA: float32, unquantised, every block; nothing asks the GPU."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    config = tiny_llama_config(num_hidden_layers=6)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        defaults = choose_defaults(_server_config(), config)
    assert (defaults.device, defaults.dtype, defaults.quant_type) == (CPU, torch.float32, "none")
    assert defaults.num_blocks == 6
    assert _messages(caplog) == [
        (logging.INFO, "device cpu: CUDA is not available"),
        (
            logging.INFO,
            "dtype float32: auto on cpu: without AMX, bfloat16 matmuls are slower there",
        ),
        (logging.INFO, "quant_type none: auto on cpu: quantised by default on CUDA only"),
        (
            logging.INFO,
            "attention cache of 32768 tokens per block: the default for grouped-query attention",
        ),
        (logging.INFO, "sessions of up to 8192 tokens: the default for grouped-query attention"),
        (
            logging.INFO,
            "6 blocks: all of the model's, on cpu (free memory is counted on CUDA only; "
            "--num_blocks serves fewer)",
        ),
    ]


@needs_cuda
def test_what_serving_holds_besides_blocks_is_measured_on_the_gpu_and_freed() -> None:
    """One TinyLlama block, a 2048-token prefill, and decode graphs captured up to 2048
    positions: something (workspaces, the graphs' pool), less than a few GiB, and what stays
    held afterwards (compiled kernels, the matmul library's workspace) is part of it."""
    free_before, _ = torch.cuda.mem_get_info(CUDA)
    overhead = measure_overhead(
        tinyllama_1b_config(),
        device=CUDA,
        dtype=torch.bfloat16,
        quant_type="none",
        max_batch_tokens=2048,
        decode_graphs=DecodeGraphsConfig(ahead_max_length=2048),
    )
    assert 0 < overhead < 4 * GIB
    free_after, _ = torch.cuda.mem_get_info(CUDA)
    assert free_before - free_after <= overhead
