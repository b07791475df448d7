"""Triton kernels on a CUDA GPU: parity with the torch references, then decode-attention speed.

Parity: every kernel (decode and prefill attention, RMSNorm, rotary, fused rotary + cache append)
against its reference on the same CUDA tensors.  Speed: one decode step (T=1) of LLaMA-like GQA
attention (32 heads, 8 kv heads, head_dim 128, bf16) over cache prefix views of 1k, 4k and 16k
positions, batch 1 and 8, as achieved GB/s of K/V read, next to the card's peak memory bandwidth
and to ``torch.nn.functional.scaled_dot_product_attention`` on the same views.  Takes about a
minute on an H100/H200, most of it compiling.

Run from the repository root with ``python -m bench.kernels_cuda`` (or ``python
bench/kernels_cuda.py``); writes ``bench/results/kernels_cuda.json``.  Exits non-zero if a
parity check fails.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from bench._report import print_table, write_json
from petals_core.kernels import _dispatch
from petals_core.kernels._reference import (
    alibi_slopes,
    attention_reference,
    rms_norm_reference,
    rotary_append_reference,
    rotary_reference,
)

N_HEAD, N_KV_HEAD, HEAD_DIM = 32, 8, 128
LENGTHS = (1024, 4096, 16384)
BATCHES = (1, 8)
# Known peaks (bytes/s) for cards whose properties do not report their memory clock.
_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_cuda needs a CUDA GPU: torch.cuda.is_available() is False")
    torch.manual_seed(0)
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    peak = _peak_bandwidth(properties)
    print(f"{properties.name}: {properties.multi_processor_count} SMs, peak memory bandwidth "
          f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}")  # fmt: skip

    parity = _parity(device)
    print_table(
        "parity with the torch references (CUDA)",
        ["kernel", "case", "dtype", "max abs err", "allowed", "ok"],
        [[p["kernel"], p["case"], p["dtype"], p["max_abs_err"], p["allowed"], p["ok"]]
         for p in parity],
    )  # fmt: skip

    speed = [_decode_speed(device, batch, length, peak) for batch in BATCHES for length in LENGTHS]
    print_table(
        f"decode attention, T=1, {N_HEAD}/{N_KV_HEAD} heads, head_dim {HEAD_DIM}, bf16",
        ["B", "S", "K/V MB", "triton us", "triton GB/s", "% of peak", "sdpa us", "sdpa GB/s",
         "speedup"],
        [[s["batch"], s["length"], s["kv_bytes"] / 1e6, s["triton_us"], s["triton_gbps"],
          s["triton_peak_fraction"] and 100 * s["triton_peak_fraction"], s["sdpa_us"],
          s["sdpa_gbps"], s["sdpa_us"] / s["triton_us"]]
         for s in speed],
    )  # fmt: skip
    write_json(
        "kernels_cuda",
        {
            "device": {
                "name": properties.name,
                "multiprocessors": properties.multi_processor_count,
                "peak_bandwidth_gbps": None if peak is None else peak / 1e9,
                "torch": torch.__version__,
                "triton": triton.__version__,
            },
            "parity": parity,
            "decode_attention": speed,
        },
    )
    failed = [p for p in parity if not p["ok"]]
    if failed:
        raise SystemExit(f"{len(failed)} parity checks failed")


def _peak_bandwidth(properties: Any) -> float | None:
    clock_khz = getattr(properties, "memory_clock_rate", 0)
    bus_bits = getattr(properties, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate
    return next((bw for name, bw in _PEAK_BANDWIDTH.items() if name in properties.name), None)


def _check(
    kernel: str, case: str, actual: torch.Tensor, expected: torch.Tensor, allowed: float
) -> dict[str, Any]:
    error = (actual.float() - expected.float()).abs().max().item()
    return {
        "kernel": kernel,
        "case": case,
        "dtype": str(expected.dtype).removeprefix("torch."),
        "max_abs_err": error,
        "allowed": allowed,
        "ok": bool(error <= allowed) and actual.dtype == expected.dtype,
    }


def _step(expected: torch.Tensor) -> float:
    """One rounding step of the largest value: what one rounding apart can differ by."""
    return torch.finfo(expected.dtype).eps * expected.abs().max().item()


def _attention_allowed(dtype: torch.dtype, expected: torch.Tensor, v: torch.Tensor) -> float:
    """fp32: summation order only.  fp16/bf16: the probabilities enter the P @ V dot rounded to the
    input dtype (half a step each), so the output may move by up to eps * max|v|, plus one
    rounding step of the output itself."""
    if dtype == torch.float32:
        return 5e-5
    return torch.finfo(dtype).eps * v.abs().max().item() + _step(expected)


def _cache_views(
    batch: int, length: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v as a KVCache hands them to attention: prefix views of a longer preallocated cache."""
    shape = (batch, N_KV_HEAD, length + 64, HEAD_DIM)
    keys = torch.randn(shape, device=device).to(dtype)
    values = torch.randn(shape, device=device).to(dtype)
    return keys[:, :, :length], values[:, :, :length]


