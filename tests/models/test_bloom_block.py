"""Our BloomBlock against transformers' BloomBlock and BloomModel carrying the same weights."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import BloomConfig
from transformers.cache_utils import DynamicCache
from transformers.models.bloom import modeling_bloom as hf_bloom

from petals_core._hf_compat import cache_kwargs
from petals_core.models.bloom import BloomBlock

HIDDEN, HEADS = 64, 4
FP32_ATOL = 1e-5


def make_config(*, n_head: int = HEADS, hidden: int = HIDDEN, **overrides: object) -> BloomConfig:
    return BloomConfig(hidden_size=hidden, n_head=n_head, n_layer=3, vocab_size=128, **overrides)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' init (std 0.02), so attention and ALiBi visibly matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if "layernorm" in name or name.startswith("ln_f"):
                p.copy_(1 + 0.1 * noise if name.endswith("weight") else 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(1.5 * noise / math.sqrt(p.shape[-1]))


def make_pair(config: BloomConfig, seed: int = 0) -> tuple[hf_bloom.BloomBlock, BloomBlock]:
    hf = hf_bloom.BloomBlock(config, layer_idx=0).eval()
    randomize_(hf, seed)
    ours = BloomBlock(config, layer_idx=0)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def additive_causal_mask(batch: int, new: int, past: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask BloomModel gives its blocks' eager attention, ``(B, 1, new, past + new)``: 0 where
    a query may attend, the dtype's minimum where the key lies in its future."""
    query = torch.arange(past, past + new)[:, None]
    key = torch.arange(past + new)[None, :]
    mask = torch.zeros(new, past + new, dtype=dtype)
    mask = mask.masked_fill(key > query, torch.finfo(dtype).min)  # (new, past + new)
    return mask.expand(batch, 1, new, past + new)


def hf_forward(
    block: hf_bloom.BloomBlock,
    config: BloomConfig,
    x: torch.Tensor,
    cache: DynamicCache | None = None,
) -> torch.Tensor:
    """transformers' block driven as BloomModel drives it: ALiBi, causal mask over past + new."""
    batch, new, _ = x.shape
    past = 0 if cache is None else cache.get_seq_length()
    mask = additive_causal_mask(batch, new, past, x.dtype)
    alibi = hf_bloom.build_alibi_tensor(torch.ones(batch, past + new), config.n_head, x.dtype)
    return block(
        x, alibi=alibi, attention_mask=mask, layer_past=cache, use_cache=cache is not None
    )[0]


