"""Block benchmark: our blocks against transformers' layers, same process, CPU.

For each family (LLaMA, BLOOM, Falcon, Mixtral), shape (a tiny config and SmolLM2-135M's block for
LLaMA; a tiny config and BLOOM-560m's block for BLOOM; for Falcon a tiny config of the new decoder
architecture and a hidden-size-1024 block of Falcon-7B's layout; for Mixtral a tiny config and a
hidden-size-512 block with 8 experts, top 2) and dtype (fp32, bf16) it times one decode step after a
128-token prefill, and a 128-token prefill, through one block.  transformers runs a one-layer model
(its layer plus the rotary / ALiBi and mask set-up that a layer needs) with its default attention
and a ``DynamicCache`` (created per prefill: it grows as it goes); ours runs the block with its
``KVCache``, allocated once per session as a server does and rolled back between runs.  Both in
``torch.inference_mode()`` with one thread.  Target: ours / transformers <= 1.0.

Our fp32 decode steps run, as a server runs them by default, on the CPU decode backend
(:class:`petals_core.models.CpuDecode`: numpy, without torch's per-op dispatch); the decode step is
also timed on the blocks' torch path (``--cpu_decode torch``: torch's ops and matmul, as
transformers uses), in rounds that alternate the three, and through a whole server span
(SmolLM2's 10 blocks, 140 MB of weights streaming from memory each step) for ours each way and
for transformers.

Run with ``nox -s bench -- blocks``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import (
    BloomModel,
    DynamicCache,
    FalconModel,
    LlamaConfig,
    LlamaModel,
    MixtralModel,
)

from petals_core.models import BloomBlock, FalconBlock, LlamaBlock, MixtralBlock
from petals_core.models.mixtral import state_from_transformers
from petals_core.testing import (
    bloom_560m_config,
    smollm2_135m_config,
    tiny_bloom_config,
    tiny_falcon_config,
    tiny_llama_config,
    tiny_mixtral_config,
)

from ._report import print_table, summarize, write_json
from ._server_steps import server_steps

PREFILL = 128
DECODE_STEPS = 32
#: A LLaMA config's settings for a one-layer model around one block (its embeddings are unused).
ONE_BLOCK = {"num_hidden_layers": 1, "vocab_size": 16}


def _time(step: Callable[[], object], repeats: int) -> float:
    """Median seconds per call (after one warm-up)."""
    step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


SPAN_BLOCKS = 10
ROUNDS = 4


def _alternating(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms per call of each of ``steps``, timed in ROUNDS rounds that take turns."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            samples[name].append(_time(step, max(1, repeats // ROUNDS)))
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def _measure_span(config: LlamaConfig) -> dict[str, float]:
    """A decode step through SPAN_BLOCKS fp32 blocks in a row (a server's span), in rounds that
    alternate ours (numpy and OpenBLAS), ours (torch only) and transformers' layers."""
    config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": SPAN_BLOCKS})
    hf = LlamaModel(config).eval()
    hf.norm = nn.Identity()
    blocks = [LlamaBlock(config, index).eval() for index in range(SPAN_BLOCKS)]
    for block, layer in zip(blocks, hf.layers, strict=True):
        block.load_state_dict(layer.state_dict())
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, PREFILL, config.hidden_size, generator=generator)
    token = torch.randn(1, 1, config.hidden_size, generator=generator)
    with torch.inference_mode():
        hf_cache = DynamicCache(config=config)
        hf(inputs_embeds=prompt, cache=hf_cache, use_cache=True)
        caches = [block.allocate_cache(1, PREFILL + 1) for block in blocks]
        x = prompt
        for block, cache in zip(blocks, caches, strict=True):
            x = block(x, cache=cache)
        server = server_steps(blocks)

        def ours() -> object:
            y = server(0, SPAN_BLOCKS, [token], [caches])
            for cache in caches:
                cache.rollback(PREFILL)
            return y

        def ours_torch_only() -> object:
            y = token
            for block, cache in zip(blocks, caches, strict=True):
                y = block(y, cache=cache)
                cache.rollback(PREFILL)
            return y

        def theirs() -> object:
            out = hf(inputs_embeds=token, cache=hf_cache, use_cache=True)
            hf_cache.crop(-1)
            return out

        return _alternating(
            {"ours": ours, "ours_torch_only": ours_torch_only, "hf": theirs}, DECODE_STEPS
        )


