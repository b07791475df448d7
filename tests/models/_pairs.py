"""A transformers model and a chain of our blocks holding the same weights, and the scenarios the
block tests run on such a pair: beams reordered, rollback and resend, gradients through a soft
prompt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from transformers import DynamicCache, PretrainedConfig

from petals_core._hf_compat import cache_kwargs
from petals_core.models import KVCache

from ._steps import twin_cache


class BlockPair:
    """transformers' base model ``hf`` (without its final norm), its decoder layers ``layers``
    and our ``blocks``, one per layer, loaded from them, all holding the same random weights.

    A family's pair names its classes: ``model_class`` (transformers' base model), whose layers
    are its attribute ``layers_name`` and whose final norm is ``final_norm``; ``block_class``
    (ours); ``is_norm(name)``, which of the model's parameters are a norm's; and ``convert``, the
    map from a layer's state dict to a block's, where their names or layouts differ."""

    model_class: Callable[[PretrainedConfig], nn.Module]
    block_class: Callable[[PretrainedConfig, int], nn.Module]
    layers_name: str
    final_norm: str
    config: PretrainedConfig
    hf: nn.Module
    layers: nn.ModuleList
    blocks: list[Any]

    def __init__(self, config: PretrainedConfig, seed: int = 0) -> None:
        """Push ``hf``'s weights (drawn after ``manual_seed(seed)``) far from their
        near-identity init, so that every part of a block shows in outputs: a norm's weights
        around 1, its biases around 0, the rest N(0, 0.15); drop its final norm (compare the last
        layer's output) and build a block per layer with the layer's weights."""
        torch.manual_seed(seed)
        self.config = config
        self.hf = self.model_class(config).eval()
        with torch.no_grad():
            for name, param in self.hf.named_parameters():
                if self.is_norm(name):
                    param.copy_(
                        (1 if name.endswith("weight") else 0) + 0.2 * torch.randn_like(param)
                    )
                else:
                    param.normal_(0, 0.15)
        setattr(self.hf, self.final_norm, nn.Identity())
        layers = getattr(self.hf, self.layers_name)
        self.layers = layers
        self.blocks = [self.block_class(config, i).eval() for i in range(len(layers))]
        for block, layer in zip(self.blocks, layers, strict=True):
            block.load_state_dict(self.convert(layer.state_dict()))

    @staticmethod
    def is_norm(name: str) -> bool:
        return "layernorm" in name

    @staticmethod
    def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def inputs(self, batch: int, length: int, seed: int = 1) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randn(batch, length, self.config.hidden_size, generator=generator)

    def hf_run(self, x: torch.Tensor, cache: DynamicCache | None = None, **kwargs: Any) -> Any:
        out = self.hf(inputs_embeds=x, use_cache=cache is not None, **cache_kwargs(cache), **kwargs)
        return out.last_hidden_state

    def caches(self, batch: int, max_length: int) -> list[KVCache]:
        return [block.allocate_cache(batch, max_length) for block in self.blocks]

    def run(self, x: torch.Tensor, caches: list[KVCache] | None = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i])
        return x


class Reordered(NamedTuple):
    """What :func:`reorder_and_decode` computed, to compare."""

    ours: torch.Tensor  # our blocks' decode steps after the reorder
    hf: torch.Tensor  # transformers' decode steps after reordering its cache
    fresh: torch.Tensor  # our blocks on the surviving rows' sequences from scratch, decoded part

    def assert_close(self) -> None:
        """Ours equal to transformers' and to the fresh run, to float32 rounding at their scale."""
        assert_close_to_scale(self.ours, self.hf)
        assert_close_to_scale(self.ours, self.fresh)


def reorder_and_decode(
    pair: BlockPair, x: torch.Tensor, hypo_ids: torch.Tensor, *, prefill: int
) -> Reordered:
    """Prefill ``x[:, :prefill]``, reorder the rows by ``hypo_ids`` (beam search) in our caches and
    transformers', then decode the rest of ``x`` token by token."""
    length = x.shape[1]
    hf_cache, caches = DynamicCache(config=pair.config), pair.caches(x.shape[0], length)
    with torch.no_grad():
        pair.run(x[:, :prefill], caches)
        pair.hf_run(x[:, :prefill], hf_cache)
        for cache in caches:
            cache.reorder(hypo_ids)
        hf_cache.reorder_cache(hypo_ids)
        steps = range(prefill, length)
        ours = torch.cat([pair.run(x[:, t : t + 1], caches) for t in steps], dim=1)
        theirs = torch.cat([pair.hf_run(x[:, t : t + 1], hf_cache) for t in steps], dim=1)
        # The surviving rows' prefixes, then the decoded tokens.
        fresh = torch.cat([x[hypo_ids, :prefill], x[:, prefill:]], dim=1)
        return Reordered(ours=ours, hf=theirs, fresh=pair.run(fresh)[:, prefill:])


class Resumed(NamedTuple):
    """What :func:`roll_back_and_resume` computed, to compare."""

    resumed: torch.Tensor  # our blocks' outputs of the resent tokens, after the rollback
    fresh: torch.Tensor  # our blocks on the whole new sequence from scratch, its resent part
    hf_fresh: torch.Tensor  # the same through transformers
    hf_cropped: torch.Tensor  # transformers' cache cropped to ``keep``, then the resent chunk
    chunk: int

    def assert_close(self) -> None:
        """The resent tokens equal to every other way of computing them, to float32 rounding at
        their scale."""
        assert_close_to_scale(self.resumed, self.hf_fresh)
        assert_close_to_scale(self.resumed, self.fresh)
        assert_close_to_scale(self.resumed[:, : self.chunk], self.hf_cropped)


def roll_back_and_resume(
    pair: BlockPair, x: torch.Tensor, continuation: torch.Tensor, *, prefill: int, keep: int
) -> Resumed:
    """Run ``x`` (a prefill of ``prefill`` positions, then single tokens), roll every cache back
    to ``keep`` positions and resend ``continuation``: a chunk, then its last two tokens singly."""
    length, new = x.shape[1], continuation.shape[1]
    chunk = new - 2
    caches = pair.caches(x.shape[0], max(length, keep + new))
    with torch.no_grad():
        pair.run(x[:, :prefill], caches)
        for t in range(prefill, length):
            pair.run(x[:, t : t + 1], caches)
        for cache in caches:
            cache.rollback(keep)
        # A chunk then single tokens from position ``keep``, over the cache's first positions.
        resumed = torch.cat(
            [pair.run(continuation[:, :chunk], caches)]
            + [pair.run(continuation[:, t : t + 1], caches) for t in range(chunk, new)],
            dim=1,
        )
        sequence = torch.cat([x[:, :keep], continuation], dim=1)
        hf_cache = DynamicCache(config=pair.config)
        pair.hf_run(x, hf_cache)
        hf_cache.crop(keep - length)  # a negative count: the positions to drop
        return Resumed(
            resumed=resumed,
            fresh=pair.run(sequence)[:, keep:],
            hf_fresh=pair.hf_run(sequence)[:, keep:],
            hf_cropped=pair.hf_run(continuation[:, :chunk], hf_cache),
            chunk=chunk,
        )


def soft_prompt_gradients(
    pair: BlockPair, *, length: int, prompt_length: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Gradients w.r.t. the input, a soft prompt on the first positions and every weight, of a
    random projection of the output: (ours, transformers'), in the same order."""
    x = pair.inputs(2, length)
    weights = pair.inputs(2, length, seed=3)  # the loss is a random projection of the output
    hidden = pair.config.hidden_size

    def grads(run: Any, params: list[nn.Parameter]) -> list[torch.Tensor]:
        inputs = x.clone().requires_grad_()
        prompt = torch.zeros(1, prompt_length, hidden, requires_grad=True)
        with torch.no_grad():
            prompt.normal_(generator=torch.Generator().manual_seed(4))
        padded = nn.functional.pad(prompt, (0, 0, 0, length - prompt_length))
        loss = (run(inputs + padded) * weights).sum()
        return list(torch.autograd.grad(loss, [inputs, prompt, *params]))

    ours = grads(pair.run, [p for block in pair.blocks for p in block.parameters()])
    theirs = grads(pair.hf_run, [p for layer in pair.layers for p in layer.parameters()])
    return ours, theirs


def assert_close_to_scale(
    ours: torch.Tensor, theirs: torch.Tensor, what: object = "", *, atol: float = 1e-5
) -> None:
    """Within ``atol`` of the outputs' scale (float32 rounding is relative)."""
    scale = max(1.0, theirs.abs().max().item())
    diff = (ours.float() - theirs.float()).abs().max().item()
    assert diff <= atol * scale, f"{what}: max abs diff {diff:.3g} at scale {scale:.3g}"


def bfloat16_pieces(pair: BlockPair, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` of 12 positions through a bf16 copy of our blocks in pieces (a prefill of 8, a
    token, a chunk of 3) through caches, and through the float32 blocks at once: (bf16 outputs
    as float32, float32 outputs)."""
    blocks = [pair.block_class(pair.config, i).to(torch.bfloat16) for i in range(len(pair.blocks))]
    for ours, block in zip(blocks, pair.blocks, strict=True):
        ours.load_state_dict(block.state_dict())
    caches = [block.allocate_cache(x.shape[0], 12) for block in blocks]
    with torch.no_grad():
        exact = pair.run(x)
        outputs = []
        for start, end in [(0, 8), (8, 9), (9, 12)]:
            y = x.bfloat16()[:, start:end]
            for block, cache in zip(blocks, caches, strict=True):
                y = block(y, cache=cache)
            outputs.append(y)
    got = torch.cat(outputs, dim=1).float()
    assert got.isfinite().all()
    return got, exact


def check_prefill_chunk_and_decode(pair: BlockPair) -> None:
    """The whole sequence without a cache, then a prefill, a chunk and single tokens through
    caches: each equal to transformers' (the same steps through a ``DynamicCache``)."""
    batch, prefill, chunk, steps = 2, 10, 7, 5
    x = pair.inputs(batch, prefill + chunk + steps)
    hf_cache, caches = DynamicCache(config=pair.config), pair.caches(batch, 32)
    with torch.no_grad():
        assert_close_to_scale(pair.run(x), pair.hf_run(x), "no cache")
        pieces = [(0, prefill), (prefill, prefill + chunk)]
        pieces += [(t, t + 1) for t in range(prefill + chunk, x.shape[1])]
        for start, end in pieces:
            ours = pair.run(x[:, start:end], caches)
            assert_close_to_scale(ours, pair.hf_run(x[:, start:end], hf_cache), (start, end))
    assert all(cache.length == x.shape[1] for cache in caches)


def check_left_padded_batch(pair: BlockPair) -> None:
    """Batched generation: padding hidden from real tokens, positions counted from each row's
    first real token, as transformers given the mask and position ids; only the real tokens'
    outputs are compared."""
    padding = torch.tensor([0, 3])
    x = pair.inputs(2, 10)
    mask = (torch.arange(10)[None] >= padding[:, None]).long()  # (2, 10)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = pair.caches(2, 10)
    for cache in caches:
        cache.set_padding(padding)
    with torch.no_grad():
        expected = pair.hf_run(x, attention_mask=mask, position_ids=position_ids)
        ours = torch.cat(
            [pair.run(x[:, :7], caches)] + [pair.run(x[:, t : t + 1], caches) for t in (7, 8, 9)],
            dim=1,
        )
    real = mask.bool()
    assert_close_to_scale(ours[real], expected[real])


def check_forward_many(block: Any, hidden: int, *, atol: float = 1e-5) -> None:
    """``forward_many`` over four sessions of different lengths, rows and new tokens equals each
    session's own step; a refused item leaves every cache as it was."""
    # (cache length before the step, rows, new tokens) for each session.
    specs = [(5, 1, 1), (0, 2, 4), (9, 2, 1), (3, 1, 3)]
    generator = torch.Generator().manual_seed(3)
    caches = []
    with torch.no_grad():
        for length, rows, _ in specs:
            cache = block.allocate_cache(rows, 16)
            if length:
                block(torch.randn(rows, length, hidden, generator=generator), cache=cache)
            caches.append(cache)
    twins = [twin_cache(cache) for cache in caches]
    steps = [torch.randn(rows, new, hidden, generator=generator) for _, rows, new in specs]
    with torch.no_grad():
        expected = [block(h, cache=c) for h, c in zip(steps, twins, strict=True)]
    got = block.forward_many(steps, caches)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=atol)
    for cache, twin in zip(caches, twins, strict=True):
        assert cache.length == twin.length
        torch.testing.assert_close(cache.keys, twin.keys, atol=atol, rtol=atol)
    assert block.forward_many([], []) == []
    lengths = [cache.length for cache in caches]
    with pytest.raises(ValueError, match=r"item 3: .*\(batch"):
        block.forward_many([*steps[:3], torch.randn(1, 1, hidden + 1)], caches)
    assert [cache.length for cache in caches] == lengths
