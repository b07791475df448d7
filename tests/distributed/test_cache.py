"""The length-only cache ``generate()`` carries: counting, cropping as transformers asks, and
reordering rows."""

from __future__ import annotations

import pytest
import torch

from petals_core.distributed._cache import RemoteCache


def test_crops_follow_transformers_conventions() -> None:
    cache = RemoteCache(10)
    cache.crop(0)  # assisted decoding when every draft token was accepted: nothing removed
    assert cache.get_seq_length() == 10
    cache.crop(-3)  # three draft tokens rejected
    assert cache.get_seq_length() == 7
    cache.crop(5)  # transformers before 5.2x: keep five
    assert cache.get_seq_length() == 5
    cache.crop(9)  # keeping more than held changes nothing
    assert cache.get_seq_length() == 5
    cache.crop(-20)
    assert cache.get_seq_length() == 0


def test_advancing_setting_and_reordering() -> None:
    cache = RemoteCache()
    cache.advance(4)
    assert cache.get_seq_length() == 4
    cache.set_seq_length(2)
    assert cache.get_seq_length() == 2
    with pytest.raises(ValueError, match=">= 0"):
        cache.set_seq_length(-1)
    cache.reorder_cache(torch.tensor([1, 0, 2]))
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    hypo_ids = cache.take_hypo_ids()
    assert hypo_ids is not None and hypo_ids.tolist() == [2, 1, 0]
    assert cache.take_hypo_ids() is None