def inputs(batch: int, length: int, seed: int = 1, hidden: int = HIDDEN) -> torch.Tensor:
    return torch.randn(batch, length, hidden, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_matches(ours: torch.Tensor, expected: torch.Tensor) -> None:
    diff = max_diff(ours, expected)
    assert diff <= FP32_ATOL, f"max abs diff {diff:.3g}"


def test_parameter_names_are_transformers_names() -> None:
    hf, ours = make_pair(make_config())
    assert list(ours.state_dict()) == list(hf.state_dict())


@pytest.mark.parametrize(
    ("n_head", "hidden", "post_norm_residual"),
    [(4, 64, False), (4, 64, True), (6, 96, False)],  # 6 heads: ALiBi's non-power-of-two slopes
)
@pytest.mark.parametrize("batch", [1, 3])
def test_prefill_matches(n_head: int, hidden: int, post_norm_residual: bool, batch: int) -> None:
    config = make_config(
        n_head=n_head, hidden=hidden, apply_residual_connection_post_layernorm=post_norm_residual
    )
    hf, ours = make_pair(config)
    x = inputs(batch, 9, hidden=hidden)
    with torch.no_grad():
        expected = hf_forward(hf, config, x)
        assert_matches(ours(x), expected)
        cache = ours.allocate_cache(batch, 16)
        assert_matches(ours(x, cache=cache), expected)
        assert cache.length == 9


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_token_by_token_after_prefill(batch: int) -> None:
    config = make_config()
    hf, ours = make_pair(config)
    x = inputs(batch, 12)
    hf_cache, cache = DynamicCache(), ours.allocate_cache(batch, 12)
    with torch.no_grad():
        assert_matches(ours(x[:, :5], cache=cache), hf_forward(hf, config, x[:, :5], hf_cache))
        for t in range(5, 12):
            step = x[:, t : t + 1]
            assert_matches(ours(step, cache=cache), hf_forward(hf, config, step, hf_cache))
    assert cache.length == hf_cache.get_seq_length() == 12


def test_chunks_into_a_non_empty_cache() -> None:
    config = make_config()
    hf, ours = make_pair(config)
    x = inputs(3, 11)
    hf_cache, cache = DynamicCache(), ours.allocate_cache(3, 16)
    with torch.no_grad():
        for start, end in [(0, 4), (4, 7), (7, 8), (8, 11)]:
            chunk = x[:, start:end]
            expected = hf_forward(hf, config, chunk, hf_cache)
            assert_matches(ours(chunk, cache=cache), expected)
        # and the chunked outputs are the one-shot prefill's
        cache.rollback(8)
        assert_matches(ours(x[:, 8:11], cache=cache, position=8), hf_forward(hf, config, x)[:, 8:])


def test_reorder_by_hypo_ids() -> None:
    config = make_config()
    hf, ours = make_pair(config)
    prefix, new = inputs(3, 6, seed=1), inputs(3, 2, seed=2)
    hypo_ids = torch.tensor([2, 0, 0])
    hf_cache, cache = DynamicCache(), ours.allocate_cache(3, 8)
    with torch.no_grad():
        hf_forward(hf, config, prefix, hf_cache)
        ours(prefix, cache=cache)
        hf_cache.reorder_cache(hypo_ids)
        cache.reorder(hypo_ids)
        for t in range(2):
            step = new[:, t : t + 1]
            assert_matches(ours(step, cache=cache), hf_forward(hf, config, step, hf_cache))
        # the same as running the surviving rows from scratch
        fresh = hf_forward(hf, config, torch.cat([prefix[hypo_ids], new], dim=1))[:, 6:]
        cache.rollback(6)
        assert_matches(ours(new, cache=cache), fresh)


def test_rollback_then_continue_equals_a_fresh_run() -> None:
    config = make_config()
    hf, ours = make_pair(config)
    first, resent = inputs(2, 9, seed=1), inputs(2, 3, seed=2)
    cache = ours.allocate_cache(2, 12)
    with torch.no_grad():
        ours(first, cache=cache)
        expected = hf_forward(hf, config, torch.cat([first[:, :5], resent], dim=1))[:, 5:]
        # a client resending from position 5: what followed is forgotten, then overwritten
        cache.rollback(5)
        assert_matches(ours(resent, cache=cache, position=5), expected)
        assert cache.length == 8
        # twice over, to be sure nothing of the first attempt leaks into the second
        cache.rollback(5)
        assert_matches(ours(resent, cache=cache), expected)
        # transformers' own cache, cropped, agrees
        hf_cache = DynamicCache()
        hf_forward(hf, config, first, hf_cache)
        hf_cache.crop(-4)
        assert_matches(hf_forward(hf, config, resent, hf_cache), expected)


def test_backward_matches_for_inputs_soft_prompt_and_weights() -> None:
    config = make_config()
    hf, ours = make_pair(config)
    x = inputs(2, 7)
    prompt = 0.5 * inputs(1, 3, seed=3)  # a trainable soft prompt over the first 3 positions
    cotangent = inputs(2, 7, seed=4)

    def grads(
        block: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor]
    ) -> list[torch.Tensor]:
        x_ = x.clone().requires_grad_(True)
        prompt_ = prompt.clone().requires_grad_(True)
        y = run(x_ + torch.cat([prompt_, torch.zeros(1, 4, HIDDEN)], dim=1))
        (y * cotangent).sum().backward()
        return [x_.grad, prompt_.grad, *(p.grad for p in block.parameters())]

    ours_grads = grads(ours, ours)
    hf_grads = grads(hf, lambda h: hf_forward(hf, config, h))
    assert len(ours_grads) == len(hf_grads) == 14
    assert_matches(ours_grads[0], hf_grads[0])  # inputs
    assert_matches(ours_grads[1], hf_grads[1])  # soft prompt
    # Weight gradients sum over every position and reach ~30: float32 rounding is relative there.
    for ours_grad, hf_grad in zip(ours_grads[2:], hf_grads[2:], strict=True):
        torch.testing.assert_close(ours_grad, hf_grad, rtol=1e-5, atol=FP32_ATOL)


