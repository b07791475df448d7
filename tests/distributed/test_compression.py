"""Activations and gradients sent compressed (``compression=`` on the client): generation and a
fine-tuning step through the swarm stay within the scheme's rounding of the uncompressed ones."""

from __future__ import annotations

import pytest
import torch

from petals_core import ConfigError
from petals_core.distributed import AutoDistributedModelForCausalLM

from .._served_swarm import ServedModel
from ._causal_lm import random_ids


@pytest.mark.parametrize("compression", ["float16", "blockwise8"])
def test_generation_and_fine_tuning_with_compression(
    served_llama: ServedModel, compression: str
) -> None:
    def load(**options: object) -> AutoDistributedModelForCausalLM:
        torch.manual_seed(0)
        return AutoDistributedModelForCausalLM.from_pretrained(
            served_llama.folder,
            initial_peers=served_llama.initial_peers,
            tuning_mode="ptune",
            pre_seq_len=2,
            **options,
        )

    plain, packed = load(), load(compression=compression)
    assert packed.distributed_base.remote_blocks.sequence_manager.config.compression == compression
    try:
        ids = random_ids(2, 6)
        with torch.no_grad():
            expected = plain(ids).logits
            logits = packed(ids).logits
            tokens = packed.generate(ids, max_new_tokens=4, do_sample=False)
        scale = float(expected.abs().max())
        assert float((logits - expected).abs().max()) < 0.05 * scale
        assert tokens.shape == (2, 10)
        grads = []
        for model in (plain, packed):
            model(ids, labels=ids).loss.backward()
            grad = model.distributed_base.prompt_embeddings.weight.grad
            assert grad is not None
            grads.append(grad)
        assert float((grads[1] - grads[0]).abs().max()) < 0.05 * float(grads[0].abs().max())
    finally:
        plain.shutdown()
        packed.shutdown()


def test_an_unknown_compression_is_refused(served_llama: ServedModel) -> None:
    with pytest.raises(ConfigError, match="compression is one of none, float16, blockwise8"):
        AutoDistributedModelForCausalLM.from_pretrained(
            served_llama.folder, initial_peers=served_llama.initial_peers, compression="zip"
        )
