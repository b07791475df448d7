"""The CPU dispatch of attention: torch's SDPA must keep the reference's semantics."""

from __future__ import annotations

import pytest
import torch

from petals_core.kernels import alibi_slopes, attention, attention_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("new", "offset", "length"),
    [(7, 0, 7), (1, 6, 7), (3, 4, 7), (2, 0, 9), (1, 2, 5)],
    ids=["prefill", "decode", "chunk", "future-keys", "decode-mid-cache"],
)
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_sdpa_path_matches_the_reference(
    dtype: torch.dtype, new: int, offset: int, length: int, kv_heads: int
) -> None:
    generator = torch.Generator().manual_seed(new * 100 + offset * 10 + length)
    q = torch.randn(2, 4, new, 16, generator=generator).to(dtype)
    k = torch.randn(2, kv_heads, length, 16, generator=generator).to(dtype)
    v = torch.randn(2, kv_heads, length, 16, generator=generator).to(dtype)
    got = attention(q, k, v, query_offset=offset)
    expected = attention_reference(q, k, v, query_offset=offset)
    assert got.dtype == dtype
    # fp32: only summation order differs.  bf16: both accumulate in fp32 and round once at the
    # end, so they may differ by one bf16 step of the output.
    tolerance = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps * 4
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_sdpa_path_refuses_too_few_keys() -> None:
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="4 keys cannot cover queries up to 5"):
        attention(q, k, k, query_offset=2)


@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("length", [1, 9, 300])
def test_alibi_decode_path_matches_the_reference(heads: int, length: int) -> None:
    # One fp32 query at the end of the cache with ALiBi goes to SDPA with the ALiBi term as a mask.
    generator = torch.Generator().manual_seed(heads * 1000 + length)
    q = torch.randn(2, heads, 1, 16, generator=generator)
    k = torch.randn(2, heads, length, 16, generator=generator)
    v = torch.randn(2, heads, length, 16, generator=generator)
    slopes = alibi_slopes(heads)
    got = attention(q, k, v, query_offset=length - 1, alibi_slopes=slopes)
    expected = attention_reference(q, k, v, query_offset=length - 1, alibi_slopes=slopes)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Not at the end of the cache: the reference (later keys must stay hidden).
    if length > 1:
        early = attention(q, k, v, query_offset=length - 2, alibi_slopes=slopes)
        assert torch.equal(
            early, attention_reference(q, k, v, query_offset=length - 2, alibi_slopes=slopes)
        )
