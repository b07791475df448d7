"""Triton kernels on a CUDA GPU: parity with the torch references, then attention speed.

Parity: every kernel (decode and prefill attention, RMSNorm, rotary, fused rotary + cache append,
the row-table append and decode attention) against its reference on the same CUDA tensors.  Each
row names the path that ran: what the dispatch chose for the case, then each path it may take
forced once (the Triton kernel where the dispatch may launch it, torch's SDPA where it may take
that), so that a case the dispatch sends to SDPA still checks the Triton kernel.  Without a GPU
(``measure`` on a CPU device, the ``--dry-run`` of ``bench gpu``) the parity runs small shapes,
the kernels through Triton's interpreter, and nothing is timed.

Speed: one decode step (T=1) of LLaMA-like GQA attention (32 heads, 8 kv heads, head_dim 128,
bf16) over cache prefix views of 1k, 4k and 16k positions, batch 1 and 8, four ways: the
dispatched attention eagerly (launch included; the dispatch's choice is shown), torch's SDPA
eagerly, and both replayed from a CUDA graph (the row-table kernel, which is what decode graphs
run, and SDPA).  GB/s of K/V read are set against the card's peak memory bandwidth.  Then the
row-table kernel at other split counts and tiles, and prefill attention (Triton against SDPA,
with the dispatch's choice).  Takes about a minute on an H100/H200, most of it compiling.

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

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
import triton

from bench._report import print_table, write_json
from petals_core import kernels
from petals_core.kernels import _dispatch, _triton_attention, _triton_norm, _triton_rotary
from petals_core.kernels._limits import attention_kernel
from petals_core.kernels._reference import (
    alibi_slopes,
    attention_reference,
    rms_norm_reference,
    rotary_append_reference,
    rotary_reference,
    rows_append_reference,
    rows_attention_reference,
)

N_HEAD, N_KV_HEAD, HEAD_DIM = 32, 8, 128
LENGTHS = (1024, 4096, 16384)
BATCHES = (1, 8)
# Known peaks (bytes/s) for cards whose properties do not report their memory clock.
_PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


@attrs.frozen(kw_only=True)
class ParityShapes:
    """The attention shape of the parity cases and the keys they attend to."""

    n_head: int
    n_kv_head: int
    head_dim: int
    length: int
    #: New tokens of the prefill cases.
    prefill: int


GPU_PARITY = ParityShapes(
    n_head=N_HEAD, n_kv_head=N_KV_HEAD, head_dim=HEAD_DIM, length=1000, prefill=300
)
#: Small enough for Triton's interpreter.
CPU_PARITY = ParityShapes(n_head=4, n_kv_head=2, head_dim=32, length=100, prefill=40)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_cuda needs a CUDA GPU: torch.cuda.is_available() is False")
    results = measure(torch.device("cuda"))
    write_json("kernels_cuda", results)
    failed = [p for p in results["parity"] if not p["ok"]]
    if failed:
        raise SystemExit(f"{len(failed)} parity checks failed")


def measure(
    device: torch.device, *, record: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Parity, then speed (on CUDA); prints the tables and returns what ``main`` writes as
    JSON, handing each part to ``record`` as soon as it is measured."""
    torch.manual_seed(0)
    record = record or (lambda part: None)
    if device.type != "cuda":
        parity = _parity(device, CPU_PARITY) + _rows_parity(device, CPU_PARITY)
        _print_parity(parity, device)
        results = {"device": {"name": "cpu (dry run: nothing timed)"}, "parity": parity}
        record(results)
        return results
    properties = torch.cuda.get_device_properties(device)
    peak = _peak_bandwidth(properties)
    print(f"{properties.name}: {properties.multi_processor_count} SMs, peak memory bandwidth "
          f"{'unknown' if peak is None else f'{peak / 1e9:.0f} GB/s'}")  # fmt: skip

    parity = _parity(device, GPU_PARITY) + _rows_parity(device, GPU_PARITY)
    _print_parity(parity, device)
    record({"parity": parity})

    speed = []
    for batch in BATCHES:
        for length in LENGTHS:
            speed.append(_decode_speed(device, batch, length, peak))
            record({"decode_attention": speed})
    print_table(
        f"decode attention, T=1, {N_HEAD}/{N_KV_HEAD} heads, head_dim {HEAD_DIM}, bf16, us per "
        "call: eager (launch included) and replayed from a CUDA graph",
        ["B", "S", "K/V MB", "dispatch", "eager ours", "eager sdpa", "graph rows",
         "graph sdpa", "rows GB/s", "% of peak", "rows / sdpa"],
        [[s["batch"], s["length"], s["kv_bytes"] / 1e6, s["dispatch"], s["eager_us"],
          s["eager_sdpa_us"], s["graph_rows_us"], s["graph_sdpa_us"], s["graph_rows_gbps"],
          s["graph_rows_peak_fraction"] and 100 * s["graph_rows_peak_fraction"],
          s["graph_sdpa_us"] / s["graph_rows_us"]]
         for s in speed],
    )  # fmt: skip
    tiles = [_rows_tiles(device, batch, 16384, peak) for batch in BATCHES]
    record({"rows_tiles": [t for rows in tiles for t in rows]})
    print_table(
        "row-table decode attention, S=16384, graph-replayed: splits x tile sizes",
        ["B", "splits", "block_n", "us", "GB/s", "% of peak"],
        [[t["batch"], t["num_splits"], t["block_n"], t["us"], t["gbps"],
          t["peak_fraction"] and 100 * t["peak_fraction"]]
         for rows in tiles for t in rows],
    )  # fmt: skip
    prefill = [_prefill_speed(device, *case) for case in PREFILL_CASES]
    print_table(
        f"prefill attention, B=1, {N_HEAD}/{N_KV_HEAD} heads, bf16, us per call (eager)",
        ["T", "offset", "dispatch", "triton us", "sdpa us"],
        [[p["tokens"], p["offset"], p["dispatch"], p["triton_us"], p["sdpa_us"]]
         for p in prefill],
    )  # fmt: skip
    results = {
        "device": {
            "name": properties.name,
            "multiprocessors": properties.multi_processor_count,
            "peak_bandwidth_gbps": None if peak is None else peak / 1e9,
            "torch": torch.__version__,
            "triton": triton.__version__,
        },
        "parity": parity,
        "decode_attention": speed,
        "rows_tiles": [t for rows in tiles for t in rows],
        "prefill_attention": prefill,
        "dispatch_table": [
            {"key": [str(part) for part in c.key], "choice": c.choice, "seconds": c.seconds}
            for c in kernels.dispatch_table()
        ],
    }
    record(results)
    return results


