"""The CPU decode backend's array operations against the torch references they stand for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from petals_core import kernels
from petals_core.models import _numpy_ops as ops

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _close(got: np.ndarray, expected: torch.Tensor) -> None:
    assert got.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(np.ascontiguousarray(got)), expected, **TOL)


def test_norms_activations_and_projections() -> None:
    x, weight, bias = _randn(3, 16), _randn(16, seed=1), _randn(16, seed=2)
    _close(
        ops.rms_norm(x.numpy(), weight.numpy(), 1e-5), kernels.rms_norm_reference(x, weight, 1e-5)
    )
    _close(
        ops.layer_norm(x.numpy(), weight.numpy(), bias.numpy(), 1e-5),
        F.layer_norm(x, (16,), weight, bias, 1e-5),
    )
    matrix = _randn(8, 16, seed=3)
    _close(ops.project(x.numpy(), matrix.numpy(), None), F.linear(x, matrix))
    _close(ops.project(x.numpy(), matrix.numpy(), bias[:8].numpy()), F.linear(x, matrix, bias[:8]))
    # The activations work in place on the array they are given.
    product = x.numpy().copy()
    assert ops.silu(product) is product
    _close(product, F.silu(x))
    product = x.numpy().copy()
    assert ops.gelu_tanh(product) is product
    _close(product, F.gelu(x, approximate="tanh"))


def test_rotate_is_the_rotary_reference_on_rows() -> None:
    batch, heads, new, head_dim = 2, 3, 2, 8
    rows = _randn(batch * new, heads * head_dim)
    cos, sin = _randn(1, new, head_dim, seed=1), _randn(1, new, head_dim, seed=2)
    x = rows.view(batch, new, heads, head_dim).transpose(1, 2)  # (B, heads, T, head_dim)
    got = ops.rotate(rows.numpy(), batch, heads, cos.numpy()[:, None], sin.numpy()[:, None])
    _close(got, kernels.rotary_reference(x, cos, sin))


@pytest.mark.parametrize(("n_head", "n_kv_head", "new"), [(4, 2, 1), (4, 4, 2), (6, 2, 2)])
@pytest.mark.parametrize("with_alibi", [False, True])
def test_attend_is_the_attention_reference(
    n_head: int, n_kv_head: int, new: int, with_alibi: bool
) -> None:
    batch, start, head_dim = 2, 5, 8
    q = _randn(batch, n_head, new, head_dim)
    keys = _randn(batch, n_kv_head, start + new, head_dim, seed=1)
    values = _randn(batch, n_kv_head, start + new, head_dim, seed=2)
    slopes = kernels.alibi_slopes(n_head) if with_alibi else None
    alibi = None if slopes is None else ops.AlibiTable(slopes.numpy()).upto(start + new)
    got = ops.attend(
        q.numpy(), keys.numpy(), values.numpy(), start=start, scale=head_dim**-0.5, alibi=alibi
    )
    expected = kernels.attention_reference(q, keys, values, query_offset=start, alibi_slopes=slopes)
    _close(got, expected.transpose(1, 2).reshape(batch, new, n_head * head_dim))


def test_alibi_table_grows_and_keeps_its_terms() -> None:
    slopes = kernels.alibi_slopes(4)
    table = ops.AlibiTable(slopes.numpy())
    for length in (1, 256, 257, 3, 1000):
        terms = table.upto(length)
        assert terms.shape == (4, length)
        expected = slopes.view(4, 1) * torch.arange(length, dtype=torch.float32)
        assert torch.equal(torch.from_numpy(np.ascontiguousarray(terms)), expected)
