"""Block benchmark: our blocks against transformers' layers, same process, CPU.

For each family (LLaMA, BLOOM), shape (a tiny config and SmolLM2-135M's block for LLaMA; a tiny
config and BLOOM-560m's block for BLOOM) and dtype (fp32, bf16) it times one decode step after a
128-token prefill, and a 128-token prefill, through one block.  transformers runs a one-layer model
(its layer plus the rotary / ALiBi and mask set-up that a layer needs) with its default attention
and a ``DynamicCache`` (created per prefill: it grows as it goes); ours runs the block with its
``KVCache``, allocated once per session as a server does and rolled back between runs.  Both in
``torch.inference_mode()`` with one thread.  Target: ours / transformers <= 1.0.

Run with ``nox -s bench -- blocks``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import BloomConfig, BloomModel, DynamicCache, LlamaConfig, LlamaModel

from petals_core.models.bloom import BloomBlock
from petals_core.models.llama import LlamaBlock

from ._report import print_table, summarize, write_json

PREFILL = 128
DECODE_STEPS = 32


def _time(step: Callable[[], object], repeats: int) -> float:
    """Median seconds per call (after one warm-up)."""
    step()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _llama_pair(config: LlamaConfig, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    hf = LlamaModel(config).eval().to(dtype)
    hf.norm = nn.Identity()
    ours = LlamaBlock(config).eval().to(dtype)
    ours.load_state_dict(hf.layers[0].state_dict())
    return hf, ours


def _bloom_pair(config: BloomConfig, dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    hf = BloomModel(config).eval().to(dtype)
    hf.word_embeddings_layernorm = nn.Identity()
    hf.ln_f = nn.Identity()
    ours = BloomBlock(config).eval().to(dtype)
    ours.load_state_dict(hf.h[0].state_dict())
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

        def ours_decode() -> object:
            out = ours(token, cache=cache)
            cache.rollback(PREFILL)
            return out

        return {
            "decode_ours_ms": _time(ours_decode, DECODE_STEPS) * 1e3,
            "decode_hf_ms": _time(hf_decode, DECODE_STEPS) * 1e3,
            "prefill_ours_ms": _time(ours_prefill, 5) * 1e3,
            "prefill_hf_ms": _time(hf_prefill, 5) * 1e3,
        }


def _shapes() -> list[tuple[str, Callable[[torch.dtype], tuple[nn.Module, nn.Module]], int]]:
    tiny_llama = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=1,
        vocab_size=16,
    )
    smollm2 = LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        num_hidden_layers=1,
        vocab_size=16,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )
    tiny_bloom = BloomConfig(hidden_size=64, n_head=4, n_layer=1, vocab_size=16)
    bloom_560m = BloomConfig(hidden_size=1024, n_head=16, n_layer=1, vocab_size=16)
    return [
        ("llama tiny (64)", lambda dtype: _llama_pair(tiny_llama, dtype), 64),
        ("llama SmolLM2-135M (576)", lambda dtype: _llama_pair(smollm2, dtype), 576),
        ("bloom tiny (64)", lambda dtype: _bloom_pair(tiny_bloom, dtype), 64),
        ("bloom-560m (1024)", lambda dtype: _bloom_pair(bloom_560m, dtype), 1024),
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
                rows.append((label, step, ours_ms, hf_ms, f"{ours_ms / hf_ms:.2f}x", "<= 1.0"))
    print_table(
        "blocks: one block, ours vs transformers' layer, CPU, 1 thread (ms, median)",
        ["shape / dtype", "work", "ours", "transformers", "ours/transformers", "target"],
        rows,
    )
    for label, what in (
        ("llama SmolLM2-135M (576) float32", "decode"),
        ("llama SmolLM2-135M (576) float32", "prefill"),
        ("bloom-560m (1024) float32", "decode"),
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
    write_json("blocks", results)
