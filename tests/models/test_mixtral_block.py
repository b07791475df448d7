"""MixtralBlock against transformers' Mixtral layers, in float32: prefill, chunks, decode, left
padding, beams, rollback, batched sessions and gradients; the router as transformers', and the
experts grouped by expert across sessions."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import MixtralConfig, MixtralModel

from petals_core.models import MixtralBlock
from petals_core.models.mixtral import state_from_transformers as from_transformers
from petals_core.testing import tiny_mixtral_config

from ._pairs import (
    BlockPair,
    assert_close_to_scale,
    bfloat16_pieces,
    check_forward_many,
    check_left_padded_batch,
    check_prefill_chunk_and_decode,
    reorder_and_decode,
    roll_back_and_resume,
    soft_prompt_gradients,
)

torch.set_num_threads(1)

HIDDEN = 64
ATOL = 1e-5


def _config(**overrides: Any) -> MixtralConfig:
    settings: dict[str, Any] = dict(num_hidden_layers=2, vocab_size=16, max_position_embeddings=64)
    return tiny_mixtral_config(**{**settings, **overrides})


CONFIGS = {
    # Mixtral-8x7B's routing: 8 experts, the best 2 per token; its rope_theta.
    "8x2": _config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Another routing and heads of their own width.
    "4x3": _config(num_local_experts=4, num_experts_per_tok=3, head_dim=32),
}


class Pair(BlockPair):
    """transformers' MixtralModel and a chain of our blocks holding the same random weights."""

    model_class, block_class = MixtralModel, MixtralBlock
    layers_name, final_norm = "layers", "norm"
    convert = staticmethod(from_transformers)


def test_parameter_names_are_the_original_checkpoints(tmp_path: Any) -> None:
    """transformers saves Mixtral under the original names: a saved layer loads as it is."""
    from safetensors.torch import load_file

    config = CONFIGS["8x2"]
    torch.manual_seed(0)
    from transformers import MixtralForCausalLM

    MixtralForCausalLM(config).save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.1."
    layer = {k.removeprefix(prefix): v for k, v in stored.items() if k.startswith(prefix)}
    block = MixtralBlock(config, 1)
    assert sorted(block.state_dict()) == sorted(layer)
    block.load_state_dict(layer)  # strict
    assert "block_sparse_moe.experts.7.w2.weight" in layer


def test_router_picks_and_weighs_as_transformers() -> None:
    pair = Pair(CONFIGS["8x2"])
    moe, hf_moe = pair.blocks[0].block_sparse_moe, pair.hf.layers[0].mlp
    x = pair.inputs(3, 7).reshape(-1, HIDDEN)
    experts, weights = moe.route(x)
    _, hf_weights, hf_experts = hf_moe.gate(x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, atol=0, rtol=0)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.sum(-1), torch.ones(21))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_chunk_and_decode_match_transformers(name: str) -> None:
    check_prefill_chunk_and_decode(Pair(CONFIGS[name]))


def test_batch_of_three_reordered_by_hypo_ids() -> None:
    pair = Pair(CONFIGS["8x2"])
    got = reorder_and_decode(pair, pair.inputs(3, 14), torch.tensor([2, 0, 0]), prefill=9)
    got.assert_close()


def test_rollback_then_continue_equals_a_fresh_run() -> None:
    pair = Pair(CONFIGS["4x3"])
    x, continuation = pair.inputs(2, 12), pair.inputs(2, 6, seed=2)
    got = roll_back_and_resume(pair, x, continuation, prefill=9, keep=6)
    got.assert_close()


def test_left_padded_batch_matches_transformers_with_a_mask() -> None:
    check_left_padded_batch(Pair(CONFIGS["8x2"]))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gradients_match_transformers(name: str) -> None:
    """Gradients w.r.t. the input, a soft prompt on the first positions and every weight (the
    experts' weights under the original names, fused in transformers' order)."""
    pair = Pair(CONFIGS[name])
    ours, theirs = soft_prompt_gradients(pair, length=12, prompt_length=3)
    assert_close_to_scale(ours[0], theirs[0], "input")
    assert_close_to_scale(ours[1], theirs[1], "prompt")
    ours_by_name = dict(
        zip(
            [
                f"{i}.{n}"
                for i, block in enumerate(pair.blocks)
                for n, _ in block.named_parameters()
            ],
            ours[2:],
            strict=True,
        )
    )
    layer_grads = iter(theirs[2:])
    for i, layer in enumerate(pair.layers):
        grads = {n: next(layer_grads) for n, _ in layer.named_parameters()}
        for name_, grad in from_transformers(grads).items():
            assert_close_to_scale(ours_by_name[f"{i}.{name_}"], grad, name_)


