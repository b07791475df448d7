"""KVCache: the preallocated per-session layout every block uses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from petals_core.models._cache import KVCache


def _cache(batch: int = 3, max_length: int = 10) -> KVCache:
    return KVCache.allocate(
        batch=batch, kv_heads=2, max_length=max_length, head_dim=4, dtype=torch.float32
    )


def test_append_returns_views_of_everything_filled() -> None:
    cache = _cache()
    first_k, first_v = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    keys, values = cache.append(first_k, first_v)
    assert cache.length == 4 and keys.shape == (3, 2, 4, 4)
    more_k, more_v = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
    keys, values = cache.append(more_k, more_v)
    assert torch.equal(keys, torch.cat([first_k, more_k], dim=2))
    assert torch.equal(values, torch.cat([first_v, more_v], dim=2))
    # Views, not copies: the cache holds the data in place.
    assert keys.data_ptr() == cache.keys.data_ptr()
    assert cache.nbytes == 2 * 3 * 2 * 10 * 4 * 4


def test_overflow_is_a_clear_error_and_changes_nothing() -> None:
    cache = _cache(max_length=5)
    cache.append(torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4))
    with pytest.raises(ValueError, match="holds 5 positions; 4 are used and 2 more do not fit"):
        cache.append(torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4))
    assert cache.length == 4


def test_wrong_shapes_are_refused() -> None:
    cache = _cache()
    with pytest.raises(ValueError, match=r"must be \(3, 2, T, 4\)"):
        cache.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4))
    with pytest.raises(ValueError, match="new keys/values"):
        cache.append(torch.randn(3, 1, 1, 4), torch.randn(3, 1, 1, 4))
    with pytest.raises(ValueError, match="new keys/values"):
        cache.append(torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8))
    grad = torch.randn(3, 2, 1, 4, requires_grad=True)
    with pytest.raises(ValueError, match="does not track gradients"):
        cache.append(grad, grad)
    assert cache.length == 0
    with pytest.raises(ValueError, match="must both be"):
        KVCache(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5))


def test_rollback_forgets_later_positions() -> None:
    cache = _cache()
    keys = torch.randn(3, 2, 6, 4)
    cache.append(keys, keys)
    cache.rollback(2)
    assert cache.length == 2
    replacement = torch.randn(3, 2, 1, 4)
    filled, _ = cache.append(replacement, replacement)
    assert torch.equal(filled, torch.cat([keys[:, :, :2], replacement], dim=2))
    with pytest.raises(ValueError, match="cannot roll back to 5"):
        cache.rollback(5)


def test_reorder_permutes_rows_of_filled_positions() -> None:
    cache = _cache()
    keys = torch.randn(3, 2, 5, 4)
    values = torch.randn(3, 2, 5, 4)
    cache.append(keys, values)
    hypo_ids = torch.tensor([2, 2, 0])
    cache.reorder(hypo_ids)
    assert torch.equal(cache.keys[:, :, :5], keys[hypo_ids])
    assert torch.equal(cache.values[:, :, :5], values[hypo_ids])
    with pytest.raises(ValueError, match="hypo_ids must lie"):
        cache.reorder(torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="hypo_ids must be"):
        cache.reorder(torch.tensor([0, 1]))


def test_append_rotated_equals_rotating_then_appending() -> None:
    from petals_core.kernels import rotary_reference

    fused, plain = _cache(), _cache()
    q = torch.randn(3, 4, 2, 4)
    keys, values = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    angles = torch.randn(1, 2, 2).repeat(1, 1, 2)
    cos, sin = angles.cos(), angles.sin()
    for cache in (fused, plain):
        cache.append(torch.randn(3, 2, 3, 4).clone().fill_(1), torch.zeros(3, 2, 3, 4))
    q_rot, k_all, v_all = fused.append_rotated(q, keys, values, cos, sin)
    k_ref, v_ref = plain.append(rotary_reference(keys, cos, sin), values)
    assert torch.equal(q_rot, rotary_reference(q, cos, sin))
    assert torch.equal(k_all, k_ref) and torch.equal(v_all, v_ref)
    assert fused.length == plain.length == 5
    with pytest.raises(ValueError, match="do not fit"):
        fused.append_rotated(q, *(torch.randn(3, 2, 6, 4),) * 2, cos, sin)
    assert fused.length == 5


def test_append_arrays_is_append_for_numpy_arrays() -> None:
    """The CPU decode backend's append: the same checks and writes, numpy views back."""
    cache, twin = _cache(max_length=5), _cache(max_length=5)
    keys, values = torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)
    filled_keys, filled_values = cache.append_arrays(keys.numpy(), values.numpy())
    twin.append(keys, values)
    assert cache.length == twin.length == 4
    assert torch.equal(cache.keys, twin.keys) and torch.equal(cache.values, twin.values)
    assert filled_keys.shape == filled_values.shape == (3, 2, 4, 4)
    filled_keys[0, 0, 0, 0] = 7.0  # a view of the cache
    assert cache.keys[0, 0, 0, 0].item() == 7.0
    with pytest.raises(ValueError, match="holds 5 positions; 4 are used and 2 more do not fit"):
        cache.append_arrays(np.zeros((3, 2, 2, 4), np.float32), np.zeros((3, 2, 2, 4), np.float32))
    with pytest.raises(ValueError, match=r"must be \(3, 2, T, 4\)"):
        cache.append_arrays(np.zeros((3, 1, 1, 4), np.float32), np.zeros((3, 1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="new keys/values"):
        cache.append_arrays(np.zeros((3, 2, 1, 4), np.float32), np.zeros((3, 2, 2, 4), np.float32))
    assert cache.length == 4
    cache.rollback(1)
    more = np.ones((3, 2, 1, 4), np.float32)
    filled_keys, _ = cache.append_arrays(more, 2 * more)
    assert cache.length == 2 and filled_keys.shape == (3, 2, 2, 4)
    assert torch.equal(cache.values[:, :, 1], torch.full((3, 2, 4), 2.0))
