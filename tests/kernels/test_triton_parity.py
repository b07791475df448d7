"""The Triton kernels against the torch references, run on CPU tensors by Triton's interpreter.

Small shapes and small tiles keep the interpreter quick while still covering ragged tiles, split
key ranges, GQA, ALiBi, cache offsets and strided (non-contiguous) inputs.

Tolerances: fp32 within 1e-5 (only the summation order differs).  For fp16/bf16 the kernels and
the references both compute in fp32 and round once to the output dtype, so results are at most one
rounding step (``finfo.eps`` relative) apart -- also under the interpreter, whose fp32 -> bf16
casts truncate where CUDA rounds to nearest.  The 1e-5 absolute floor covers outputs near zero,
where the fp32 summation-order difference is larger than a relative step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Triton chooses between compiling and interpreting once per process: its own helpers (tl.max,
# tl.sum, ...) are @triton.jit functions decorated when triton is first imported, and an
# interpreted kernel cannot call compiled ones.  So the variable goes in before any triton import.
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError(
        "triton was imported before these tests could select its interpreter; "
        "run them with TRITON_INTERPRET=1 or in a process that has not imported triton"
    )
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from petals_core.kernels import (
    _triton_attention as triton_attention,
    _triton_norm as triton_norm,
    _triton_rotary as triton_rotary,
)
from petals_core.kernels._reference import (
    alibi_slopes,
    attention_reference,
    rms_norm_reference,
    rotary_append_reference,
    rotary_reference,
)

from ._parity import assert_parity

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _attention_inputs(
    dtype: torch.dtype, *, n_kv_head: int, new_tokens: int, length: int = 70
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (2, 4, T, 32) transposed from (B, T, heads, D); k, v prefix views of a 96-position cache
    whose unused tail is NaN, so reading past the view would show."""
    generator = torch.Generator().manual_seed(new_tokens * 10 + n_kv_head)
    q = torch.randn(2, new_tokens, 4, 32, generator=generator).to(dtype).transpose(1, 2)
    caches = []
    for _ in range(2):
        cache = torch.full((2, n_kv_head, 96, 32), float("nan"), dtype=dtype)
        cache[:, :, :length] = torch.randn(2, n_kv_head, length, 32, generator=generator).to(dtype)
        caches.append(cache[:, :, :length])
    return q, caches[0], caches[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv_head", [2, 4])
# T=4 with 2 kv heads: rows (head, token) whose layout a transposed indexing would not hide.
@pytest.mark.parametrize("new_tokens", [1, 4])
@pytest.mark.parametrize("alibi", [False, True])
def test_decode_attention(dtype: torch.dtype, n_kv_head: int, new_tokens: int, alibi: bool) -> None:
    q, k, v = _attention_inputs(dtype, n_kv_head=n_kv_head, new_tokens=new_tokens)
    slopes = alibi_slopes(4) if alibi else None
    # Queries at 62 .. 62+T-1 of 70 cached keys: the keys past the last query are never seen.
    expected = attention_reference(q, k, v, query_offset=62, alibi_slopes=slopes)
    # 63 or 66 keys in splits of two 16-key tiles, the last one ragged, merged by the combine
    # kernel; with T=4 the last split (keys 64, 65) holds nothing the first two queries see.
    actual = triton_attention.decode_attention(
        q, k, v, query_offset=62, alibi_slopes=slopes, block_n=16, num_splits=3
    )
    assert_parity(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_in_more_splits_than_one_merge_pass_reads(dtype: torch.dtype) -> None:
    """The merge reads 16 splits' partials at a time: 22 splits take two passes, the second
    ragged.  3 heads of 1 query, 22 splits: 66 partial rows, which leave the maxima and sums
    unaligned unless each array is padded to 16 bytes."""
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, 3, 32, generator=generator).to(dtype).transpose(1, 2)
    k = torch.randn(1, 1, 700, 32, generator=generator).to(dtype)
    v = torch.randn(1, 1, 700, 32, generator=generator).to(dtype)
    expected = attention_reference(q, k, v, query_offset=699)
    # 700 keys in splits of two 16-key tiles: 22 of them.
    actual = triton_attention.decode_attention(q, k, v, query_offset=699, block_n=16, num_splits=22)
    assert_parity(actual, expected)
    partials = triton_attention._partials(torch.empty(1, 3, 1, 32), 22)
    assert all(part.data_ptr() % 16 == 0 for part in partials)
    assert [part.numel() for part in partials] == [66 * 32, 66, 66]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_in_one_split(dtype: torch.dtype) -> None:
    q, k, v = _attention_inputs(dtype, n_kv_head=2, new_tokens=3)
    expected = attention_reference(q, k, v, query_offset=40, scale=0.3)
    actual = triton_attention.decode_attention(
        q, k, v, query_offset=40, scale=0.3, block_n=16, num_splits=1
    )
    assert_parity(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv_head", [2, 4])
@pytest.mark.parametrize("new_tokens", [3, 17])
@pytest.mark.parametrize("alibi", [False, True])
def test_prefill_attention(
    dtype: torch.dtype, n_kv_head: int, new_tokens: int, alibi: bool
) -> None:
    q, k, v = _attention_inputs(dtype, n_kv_head=n_kv_head, new_tokens=new_tokens)
    query_offset = 70 - new_tokens - 2
    slopes = alibi_slopes(4) if alibi else None
    expected = attention_reference(q, k, v, query_offset=query_offset, alibi_slopes=slopes)
    # 16x16 tiles: unmasked tiles before the first query, masked ones on the causal edge.
    actual = triton_attention.prefill_attention(
        q, k, v, query_offset=query_offset, alibi_slopes=slopes, block_m=16, block_n=16
    )
    assert_parity(actual, expected)


@pytest.mark.parametrize("new_tokens", [1, 17])
def test_kernels_with_default_tiles(new_tokens: int) -> None:
    """From an empty cache (query_offset 0) and from a filled one, with the default tile sizes:
    the decode kernel for one new token, the prefill kernel for 17."""
    q, k, v = _attention_inputs(torch.float32, n_kv_head=2, new_tokens=new_tokens)
    kernel = (
        triton_attention.decode_attention if new_tokens == 1 else triton_attention.prefill_attention
    )
    for query_offset in (0, 70 - new_tokens):
        expected = attention_reference(q, k, v, query_offset=query_offset)
        actual = kernel(q, k, v, query_offset=query_offset)
        assert_parity(actual, expected)


@pytest.mark.parametrize("kernel", ["decode_attention", "prefill_attention"])
def test_kernels_refuse_what_the_reference_refuses(kernel: str) -> None:
    attend = getattr(triton_attention, kernel)
    q, k, v = _attention_inputs(torch.float32, n_kv_head=4, new_tokens=3)
    with pytest.raises(ValueError, match="cannot cover"):
        attend(q, k, v, query_offset=68)
    with pytest.raises(ValueError, match="cannot share"):
        attend(q, k[:, :3], v[:, :3], query_offset=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [None, 32])
def test_rms_norm(dtype: torch.dtype, block: int | None) -> None:
    """Rows of 70 (ragged) read once (the default block) or in three 32-wide steps; the rows are
    strided (a slice of wider rows)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 80, generator=generator).to(dtype)[..., :70]
    weight = (1 + torch.randn(70, generator=generator)).to(dtype)
    actual = triton_norm.rms_norm(x, weight, 1e-6, block=block)
    # Two roundings (the normalized row to x's dtype, then the product), each of which may land
    # a step apart: rstd can differ in its last bit, and the interpreter truncates bf16.
    assert_parity(actual, rms_norm_reference(x, weight, 1e-6), ulps=2)


def test_rms_norm_with_a_float32_weight_returns_float32() -> None:
    x = torch.randn(4, 70).to(torch.bfloat16)
    weight = torch.rand(70) + 0.5
    actual = triton_norm.rms_norm(x, weight, 1e-5)
    expected = rms_norm_reference(x, weight, 1e-5)
    assert actual.dtype == expected.dtype == torch.float32
    # The normalized row is rounded to bf16 before the fp32 weight: one bf16 step apart at most.
    torch.testing.assert_close(actual, expected, rtol=torch.finfo(torch.bfloat16).eps, atol=1e-5)


def _rotary_inputs(
    dtype: torch.dtype, *, heads: int, new_tokens: int, cos_batch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(heads * 100 + new_tokens)
    x = torch.randn(2, new_tokens, heads, 32, generator=generator).to(dtype).transpose(1, 2)
    # Unlike transformers' the two halves differ, so a kernel reading the wrong half would show.
    angles = torch.rand(cos_batch, new_tokens, 32, generator=generator) * 6.3
    return x, angles.cos().to(dtype), angles.sin().to(dtype)


def _rotary_expected(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotary_reference evaluated in fp32 and rounded once, as the kernel does: evaluated in
    fp16/bf16 it rounds three times (like transformers), up to a few steps away."""
    return rotary_reference(x.float(), cos.float(), sin.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("new_tokens", "cos_batch"), [(1, 2), (17, 1)])
def test_rotary(dtype: torch.dtype, new_tokens: int, cos_batch: int) -> None:
    x, cos, sin = _rotary_inputs(dtype, heads=4, new_tokens=new_tokens, cos_batch=cos_batch)
    actual = triton_rotary.rotary(x, cos, sin)
    assert_parity(actual, _rotary_expected(x, cos, sin))
    if dtype == torch.float32:
        assert_parity(actual, rotary_reference(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("new_tokens", [1, 17])
def test_rotary_append(dtype: torch.dtype, new_tokens: int) -> None:
    q, cos, sin = _rotary_inputs(dtype, heads=4, new_tokens=new_tokens, cos_batch=1)
    k, _, _ = _rotary_inputs(dtype, heads=2, new_tokens=new_tokens, cos_batch=1)
    v = torch.randn(2, 2, new_tokens, 32).to(dtype)
    keys = torch.randn(2, 2, 40, 32).to(dtype)
    values = torch.randn(2, 2, 40, 32).to(dtype)
    expected_keys, expected_values = keys.clone(), values.clone()
    rotary_append_reference(
        q.float(), k.float(), v, cos.float(), sin.float(),
        keys=expected_keys, values=expected_values, start=5,
    )  # fmt: skip

    actual_q = triton_rotary.rotary_append(q, k, v, cos, sin, keys=keys, values=values, start=5)
    assert_parity(actual_q, _rotary_expected(q, cos, sin))
    assert_parity(keys, expected_keys)  # positions outside 5 .. 5+T-1 untouched, exactly
    assert torch.equal(values, expected_values)


def test_rotary_append_refuses_positions_past_the_cache() -> None:
    q, cos, sin = _rotary_inputs(torch.float32, heads=4, new_tokens=3, cos_batch=1)
    k = v = torch.zeros(2, 2, 3, 32)
    keys = values = torch.zeros(2, 2, 8, 32)
    for rotary_append in (triton_rotary.rotary_append, rotary_append_reference):
        with pytest.raises(ValueError, match=r"positions 6 \.\. 8 do not fit a cache of 8"):
            rotary_append(q, k, v, cos, sin, keys=keys, values=values, start=6)


def test_dispatch_keeps_cpu_tensors_on_the_references_without_importing_triton() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        from petals_core.kernels import _dispatch as d, _reference as r
        q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
        cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        # Attention without ALiBi goes through torch's SDPA on CPU (see test_dispatch.py);
        # with ALiBi it is the reference itself.
        slopes = r.alibi_slopes(4)
        assert torch.equal(
            d.attention(q, k, v, query_offset=2, alibi_slopes=slopes),
            r.attention_reference(q, k, v, query_offset=2, alibi_slopes=slopes),
        )
        w = torch.randn(8)
        assert torch.equal(d.rms_norm(q, w, 1e-6), r.rms_norm_reference(q, w, 1e-6))
        assert torch.equal(d.rotary(q, cos, sin), r.rotary_reference(q, cos, sin))
        caches = [torch.zeros(1, 2, 6, 8) for _ in range(4)]
        a = d.rotary_append(q, k[:, :, :3], v[:, :, :3], cos, sin,
                            keys=caches[0], values=caches[1], start=2)
        b = r.rotary_append_reference(q, k[:, :, :3], v[:, :, :3], cos, sin,
                                      keys=caches[2], values=caches[3], start=2)
        assert torch.equal(a, b) and torch.equal(caches[0], caches[2])
        assert torch.equal(caches[1], caches[3])
        assert "triton" not in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
