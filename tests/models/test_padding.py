"""Left-padded batches through our blocks with a KV cache equal transformers with an attention
mask (what batched generate() does): padding hidden from real tokens, LLaMA positions counted
from each row's first real token, beams reordered with their padding."""

from __future__ import annotations

import pytest
import torch
from transformers import BloomForCausalLM, LlamaForCausalLM, PreTrainedModel

from petals_core.models import BloomBlock, KVCache, LlamaBlock

from .conftest import tiny_bloom_config, tiny_llama_config

PADDING = [0, 3, 1]
LENGTH = 9


def _reference(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The last hidden states (before the final norm) as generate() computes them."""
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    kwargs = {"position_ids": position_ids} if isinstance(model, LlamaForCausalLM) else {}
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True, **kwargs)
    return out.hidden_states[-1]


def _ours(
    model: PreTrainedModel, ids: torch.Tensor, splits: list[int], reorder: torch.Tensor | None
) -> torch.Tensor:
    llama = isinstance(model, LlamaForCausalLM)
    base = model.model if llama else model.transformer
    layers = base.layers if llama else base.h
    blocks = []
    for i, layer in enumerate(layers):
        block = (LlamaBlock if llama else BloomBlock)(model.config, i)
        block.load_state_dict(layer.state_dict())
        blocks.append(block)
    with torch.no_grad():
        x = (
            base.embed_tokens(ids)
            if llama
            else base.word_embeddings_layernorm(base.word_embeddings(ids))
        )
        caches: list[KVCache] = []
        for block in blocks:
            cache = block.allocate_cache(ids.shape[0], LENGTH)
            cache.set_padding(torch.tensor(PADDING))
            caches.append(cache)
        outputs = []
        start = 0
        for end in splits:
            if reorder is not None and start:
                # Beam search: the surviving rows continue, with their caches and padding.
                for cache in caches:
                    cache.reorder(reorder)
                x = x[reorder]
                outputs = [out[reorder] for out in outputs]
            h = x[:, start:end]
            for block, cache in zip(blocks, caches, strict=True):
                h = block(h, cache=cache)
            outputs.append(h)
            start = end
        out = torch.cat(outputs, dim=1)
        return base.norm(out) if llama else base.ln_f(out)


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_left_padded_rows_equal_transformers_with_a_mask(family: str) -> None:
    torch.manual_seed(5)
    if family == "llama":
        model: PreTrainedModel = LlamaForCausalLM(tiny_llama_config())
    else:
        model = BloomForCausalLM(tiny_bloom_config())
    model.eval()
    ids = torch.randint(0, 200, (len(PADDING), LENGTH))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(PADDING):
        mask[row, :pad] = 0
    expected = _reference(model, ids, mask)
    got = _ours(model, ids, splits=[5, 6, 7, LENGTH], reorder=None)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_reordered_rows_keep_their_padding() -> None:
    torch.manual_seed(6)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    ids = torch.randint(0, 200, (len(PADDING), LENGTH))
    # Rows 1 and 2 swap after the prefill: the reference is the swapped batch from the start.
    order = torch.tensor([0, 2, 1])
    swapped_padding = [PADDING[i] for i in order]
    mask = torch.ones_like(ids)
    for row, pad in enumerate(swapped_padding):
        mask[row, :pad] = 0
    swapped_ids = ids[order]
    expected = _reference(model, swapped_ids, mask)
    got = _ours(model, ids, splits=[6, LENGTH], reorder=order)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)
