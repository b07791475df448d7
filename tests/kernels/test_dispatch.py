"""The CPU dispatch of attention: torch's SDPA must keep the reference's semantics."""

from __future__ import annotations

import pytest
import torch

from petals_core.kernels import attention, attention_reference


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