def test_forward_many_equals_one_by_one_and_runs_each_expert_once() -> None:
    block = Pair(CONFIGS["8x2"]).blocks[1]
    check_forward_many(block, HIDDEN, atol=ATOL)
    # Every session's tokens go through each expert they chose, in one call per expert.
    steps = [torch.randn(rows, new, HIDDEN) for rows, new in [(1, 1), (2, 4), (2, 1), (1, 3)]]
    caches = [block.allocate_cache(states.shape[0], 8) for states in steps]
    calls: list[int] = []  # tokens per expert call
    hooks = [
        expert.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
        for expert in block.block_sparse_moe.experts
    ]
    try:
        block.forward_many(steps, caches)
    finally:
        for hook in hooks:
            hook.remove()
    tokens = sum(states.shape[0] * states.shape[1] for states in steps)
    assert len(calls) <= 8
    assert sum(calls) == tokens * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_static_path_of_a_decode_graph_equals_the_eager_one(dtype: torch.dtype) -> None:
    """In a CUDA graph every expert runs on every row (nothing may wait for the device): the
    same sums in the same order (products of more rows at once may round differently).  An
    expert a row did not choose adds exactly nothing, even where it overflows on that row
    (0 * inf would be NaN)."""
    moe = Pair(CONFIGS["8x2"]).blocks[0].block_sparse_moe.to(dtype)
    x = torch.randn(5, 3, HIDDEN).to(dtype)
    with torch.no_grad():
        torch.testing.assert_close(moe(x, static=True), moe(x))
        experts, _ = moe.route(x.reshape(-1, HIDDEN))
        unchosen = next(e for e in range(moe.num_experts) if not (experts == e).any(-1).all())
        moe.experts[unchosen].w2.weight.fill_(float("inf"))
        eager, static = moe(x), moe(x, static=True)
        rows = ~(experts == unchosen).any(-1)  # tokens that did not choose it
        assert torch.isfinite(static.reshape(-1, HIDDEN)[rows]).all()
        torch.testing.assert_close(static, eager, equal_nan=True)


def test_bfloat16_runs_close_to_float32() -> None:
    pair = Pair(CONFIGS["8x2"])
    got, exact = bfloat16_pieces(pair, pair.inputs(2, 12))
    # A token near a tie between two experts may switch experts in bf16: compare most tokens.
    close = (got - exact).abs().amax(-1) <= 5e-2 * exact.abs().max()
    assert close.float().mean() >= 0.9


def test_bad_configs_and_positions_past_the_window_are_refused() -> None:
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in 1\.\.8"):
        MixtralBlock(_config(num_experts_per_tok=9))
    block = MixtralBlock(_config(sliding_window=8))
    cache = block.allocate_cache(1, 16)
    with torch.no_grad():
        block(torch.randn(1, 8, HIDDEN), cache=cache)  # up to the window: fine
        with pytest.raises(ValueError, match="past the sliding window of 8"):
            block(torch.randn(1, 1, HIDDEN), cache=cache)
        with pytest.raises(ValueError, match="past the sliding window of 8"):
            block.forward_many([torch.randn(1, 1, HIDDEN)], [cache])
        with pytest.raises(ValueError, match="past the sliding window of 8"):
            block(torch.randn(1, 9, HIDDEN))
    assert cache.length == 8


def test_bad_inputs_get_the_blocks_errors() -> None:
    block = MixtralBlock(_config(sliding_window=8))
    cache = block.allocate_cache(1, 4)
    with pytest.raises(ValueError, match=r"\(batch, T >= 1, 64\)"):
        block(torch.randn(1, 65), cache=cache)
    with pytest.raises(ValueError, match=r"item 0: .*\(batch"):
        block.forward_many([torch.randn(1, 1, 65)], [cache])
    assert cache.length == 0
