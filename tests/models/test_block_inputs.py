"""What both block families refuse, and edge cases found in review."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaModel
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from petals_core.kernels import alibi_slopes
from petals_core.models import BloomBlock, KVCache, LlamaBlock, block_state_dict
from petals_core.testing import tiny_bloom_config, tiny_llama_config

LLAMA = tiny_llama_config(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    vocab_size=16,
    attn_implementation="eager",
)
BLOOM = tiny_bloom_config(hidden_size=32, n_layer=1, vocab_size=16)


@pytest.mark.parametrize("make", [lambda: LlamaBlock(LLAMA), lambda: BloomBlock(BLOOM)])
def test_blocks_refuse_inputs_they_would_miscompute(make) -> None:  # type: ignore[no-untyped-def]
    block = make().eval()
    with pytest.raises(ValueError, match=r"must be \(batch, T >= 1, 32\)"):
        block(torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match=r"are torch\.bfloat16 but this block computes in"):
        block(torch.randn(1, 2, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"are torch\.int64"):
        block(torch.ones(1, 2, 32, dtype=torch.long))
    wrong_cache = block.allocate_cache(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="allocate it with allocate_cache"):
        block(torch.randn(1, 2, 32), cache=wrong_cache)
    with pytest.raises(ValueError, match="3 rows of hidden states for a cache of 1 rows"):
        block(torch.randn(3, 2, 32), cache=block.allocate_cache(1, 8))


def test_cache_refuses_non_integer_positions_and_masks() -> None:
    cache = KVCache.allocate(batch=2, kv_heads=1, max_length=4, head_dim=2, dtype=torch.float32)
    with pytest.raises(TypeError):
        cache.rollback(1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hypo_ids must be integers"):
        cache.reorder(torch.tensor([True, False]))


@pytest.mark.parametrize("n_head", [16, 32, 112, 5, 12])
def test_alibi_slopes_are_transformers_bit_for_bit(n_head: int) -> None:
    built = build_alibi_tensor(torch.ones(1, 2), n_head, torch.float32).view(n_head, 2)
    assert torch.equal(alibi_slopes(n_head), built[:, 1])


def test_llama_without_cache_starts_at_a_given_position() -> None:
    torch.manual_seed(0)
    model = LlamaModel(LLAMA).eval()
    model.norm = torch.nn.Identity()
    blocks = [LlamaBlock(LLAMA, i).eval() for i in range(2)]
    for block, layer in zip(blocks, model.layers, strict=True):
        block.load_state_dict(layer.state_dict())
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        expected = model(inputs_embeds=x, position_ids=torch.arange(5, 8)[None]).last_hidden_state
        ours = x
        for block in blocks:
            ours = block(ours, position=5)
    assert (ours - expected).abs().max().item() <= 1e-5


def test_checkpoints_with_stale_rotary_buffers_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Llama-2-era checkpoints (transformers 4.28-4.30) keep rotary_emb.inv_freq per layer."""
    torch.manual_seed(0)
    model = LlamaModel(LLAMA)
    LLAMA.save_pretrained(tmp_path)
    tensors = {f"model.{name}": t.contiguous() for name, t in model.state_dict().items()}
    for index in range(2):
        tensors[f"model.layers.{index}.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors")
    block = LlamaBlock(LLAMA, 1)
    block.load_state_dict(block_state_dict(tmp_path, 1, config=LLAMA))  # strict
