"""The torch references against independent computations of the same maths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from petals_core.kernels import attention
from petals_core.kernels._reference import (
    alibi_slopes,
    attention_reference,
    rms_norm_reference,
    rotary_append_reference,
    rotary_reference,
)


@pytest.mark.parametrize(
    ("n_kv_head", "new_tokens", "query_offset"), [(4, 5, 0), (2, 3, 6), (1, 1, 10)]
)
@pytest.mark.parametrize("alibi", [False, True])
def test_attention_matches_sdpa_with_an_explicit_mask(
    n_kv_head: int, new_tokens: int, query_offset: int, alibi: bool
) -> None:
    q = torch.randn(2, 4, new_tokens, 16)
    k, v = torch.randn(2, n_kv_head, 12, 16), torch.randn(2, n_kv_head, 12, 16)
    slopes = alibi_slopes(4) if alibi else None
    # Query t (absolute position query_offset + t) sees keys 0 .. query_offset + t.
    visible = torch.ones(new_tokens, 12, dtype=torch.bool).tril(diagonal=query_offset)
    bias = torch.zeros(4, new_tokens, 12).masked_fill(~visible, float("-inf"))
    if slopes is not None:
        bias = bias + slopes.view(4, 1, 1) * torch.arange(12.0)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.2, enable_gqa=True)
    actual = attention_reference(q, k, v, query_offset=query_offset, scale=0.2, alibi_slopes=slopes)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_key_bias_is_added_to_the_scaled_scores(rows: int) -> None:
    """A bias per (row, head, key) is ALiBi with any positions: here each row's own."""
    q, k, v = torch.randn(2, 4, 3, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    key_bias = torch.randn(rows, 4, 9)
    visible = torch.ones(3, 9, dtype=torch.bool).tril(diagonal=6)
    mask = torch.zeros(3, 9).masked_fill(~visible, float("-inf")) + key_bias.unsqueeze(2)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2, enable_gqa=True)
    actual = attention_reference(q, k, v, query_offset=6, scale=0.2, key_bias=key_bias)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    slopes = alibi_slopes(4)
    torch.testing.assert_close(
        attention(q, k, v, query_offset=6, key_bias=slopes.view(1, 4, 1) * torch.arange(9.0)),
        attention_reference(q, k, v, query_offset=6, alibi_slopes=slopes),
    )


def test_attention_of_a_whole_prompt_is_causal_sdpa() -> None:
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    actual = attention_reference(q, k, v, query_offset=0)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)  # fp32 inside


def test_attention_computes_in_float32_and_returns_the_input_dtype() -> None:
    q, k, v = (torch.randn(1, 2, 3, 8).to(torch.bfloat16) for _ in range(3))
    actual = attention_reference(q, k, v, query_offset=0)
    expected = attention_reference(q.float(), k.float(), v.float(), query_offset=0)
    assert actual.dtype == torch.bfloat16
    assert torch.equal(actual, expected.to(torch.bfloat16))


def test_attention_refuses_impossible_shapes() -> None:
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="4 query heads cannot share 3"):
        attention_reference(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), query_offset=0)
    with pytest.raises(ValueError, match="5 keys cannot cover queries up to 6"):
        attention_reference(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), query_offset=4)


def test_rms_norm_is_the_formula() -> None:
    x = torch.randn(3, 4, 24, dtype=torch.float64)
    weight = torch.randn(24, dtype=torch.float64)
    rms = (x.pow(2).sum(-1, keepdim=True) / 24 + 1e-5).sqrt()
    expected = x / rms * weight
    torch.testing.assert_close(
        rms_norm_reference(x.float(), weight.float(), 1e-5), expected.float()
    )


def test_rms_norm_rounds_the_normalized_row_to_the_input_dtype() -> None:
    x = torch.randn(2, 24).to(torch.bfloat16)
    weight = torch.randn(24)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = weight * normed.to(torch.bfloat16).float()
    assert torch.equal(rms_norm_reference(x, weight, 1e-6), expected)


def _angles(batch: int, new_tokens: int, half: int) -> torch.Tensor:
    positions = torch.arange(new_tokens, dtype=torch.float64).view(1, -1, 1) + torch.arange(batch)
    inv_freq = 10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)
    return positions.view(batch, new_tokens, 1) * inv_freq  # (B, T, half)


@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rotary_is_a_complex_rotation_of_the_two_halves(cos_batch: int) -> None:
    x = torch.randn(2, 3, 5, 16, dtype=torch.float64)
    angles = _angles(cos_batch, 5, 8)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    # HF's halves layout pairs x[i] with x[i + half]: the real and imaginary parts of one number.
    pairs = torch.complex(x[..., :8], x[..., 8:])
    turned = pairs * torch.polar(torch.ones_like(angles), angles).unsqueeze(1)
    expected = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(rotary_reference(x, cos, sin), expected)


def test_rotary_append_writes_the_rotated_keys_and_the_values_in_place() -> None:
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    angles = _angles(1, 3, 4).float()
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    keys, values = torch.zeros(2, 2, 10, 8), torch.zeros(2, 2, 10, 8)
    rotated_q = rotary_append_reference(q, k, v, cos, sin, keys=keys, values=values, start=4)
    assert torch.equal(rotated_q, rotary_reference(q, cos, sin))
    assert torch.equal(keys[:, :, 4:7], rotary_reference(k, cos, sin))
    assert torch.equal(values[:, :, 4:7], v)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[4:7] = False
    assert not keys[:, :, untouched].any() and not values[:, :, untouched].any()
    with pytest.raises(ValueError, match=r"positions 8 \.\. 10 do not fit a cache of 10"):
        rotary_append_reference(q, k, v, cos, sin, keys=keys, values=values, start=8)


def test_alibi_slopes_follow_bloom() -> None:
    # A power of two: the geometric sequence 2^(-8/n), 2^(-16/n), ...
    torch.testing.assert_close(alibi_slopes(8), 2.0 ** -torch.arange(1.0, 9.0))
    # Otherwise the power of two below, then every other slope of the power of two above.
    expected = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))
    assert alibi_slopes(4).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    assert math.isclose(alibi_slopes(1).item(), 2.0**-8)