def test_model_run_layer_by_layer() -> None:
    config = make_config()
    model = hf_bloom.BloomModel(config).eval()
    randomize_(model, seed=5)
    blocks = [BloomBlock(config, layer_idx=i) for i in range(config.n_layer)]
    for block, hf_layer in zip(blocks, model.h, strict=True):
        block.load_state_dict(hf_layer.state_dict())
    x = inputs(2, 10)
    hf_cache = DynamicCache(config=config)
    caches = [block.allocate_cache(2, 10) for block in blocks]
    with torch.no_grad():
        for start, end in [(0, 6), (6, 7), (7, 10)]:
            out = model(
                inputs_embeds=x[:, start:end],
                use_cache=True,
                output_hidden_states=True,
                **cache_kwargs(hf_cache),
            )
            hidden = out.hidden_states[0]  # after word_embeddings_layernorm
            for i, (block, cache) in enumerate(zip(blocks, caches, strict=True)):
                hidden = block(hidden, cache=cache)
                if i + 1 < config.n_layer:
                    assert_matches(hidden, out.hidden_states[i + 1])
            assert_matches(model.ln_f(hidden), out.last_hidden_state)


def test_bf16_error_is_within_a_small_factor_of_transformers() -> None:
    config = make_config()
    hf, ours = make_pair(config)
    x = inputs(3, 24)
    with torch.no_grad():
        reference = hf_forward(hf, config, x)
        hf.to(torch.bfloat16)
        ours.to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        hf_out = torch.cat(
            [
                hf_forward(hf, config, xb[:, :16], cache := DynamicCache()),
                hf_forward(hf, config, xb[:, 16:], cache),
            ],
            dim=1,
        )
        kv = ours.allocate_cache(3, 24)
        ours_out = torch.cat([ours(xb[:, :16], cache=kv), ours(xb[:, 16:], cache=kv)], dim=1)
    assert kv.keys.dtype == torch.bfloat16
    hf_error, ours_error = max_diff(hf_out, reference), max_diff(ours_out, reference)
    # Both round weights and activations to bf16 (8 significant bits: ~0.4% per rounding), so both
    # miss the fp32 result by ~1e-2 relative.  Ours keeps ALiBi and the attention in fp32 where
    # transformers rounds alibi, scores and probabilities to bf16, so ours is usually the smaller;
    # the factor 2 leaves room for LayerNorm/GELU/residual roundings that merely fall differently.
    assert 0 < hf_error < 0.5
    assert ours_error <= 2 * hf_error


def test_cache_overflow_raises_and_leaves_the_cache_alone() -> None:
    _, ours = make_pair(make_config())
    cache = ours.allocate_cache(2, 6)
    with torch.no_grad():
        ours(inputs(2, 5), cache=cache)
        with pytest.raises(ValueError, match="cache holds 6 positions; 5 are used and 2 more"):
            ours(inputs(2, 2), cache=cache)
        assert cache.length == 5
        ours(inputs(2, 1), cache=cache)  # the last position still fits
    assert cache.length == 6


def test_misuse_raises() -> None:
    _, ours = make_pair(make_config())
    cache = ours.allocate_cache(2, 8)
    with torch.no_grad():
        ours(inputs(2, 3), cache=cache)
        for position in (2, 4):
            with pytest.raises(ValueError, match=f"the next one is 3, not {position}; roll"):
                ours(inputs(2, 1), cache=cache, position=position)
        with pytest.raises(ValueError, match="3 rows of hidden states for a cache of 2 rows"):
            ours(inputs(3, 1), cache=cache)
        with pytest.raises(ValueError, match="position must be >= 0"):
            ours(inputs(2, 1), position=-1)
        with pytest.raises(ValueError, match="T >= 1"):
            ours(inputs(2, 0), cache=cache)
    assert cache.length == 3


def test_position_without_a_cache_changes_nothing() -> None:
    _, ours = make_pair(make_config())
    x = inputs(2, 5)
    with torch.no_grad():
        assert_matches(ours(x, position=7), ours(x))


def test_a_block_built_on_meta_and_given_weights_equals_one_built_with_them() -> None:
    """How a server builds its blocks: on "meta" (no memory, no random weights), then assigned
    the checkpoint's tensors; the ALiBi slopes are computed for real either way."""
    config = BloomConfig(hidden_size=64, n_head=4)
    torch.manual_seed(0)
    built = BloomBlock(config).eval()
    with torch.device("meta"):
        block = BloomBlock(config)
    block.load_state_dict({k: v.clone() for k, v in built.state_dict().items()}, assign=True)
    assert block.positions.slopes is not None and block.positions.slopes.device.type == "cpu"
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        torch.testing.assert_close(block.eval()(x), built(x), rtol=0, atol=0)
