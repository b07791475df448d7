"""The cache argument's name is the one the installed transformers reads and returns."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaModel

from petals_core._hf_compat import CACHE_ARG, cache_kwargs
from petals_core.testing import tiny_llama_config


def test_models_read_and_return_the_cache_under_its_name() -> None:
    config = tiny_llama_config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64
    )
    model = LlamaModel(config).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        out = model(torch.arange(5)[None], use_cache=True, **cache_kwargs(cache))
    # Under another name the model would ignore ours and start a cache of its own.
    assert cache.get_seq_length() == 5
    assert out[CACHE_ARG] is cache
