"""The dispatch of attention: on CPU torch's SDPA must keep the reference's semantics; on CUDA
the rules say which Triton kernel a call may take, and a measured table picks between
implementations."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from petals_core.kernels import (
    DispatchTable,
    alibi_slopes,
    attention,
    attention_reference,
    dispatch_table,
)
from petals_core.kernels._limits import attention_kernel


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


def test_dispatch_table_times_each_candidate_once_per_key() -> None:
    calls = {"a": 0, "b": 0}
    synchronized = []

    def candidate(name: str) -> Callable[[], None]:
        def run() -> None:
            calls[name] += 1

        return run

    table = DispatchTable(repeats=3)
    candidates = {"a": candidate("a"), "b": candidate("b")}
    first = table.choose(("x", 1), candidates, synchronize=lambda: synchronized.append(1))
    assert calls == {"a": 4, "b": 4}  # a warm-up call, then the timed ones
    assert len(synchronized) == 4  # before and after each candidate's timed calls
    (entry,) = table.snapshot()
    assert entry.key == ("x", 1) and entry.choice == first
    assert set(entry.seconds) == {"a", "b"}
    assert entry.seconds[first] == min(entry.seconds.values())
    # Known key: nothing runs again; a new key is timed afresh.
    assert table.choose(("x", 1), candidates) == first
    assert calls == {"a": 4, "b": 4}
    table.choose(("x", 2), candidates)
    assert calls == {"a": 8, "b": 8}
    assert [choice.key for choice in table.snapshot()] == [("x", 1), ("x", 2)]


def test_cpu_attention_makes_no_dispatch_choices() -> None:
    """Choices are for CUDA shapes; CPU attention goes its fixed way without timing anything."""
    before = len(dispatch_table())
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 4, 8)
    attention(q, k, k, query_offset=3)
    assert len(dispatch_table()) == before


@pytest.mark.parametrize(
    ("dtype", "new_tokens", "group", "alibi", "kernel"),
    [
        (torch.bfloat16, 1, 8, False, "decode"),
        (torch.float16, 16, 8, True, "decode"),
        (torch.bfloat16, 1, 128, False, "decode"),  # 128 query heads on one key/value head
        (torch.bfloat16, 2, 71, False, None),  # 142 query rows: SDPA
        (torch.bfloat16, 2, 71, True, "prefill"),
        (torch.bfloat16, 17, 1, True, "prefill"),
        (torch.float16, 300, 4, False, None),  # a prompt without ALiBi: SDPA's flash kernel
        (torch.float32, 1, 8, False, None),  # fp32 on a GPU: torch
        (torch.float32, 300, 1, True, None),
    ],
)
def test_which_triton_kernel_a_gpu_call_takes(
    dtype: torch.dtype, new_tokens: int, group: int, alibi: bool, kernel: str | None
) -> None:
    assert attention_kernel(dtype=dtype, new_tokens=new_tokens, group=group, alibi=alibi) == kernel