#: Per family: transformers' base model, our block, the model's norms around its layers
#: (replaced by identities: the model is one layer, compared with one block), where its layers are,
#: and how a layer's state dict becomes a block's.
_FAMILIES: dict[str, tuple[type[nn.Module], type[nn.Module], tuple[str, ...], str, Any]] = {
    "llama": (LlamaModel, LlamaBlock, ("norm",), "layers", dict),
    "bloom": (BloomModel, BloomBlock, ("word_embeddings_layernorm", "ln_f"), "h", dict),
    "falcon": (FalconModel, FalconBlock, ("ln_f",), "h", dict),
    "mixtral": (MixtralModel, MixtralBlock, ("norm",), "layers", state_from_transformers),
}


def _pair(config: Any, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """transformers' one-layer model of ``config`` and our block with its layer's weights."""
    model_class, block_class, norms, layers, convert = _FAMILIES[config.model_type]
    hf = model_class(config).eval().to(dtype)
    for norm in norms:
        setattr(hf, norm, nn.Identity())
    ours = block_class(config).eval().to(dtype)
    ours.load_state_dict(convert(getattr(hf, layers)[0].state_dict()))
    return hf, ours


def _measure(hf: nn.Module, ours: Any, hidden: int, dtype: torch.dtype) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randn(1, PREFILL, hidden, generator=generator).to(dtype)
    token = torch.randn(1, 1, hidden, generator=generator).to(dtype)
    config = hf.config
    with torch.inference_mode():

        def hf_prefill() -> object:
            return hf(inputs_embeds=prompt, cache=DynamicCache(config=config), use_cache=True)

        # Our cache is allocated once per session (when the server admits it), so a prefill
        # reuses one: rolled back to empty each time.
        prefill_cache = ours.allocate_cache(1, PREFILL)

        def ours_prefill() -> object:
            prefill_cache.rollback(0)
            return ours(prompt, cache=prefill_cache)

        hf_cache = DynamicCache(config=config)
        hf(inputs_embeds=prompt, cache=hf_cache, use_cache=True)
        cache = ours.allocate_cache(1, PREFILL + 4 * DECODE_STEPS)
        ours(prompt, cache=cache)

        def hf_decode() -> object:
            out = hf(inputs_embeds=token, cache=hf_cache, use_cache=True)
            hf_cache.crop(-1)  # every step decodes position PREFILL, like ours below
            return out

        server = server_steps([ours])

        def ours_decode() -> object:
            out = server(0, 1, [token], [[cache]])
            cache.rollback(PREFILL)
            return out

        def ours_torch_only_decode() -> object:
            out = ours(token, cache=cache)
            cache.rollback(PREFILL)
            return out

        decode = _alternating(
            {"ours": ours_decode, "ours_torch_only": ours_torch_only_decode, "hf": hf_decode},
            DECODE_STEPS,
        )
        return {
            "decode_ours_ms": decode["ours"],
            "decode_ours_torch_only_ms": decode["ours_torch_only"],
            "decode_hf_ms": decode["hf"],
            "prefill_ours_ms": _time(ours_prefill, 5) * 1e3,
            "prefill_hf_ms": _time(hf_prefill, 5) * 1e3,
        }


def _shapes() -> list[tuple[str, Callable[[torch.dtype], tuple[nn.Module, nn.Module]], int]]:
    tiny_llama = tiny_llama_config(**ONE_BLOCK)
    smollm2 = smollm2_135m_config(**ONE_BLOCK)
    tiny_bloom = tiny_bloom_config(n_layer=1, vocab_size=16)
    bloom_560m = bloom_560m_config(n_layer=1, vocab_size=16)
    tiny_falcon = tiny_falcon_config(**ONE_BLOCK)
    falcon_7b_layout = tiny_falcon_config(
        **ONE_BLOCK,
        hidden_size=1024,
        num_attention_heads=16,
        new_decoder_architecture=False,
        multi_query=True,
    )
    tiny_mixtral = tiny_mixtral_config(**ONE_BLOCK)
    mixtral_512 = tiny_mixtral_config(
        **ONE_BLOCK,
        hidden_size=512,
        intermediate_size=1792,
        num_attention_heads=8,
        num_key_value_heads=2,
    )
    return [
        ("llama tiny (64)", lambda dtype: _pair(tiny_llama, dtype), 64),
        ("llama SmolLM2-135M (576)", lambda dtype: _pair(smollm2, dtype), 576),
        ("bloom tiny (64)", lambda dtype: _pair(tiny_bloom, dtype), 64),
        ("bloom-560m (1024)", lambda dtype: _pair(bloom_560m, dtype), 1024),
        ("falcon tiny (64)", lambda dtype: _pair(tiny_falcon, dtype), 64),
        ("falcon 7B layout (1024)", lambda dtype: _pair(falcon_7b_layout, dtype), 1024),
        ("mixtral tiny (64)", lambda dtype: _pair(tiny_mixtral, dtype), 64),
        ("mixtral 8 experts (512)", lambda dtype: _pair(mixtral_512, dtype), 512),
    ]


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    results: dict[str, Any] = {}
    for name, make, hidden in _shapes():
        for dtype in (torch.float32, torch.bfloat16):
            hf, ours = make(dtype)
            numbers = _measure(hf, ours, hidden, dtype)
            label = f"{name} {str(dtype).removeprefix('torch.')}"
            results[label] = numbers
            for what in ("decode", "prefill"):
                ours_ms, hf_ms = numbers[f"{what}_ours_ms"], numbers[f"{what}_hf_ms"]
                step = "decode step" if what == "decode" else f"{PREFILL}-token prefill"
                torch_only = numbers.get(f"{what}_ours_torch_only_ms", "-")
                rows.append(
                    (label, step, ours_ms, torch_only, hf_ms, f"{ours_ms / hf_ms:.2f}x", "<= 1.0")
                )
    span = _measure_span(smollm2_135m_config(**ONE_BLOCK))
    results["llama SmolLM2-135M (576) float32, 10-block span"] = span
    rows.append(
        (
            "llama SmolLM2-135M (576) float32",
            f"decode step, {SPAN_BLOCKS} blocks",
            span["ours"],
            span["ours_torch_only"],
            span["hf"],
            f"{span['ours'] / span['hf']:.2f}x",
            "<= 1.0",
        )
    )
    print_table(
        "blocks: ours vs transformers' layers, CPU, 1 thread (ms, median)",
        [
            "shape / dtype",
            "work",
            "ours",
            "ours, torch only",
            "transformers",
            "ours/transformers",
            "target",
        ],
        rows,
    )
    for label, what in (
        ("llama SmolLM2-135M (576) float32", "decode"),
        ("llama SmolLM2-135M (576) float32", "prefill"),
        ("bloom-560m (1024) float32", "decode"),
        ("falcon 7B layout (1024) float32", "decode"),
        ("falcon 7B layout (1024) float32", "prefill"),
        ("mixtral 8 experts (512) float32", "decode"),
        ("mixtral 8 experts (512) float32", "prefill"),
    ):
        headline = results.get(label)
        if headline is None:
            continue
        ours_ms, hf_ms = headline[f"{what}_ours_ms"], headline[f"{what}_hf_ms"]
        step = "decode step" if what == "decode" else f"{PREFILL}-token prefill"
        summarize(
            "blocks",
            f"{label}, {step}, ours vs transformers",
            ours_ms,
            hf_ms,
            target="<= 1.0x",
            met=ours_ms <= hf_ms,
        )
    summarize(
        "blocks",
        f"SmolLM2 fp32, decode step through {SPAN_BLOCKS} blocks, ours vs transformers",
        span["ours"],
        span["hf"],
        target="<= 1.0x",
        met=span["ours"] <= span["hf"],
    )
    write_json("blocks", results)