def _print_parity(parity: list[dict[str, Any]], device: torch.device) -> None:
    print_table(
        f"parity with the torch references ({device.type}): each row names the path that ran",
        ["kernel", "case", "dtype", "path", "max abs err", "allowed", "ok"],
        [[p["kernel"], p["case"], p["dtype"], p["path"], p["max_abs_err"], p["allowed"], p["ok"]]
         for p in parity],
    )  # fmt: skip


def _peak_bandwidth(properties: Any) -> float | None:
    clock_khz = getattr(properties, "memory_clock_rate", 0)
    bus_bits = getattr(properties, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate
    return next((bw for name, bw in _PEAK_BANDWIDTH.items() if name in properties.name), None)


def _check(
    kernel: str,
    case: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    allowed: float,
    *,
    path: str,
) -> dict[str, Any]:
    error = (actual.float() - expected.float()).abs().max().item()
    return {
        "kernel": kernel,
        "case": case,
        "path": path,
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
    batch: int,
    length: int,
    dtype: torch.dtype,
    device: torch.device,
    shapes: ParityShapes = GPU_PARITY,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v as a KVCache hands them to attention: prefix views of a longer preallocated cache."""
    shape = (batch, shapes.n_kv_head, length + 64, shapes.head_dim)
    keys = torch.randn(shape, device=device).to(dtype)
    values = torch.randn(shape, device=device).to(dtype)
    return keys[:, :, :length], values[:, :, :length]


def _dispatched_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_offset: int, alibi: bool
) -> str:
    """The path :func:`_dispatch.attention` took for a call it has made (without padding or a
    key bias): a Triton kernel, torch's SDPA, or the reference."""
    kernel = _dispatch.triton_attention_path(q, k, v, alibi=alibi)
    if kernel is None:
        if not alibi:
            return "sdpa"
        fp32_decode = q.dtype == torch.float32 and q.shape[2] == 1
        return "sdpa, ALiBi as a mask" if fp32_decode else "reference"
    if alibi:
        return f"triton {kernel}"
    key = _dispatch._attention_key(q, k, query_offset)
    choice = next((c.choice for c in kernels.dispatch_table() if c.key == key), None)
    return f"triton {kernel}" if choice == "triton" else "sdpa (measured faster)"


def _parity(device: torch.device, shapes: ParityShapes) -> list[dict[str, Any]]:
    results = []
    slopes = alibi_slopes(shapes.n_head).to(device)
    keys, prefill = shapes.length, shapes.prefill
    attention_cases = [  # (dtype, T, query_offset, alibi); S keys, not a tile multiple
        (torch.bfloat16, 1, keys - 1, False),
        (torch.bfloat16, 4, keys - 10, True),
        (torch.float16, 1, keys - 1, False),
        (torch.float32, 1, keys - 1, False),
        (torch.float32, 1, keys - 1, True),
        (torch.bfloat16, prefill, keys - prefill, False),
        (torch.bfloat16, keys, 0, True),
        (torch.float16, prefill, keys - 2 * prefill, True),
        (torch.float32, prefill, keys - prefill, False),
    ]
    group = shapes.n_head // shapes.n_kv_head
    for dtype, new_tokens, query_offset, alibi in attention_cases:
        k, v = _cache_views(2, keys, dtype, device, shapes)
        q = torch.randn(2, new_tokens, shapes.n_head, shapes.head_dim, device=device)
        q = q.to(dtype).transpose(1, 2)
        kwargs: dict[str, Any] = {
            "query_offset": query_offset,
            "alibi_slopes": slopes if alibi else None,
        }
        expected = attention_reference(q, k, v, **kwargs)
        allowed = _attention_allowed(dtype, expected, v)
        case = f"T={new_tokens} offset={query_offset}{' alibi' if alibi else ''}"
        actual = _dispatch.attention(q, k, v, **kwargs)
        path = _dispatched_path(q, k, v, query_offset, alibi)
        results.append(_check("attention", case, actual, expected, allowed, path=path))
        # Each path the dispatch may take for the case, forced once.
        kernel = attention_kernel(dtype=dtype, new_tokens=new_tokens, group=group, alibi=alibi)
        if kernel == "decode":
            forced = _triton_attention.decode_attention(q, k, v, **kwargs)
        elif kernel == "prefill":
            forced = _triton_attention.prefill_attention(q, k, v, **kwargs)
        if kernel is not None:
            results.append(
                _check(
                    "attention", case, forced, expected, allowed, path=f"triton {kernel}, forced"
                )
            )
        if not alibi:
            sdpa = _dispatch._sdpa_attention(q, k, v, query_offset=query_offset, scale=None)
            results.append(_check("attention", case, sdpa, expected, allowed, path="sdpa, forced"))

    for dtype, hidden in [(torch.bfloat16, 4096), (torch.bfloat16, 11008), (torch.float32, 8192)]:
        x = torch.randn(64, hidden, device=device).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
        expected = rms_norm_reference(x, weight, 1e-6)
        # Two roundings in 16-bit (the normalized row, then the product), a step each.
        allowed = 1e-5 if dtype == torch.float32 else 2 * _step(expected)
        case = f"64 x {hidden}"
        actual = _triton_norm.rms_norm(x, weight, 1e-6)
        results.append(_check("rms_norm", case, actual, expected, allowed, path="triton"))

    for dtype in (torch.bfloat16, torch.float32):
        for new_tokens in (1, prefill):
            results.extend(_rotary_parity(device, dtype, new_tokens, shapes))
    return results


def _rotary_parity(
    device: torch.device, dtype: torch.dtype, new_tokens: int, shapes: ParityShapes
) -> list[dict[str, Any]]:
    head_dim, start = shapes.head_dim, shapes.length - new_tokens
    positions = start + torch.arange(new_tokens, device=device, dtype=torch.float32)
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
    angles = positions[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[None]  # (1, T, head_dim)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = torch.randn(2, new_tokens, shapes.n_head, head_dim, device=device).to(dtype)
    q = q.transpose(1, 2)
    k = torch.randn(2, shapes.n_kv_head, new_tokens, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)

    # The kernel rounds once from fp32; the reference in 16-bit rounds three times (like
    # transformers), so compare with the reference evaluated in fp32: one step apart.
    expected_q = rotary_reference(q.float(), cos.float(), sin.float()).to(dtype)
    allowed = 1e-5 if dtype == torch.float32 else _step(expected_q)
    case = f"T={new_tokens}"
    actual = _triton_rotary.rotary(q, cos, sin)
    results = [_check("rotary", case, actual, expected_q, allowed, path="triton")]

    keys = torch.zeros(2, shapes.n_kv_head, shapes.length + 100, head_dim, device=device)
    keys = keys.to(dtype)
    values = torch.zeros_like(keys)
    expected_keys, expected_values = keys.clone(), values.clone()
    rotary_append_reference(
        q.float(), k.float(), v, cos.float(), sin.float(),
        keys=expected_keys, values=expected_values, start=start,
    )  # fmt: skip
    actual_q = _triton_rotary.rotary_append(
        q, k, v, cos, sin, keys=keys, values=values, start=start
    )
    for what, got, want, limit in (
        ("q", actual_q, expected_q, allowed),
        ("cache keys", keys, expected_keys, allowed),
        ("cache values", values, expected_values, 0.0),
    ):
        results.append(_check("rotary_append", f"{case} {what}", got, want, limit, path="triton"))
    return results


def _decode_speed(
    device: torch.device, batch: int, length: int, peak: float | None
) -> dict[str, Any]:
    dtype = torch.bfloat16
    k, v = _cache_views(batch, length, dtype, device)
    q = torch.randn(batch, N_HEAD, 1, HEAD_DIM, device=device, dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    tables = _tables(k, v, [length - 1] * batch)
    q_rows = q[:, :, 0]  # (B, n_head, head_dim)

    def ours() -> torch.Tensor:
        return _dispatch.attention(q, k, v, query_offset=length - 1)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # T=1 sees every key

    def rows() -> torch.Tensor:
        return kernels.rows_decode_attention(q_rows, N_KV_HEAD, tables, max_length=length)

    from triton.testing import do_bench

    ours()  # the dispatch times both candidates on this bucket's first call
    choice = next(
        (c.choice for c in kernels.dispatch_table() if c.key[5:8] == (batch, 1, length)), None
    )
    # do_bench flushes L2 between runs, so small caches are read from memory too.
    eager_ms = do_bench(ours, warmup=25, rep=100, return_mode="median")
    eager_sdpa_ms = do_bench(sdpa, warmup=25, rep=100, return_mode="median")
    graph_rows_ms = do_bench(_graphed(rows), warmup=25, rep=100, return_mode="median")
    graph_sdpa_ms = do_bench(_graphed(sdpa), warmup=25, rep=100, return_mode="median")
    rows_gbps = kv_bytes / (graph_rows_ms * 1e-3) / 1e9
    return {
        "batch": batch,
        "length": length,
        "kv_bytes": kv_bytes,
        "dispatch": choice,
        "eager_us": eager_ms * 1e3,
        "eager_sdpa_us": eager_sdpa_ms * 1e3,
        "graph_rows_us": graph_rows_ms * 1e3,
        "graph_sdpa_us": graph_sdpa_ms * 1e3,
        "graph_rows_gbps": rows_gbps,
        "graph_rows_peak_fraction": None if peak is None else rows_gbps * 1e9 / peak,
        "graph_sdpa_gbps": kv_bytes / (graph_sdpa_ms * 1e-3) / 1e9,
    }


def _graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _tables(k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> kernels.RowTables:
    """Row tables over the rows of batched cache views (row b of ``k`` is row b's cache)."""
    device = k.device
    row_bytes = k.stride(0) * k.element_size()
    return kernels.RowTables(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        head_strides=torch.full((k.shape[0],), k.stride(1), dtype=torch.int64, device=device),
        key_ptrs=torch.tensor(
            [k.data_ptr() + b * row_bytes for b in range(k.shape[0])], device=device
        ),
        value_ptrs=torch.tensor(
            [v.data_ptr() + b * row_bytes for b in range(v.shape[0])], device=device
        ),
    )


def _rows_tiles(
    device: torch.device, batch: int, length: int, peak: float | None
) -> list[dict[str, Any]]:
    """The row-table kernel at other split counts and tile sizes than its defaults."""
    from triton.testing import do_bench

    from petals_core.kernels import _triton_rows
    from petals_core.kernels._launch import Target

    dtype = torch.bfloat16
    k, v = _cache_views(batch, length, dtype, device)
    q = torch.randn(batch, N_HEAD, HEAD_DIM, device=device, dtype=dtype)
    kv_bytes = 2 * k.numel() * k.element_size()
    tables = _tables(k, v, [length - 1] * batch)
    default_splits = _triton_attention.default_splits(
        Target.of(device), batch * N_KV_HEAD, length, 64
    )
    results = []
    for factor in (1, 2, 4):
        for block_n in (32, 64, 128):
            splits = min(128, default_splits * factor)

            def rows(splits: int = splits, block_n: int = block_n) -> torch.Tensor:
                return _triton_rows.rows_decode_attention(
                    q, N_KV_HEAD, tables, max_length=length, block_n=block_n, num_splits=splits
                )

            try:
                ms = do_bench(_graphed(rows), warmup=10, rep=50, return_mode="median")
            except Exception as error:  # a tile that does not fit this card's shared memory
                results.append({"batch": batch, "num_splits": splits, "block_n": block_n,
                                "us": None, "gbps": None, "peak_fraction": None,
                                "error": repr(error)})  # fmt: skip
                continue
            gbps = kv_bytes / (ms * 1e-3) / 1e9
            fraction = None if peak is None else gbps * 1e9 / peak
            results.append({"batch": batch, "num_splits": splits, "block_n": block_n,
                            "us": ms * 1e3, "gbps": gbps, "peak_fraction": fraction})  # fmt: skip
    return results


#: (new tokens, query offset): a prompt from the start, a long one, and a chunk after a prefix.
PREFILL_CASES = ((128, 0), (2048, 0), (128, 1024))


def _prefill_speed(device: torch.device, tokens: int, offset: int) -> dict[str, Any]:
    """A prompt without ALiBi: the dispatch takes torch's SDPA; the Triton prefill kernel (which
    it launches only with ALiBi) beside it, forced, for the comparison."""
    from triton.testing import do_bench

    dtype = torch.bfloat16
    k, v = _cache_views(1, offset + tokens, dtype, device)
    q = torch.randn(1, tokens, N_HEAD, HEAD_DIM, device=device).to(dtype).transpose(1, 2)
    _dispatch.attention(q, k, v, query_offset=offset)
    path = _dispatched_path(q, k, v, offset, alibi=False)
    try:
        triton_us: float | None = 1e3 * do_bench(
            lambda: _triton_attention.prefill_attention(q, k, v, query_offset=offset),
            warmup=10, rep=50, return_mode="median",
        )  # fmt: skip
        error = None
    except Exception as failure:  # a variant no dispatch launches; its failure is reported
        triton_us, error = None, repr(failure)
    sdpa_ms = do_bench(
        lambda: _dispatch._sdpa_attention(q, k, v, query_offset=offset, scale=None),
        warmup=10, rep=50, return_mode="median",
    )  # fmt: skip
    return {
        "tokens": tokens,
        "offset": offset,
        "dispatch": path,
        "triton_us": triton_us,
        "triton_error": error,
        "sdpa_us": sdpa_ms * 1e3,
    }


def _rows_parity(device: torch.device, shapes: ParityShapes) -> list[dict[str, Any]]:
    """The row-table kernels against their references: rows of different caches and positions,
    in the dtypes decode graphs run them in on GPUs."""
    results = []
    heads, kv_heads, head_dim = shapes.n_head, shapes.n_kv_head, shapes.head_dim
    for dtype in kernels.CUDA_ATTENTION_DTYPES:
        lengths = (shapes.length, 37, 1)
        slots = shapes.length + 100
        keys = [torch.randn(kv_heads, slots, head_dim, device=device).to(dtype) for _ in lengths]
        values = [torch.randn_like(slab) for slab in keys]
        positions = [length - 1 for length in lengths]
        tables = kernels.RowTables(
            positions=torch.tensor(positions, device=device),
            head_strides=torch.tensor([s.stride(0) for s in keys], device=device),
            key_ptrs=torch.tensor([s.data_ptr() for s in keys], device=device),
            value_ptrs=torch.tensor([s.data_ptr() for s in values], device=device),
        )
        q = torch.randn(len(lengths), heads, head_dim, device=device).to(dtype)
        k = torch.randn(len(lengths), kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn_like(k)
        inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device) / head_dim)
        angles = torch.arange(slots, device=device, dtype=torch.float32)[:, None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        expected_keys = [slab.clone() for slab in keys]
        expected_values = [slab.clone() for slab in values]
        expected_q = rows_append_reference(
            q.float(), k.float(), v, keys=expected_keys, values=expected_values,
            positions=positions, cos=cos.float(), sin=sin.float(),
        )  # fmt: skip
        assert expected_q is not None
        expected_q = expected_q.to(dtype)
        actual_q = kernels.rows_append(q, k, v, tables, cos=cos, sin=sin)
        assert actual_q is not None
        allowed = _step(expected_q)
        results.append(
            _check("rows_append", "3 rows q", actual_q, expected_q, allowed, path="triton")
        )
        results.append(
            _check("rows_append", "3 rows keys", torch.stack(keys), torch.stack(expected_keys),
                   allowed, path="triton")
        )  # fmt: skip
        expected = rows_attention_reference(actual_q, keys=keys, values=values, positions=positions)
        actual = kernels.rows_decode_attention(
            actual_q, kv_heads, tables, max_length=bucket_length(shapes.length)
        )
        allowed = _attention_allowed(dtype, expected, torch.stack(values))
        case = f"lengths {'/'.join(map(str, lengths))}"
        results.append(
            _check("rows_decode_attention", case, actual, expected, allowed, path="triton")
        )
    return results


def bucket_length(length: int) -> int:
    return 1 << (length - 1).bit_length()


if __name__ == "__main__":
    main()