def _parity(device: torch.device) -> list[dict[str, Any]]:
    results = []
    slopes = alibi_slopes(N_HEAD).to(device)
    attention_cases = [  # (dtype, T, query_offset, alibi); S = 1000 keys, not a tile multiple
        (torch.bfloat16, 1, 999, False),
        (torch.bfloat16, 4, 990, True),
        (torch.float16, 1, 999, False),
        (torch.float32, 1, 999, False),
        (torch.bfloat16, 300, 700, False),
        (torch.bfloat16, 1000, 0, True),
        (torch.float16, 300, 600, False),
        (torch.float32, 300, 700, False),
    ]
    for dtype, new_tokens, query_offset, alibi in attention_cases:
        k, v = _cache_views(2, 1000, dtype, device)
        q = torch.randn(2, new_tokens, N_HEAD, HEAD_DIM, device=device).to(dtype).transpose(1, 2)
        kwargs: dict[str, Any] = {
            "query_offset": query_offset,
            "alibi_slopes": slopes if alibi else None,
        }
        expected = attention_reference(q, k, v, **kwargs)
        actual = _dispatch.attention(q, k, v, **kwargs)
        kernel = "decode attention" if new_tokens <= 16 else "prefill attention"
        case = f"T={new_tokens} offset={query_offset}{' alibi' if alibi else ''}"
        allowed = _attention_allowed(dtype, expected, v)
        results.append(_check(kernel, case, actual, expected, allowed))

    for dtype, hidden in [(torch.bfloat16, 4096), (torch.bfloat16, 11008), (torch.float32, 8192)]:
        x = torch.randn(64, hidden, device=device).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
        expected = rms_norm_reference(x, weight, 1e-6)
        # Two roundings in 16-bit (the normalized row, then the product), a step each.
        allowed = 1e-5 if dtype == torch.float32 else 2 * _step(expected)
        actual = _dispatch.rms_norm(x, weight, 1e-6)
        results.append(_check("rms_norm", f"64 x {hidden}", actual, expected, allowed))

    for dtype in (torch.bfloat16, torch.float32):
        for new_tokens in (1, 300):
            results.extend(_rotary_parity(device, dtype, new_tokens))
    return results


def _rotary_parity(
    device: torch.device, dtype: torch.dtype, new_tokens: int
) -> list[dict[str, Any]]:
    positions = 700 + torch.arange(new_tokens, device=device, dtype=torch.float32)
    inv_freq = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
    angles = positions[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[None]  # (1, T, head_dim)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(2, new_tokens, N_HEAD, HEAD_DIM, device=device).to(dtype).transpose(1, 2)
    k = torch.randn(2, N_KV_HEAD, new_tokens, HEAD_DIM, device=device).to(dtype)
    v = torch.randn_like(k)

    # The kernel rounds once from fp32; the reference in 16-bit rounds three times (like
    # transformers), so compare with the reference evaluated in fp32: one step apart.
    expected_q = rotary_reference(q.float(), cos.float(), sin.float()).to(dtype)
    allowed = 1e-5 if dtype == torch.float32 else _step(expected_q)
    case = f"T={new_tokens}"
    results = [_check("rotary", case, _dispatch.rotary(q, cos, sin), expected_q, allowed)]

    keys = torch.zeros(2, N_KV_HEAD, 1100, HEAD_DIM, device=device, dtype=dtype)
    values = torch.zeros_like(keys)
    expected_keys, expected_values = keys.clone(), values.clone()
    rotary_append_reference(
        q.float(), k.float(), v, cos.float(), sin.float(),
        keys=expected_keys, values=expected_values, start=700,
    )  # fmt: skip
    actual_q = _dispatch.rotary_append(q, k, v, cos, sin, keys=keys, values=values, start=700)
    results.append(_check("rotary_append", f"{case} q", actual_q, expected_q, allowed))
    results.append(_check("rotary_append", f"{case} cache keys", keys, expected_keys, allowed))
    results.append(_check("rotary_append", f"{case} cache values", values, expected_values, 0.0))
    return results


def _decode_speed(
    device: torch.device, batch: int, length: int, peak: float | None
) -> dict[str, Any]:
    dtype = torch.bfloat16
    k, v = _cache_views(batch, length, dtype, device)
    q = torch.randn(batch, N_HEAD, 1, HEAD_DIM, device=device, dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()

    def ours() -> torch.Tensor:
        return _dispatch.attention(q, k, v, query_offset=length - 1)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # T=1 sees every key

    # do_bench flushes L2 between runs, so small caches are read from memory too.
    triton_ms = do_bench(ours, warmup=25, rep=100, return_mode="median")
    sdpa_ms = do_bench(sdpa, warmup=25, rep=100, return_mode="median")
    triton_gbps = kv_bytes / (triton_ms * 1e-3) / 1e9
    return {
        "batch": batch,
        "length": length,
        "kv_bytes": kv_bytes,
        "triton_us": triton_ms * 1e3,
        "triton_gbps": triton_gbps,
        "triton_peak_fraction": None if peak is None else triton_gbps * 1e9 / peak,
        "sdpa_us": sdpa_ms * 1e3,
        "sdpa_gbps": kv_bytes / (sdpa_ms * 1e-3) / 1e9,
    }


if __name__ == "__main__":
    main()
