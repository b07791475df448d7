"""Fine-tuning over the swarm: trainable prompts (ptune, deep_ptune) get the gradients of a local
reference, and the sequence-classification head equals and trains like transformers'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from petals_core.distributed import (
    AutoDistributedModelForSequenceClassification,
)
from petals_core.models import new_block
from petals_core.models.mixtral import state_from_transformers

from .._served_swarm import ServedModel
from ._causal_lm import PROMPT_LEN, load_prompt_tuned, random_ids

TOLERANCE = 1e-4


def _parts(reference: Any) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], Any, Any]:
    """(embeddings, what runs before the first block, layers, final norm) of a transformers LM."""
    if reference.config.model_type in ("llama", "mixtral"):
        base = reference.model
        return base.embed_tokens, lambda x: x, base.layers, base.norm
    base = reference.transformer
    if reference.config.model_type == "falcon":
        return base.word_embeddings, lambda x: x, base.h, base.ln_f
    return base.word_embeddings, base.word_embeddings_layernorm, base.h, base.ln_f


def _local_blocks(reference: Any) -> list[nn.Module]:
    """The blocks the servers run, with the reference's weights."""
    blocks: list[nn.Module] = []
    for index, layer in enumerate(_parts(reference)[2]):
        block = new_block(reference.config, index)
        state = layer.state_dict()
        if reference.config.model_type == "mixtral":
            state = state_from_transformers(state)
        block.load_state_dict(state)
        blocks.append(block.eval())
    return blocks


def _reference_loss(
    reference: Any,
    ids: torch.Tensor,
    shallow: torch.Tensor,
    deep: torch.Tensor | None = None,
    blocks: list[nn.Module] | None = None,
) -> torch.Tensor:
    """The loss with ``shallow`` ``(P, hidden)`` prepended, and ``deep`` ``(blocks, P, hidden)``
    added to the first P positions before each block (through ``blocks``, as the servers)."""
    embed, prepare, _, norm = _parts(reference)
    embeddings = torch.cat([shallow.expand(ids.shape[0], -1, -1), embed(ids)], dim=1)
    if deep is None:
        logits = reference(inputs_embeds=embeddings).logits
    else:
        assert blocks is not None
        x = prepare(embeddings)
        for index, block in enumerate(blocks):
            x = torch.cat([x[:, :PROMPT_LEN] + deep[index], x[:, PROMPT_LEN:]], dim=1)
            x = block(x)
        logits = reference.lm_head(norm(x))
    return reference.loss_function(
        logits=logits[:, PROMPT_LEN:].contiguous(),
        labels=ids,
        vocab_size=reference.config.vocab_size,
    )


def _load_causal(served: ServedModel, tuning_mode: str) -> tuple[Any, Any]:
    model = load_prompt_tuned(served, tuning_mode)
    reference = AutoModelForCausalLM.from_pretrained(served.folder).eval()
    reference.requires_grad_(False)
    return model, reference


def test_ptune_gradients_equal_a_local_reference_and_a_step_lowers_the_loss(
    served: ServedModel,
) -> None:
    model, reference = _load_causal(served, "ptune")
    try:
        base = model.distributed_base
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        assert trainable == [f"{model.base_model_prefix}.prompt_embeddings.weight"]
        ids = random_ids(2, 6, seed=1)

        outputs = model(ids, labels=ids)
        assert outputs.logits.shape == (2, 6, 256)  # the prompt positions are dropped
        outputs.loss.backward()
        shallow = base.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        expected = _reference_loss(reference, ids, shallow)
        expected.backward()
        torch.testing.assert_close(outputs.loss, expected, atol=TOLERANCE, rtol=0)
        assert base.prompt_embeddings.weight.grad is not None
        torch.testing.assert_close(
            base.prompt_embeddings.weight.grad, shallow.grad, atol=TOLERANCE, rtol=1e-3
        )

        optimizer = torch.optim.Adam([base.prompt_embeddings.weight], lr=1e-2)
        losses = [outputs.loss.item()]
        for _ in range(3):
            optimizer.step()
            optimizer.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        assert losses[-1] < losses[0]

        # Generation sends the prompts at position 0, as the reference sees them.
        with torch.no_grad():
            prompts = base.prompt_embeddings.weight.detach()
            embeddings = torch.cat([prompts[None], _parts(reference)[0](ids[:1])], dim=1)
        settings = {"do_sample": False, "max_new_tokens": 4, "eos_token_id": None}
        ours = model.generate(ids[:1], pad_token_id=0, **settings)
        theirs = reference.generate(inputs_embeds=embeddings, pad_token_id=0, **settings)
        assert torch.equal(ours[:, 6:], theirs[:, -4:])

        # The servers hold the prompts too; positions the model reports count tokens only.
        with torch.no_grad(), model.inference_session(max_length=4) as session:
            model(ids[:1, :2])
            assert (session.position, session.token_position) == (PROMPT_LEN + 2, 2)
            with pytest.raises(ValueError, match="trainable-prompt"):
                session.position = 1
    finally:
        model.shutdown()


def test_deep_ptune_gradients_come_back_from_the_servers(served: ServedModel) -> None:
    model, reference = _load_causal(served, "deep_ptune")
    try:
        base = model.distributed_base
        config = reference.config
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        prefix = model.base_model_prefix
        assert trainable == {
            f"{prefix}.prompt_embeddings.weight",
            f"{prefix}.intermediate_prompt_embeddings.weight",
        }
        ids = random_ids(2, 5, seed=2)
        loss = model(ids, labels=ids).loss
        loss.backward()

        shallow = base.prompt_embeddings.weight.detach().clone().requires_grad_(True)
        flat = base.intermediate_prompt_embeddings.weight.detach().clone().requires_grad_(True)
        deep = flat.view(PROMPT_LEN, config.num_hidden_layers, config.hidden_size).transpose(0, 1)
        expected = _reference_loss(reference, ids, shallow, deep, _local_blocks(reference))
        expected.backward()

        torch.testing.assert_close(loss, expected, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(
            base.prompt_embeddings.weight.grad, shallow.grad, atol=TOLERANCE, rtol=1e-3
        )
        torch.testing.assert_close(
            base.intermediate_prompt_embeddings.weight.grad, flat.grad, atol=TOLERANCE, rtol=1e-3
        )
        assert flat.grad is not None and bool(flat.grad.abs().sum() > 0)
    finally:
        model.shutdown()


def test_sequence_classification_equals_transformers_and_trains(served: ServedModel) -> None:
    labels, pad = 3, 1  # config overrides, for both models
    torch.manual_seed(3)
    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        served.folder, initial_peers=served.initial_peers, num_labels=labels, pad_token_id=pad
    )
    try:
        reference = AutoModelForSequenceClassification.from_pretrained(
            served.folder, num_labels=labels, pad_token_id=pad
        ).eval()
        with torch.no_grad():
            reference.score.weight.copy_(model.score.weight)
        assert model.config.pad_token_id == pad
        ids = random_ids(3, 7, seed=4)
        mask = torch.ones_like(ids)
        ids[1, 4:], mask[1, 4:] = pad, 0  # right padding: the score reads token 3 of row 1
        with torch.no_grad():
            ours = model(ids, attention_mask=mask).logits
            theirs = reference(ids, attention_mask=mask).logits
        assert ours.shape == (3, labels)
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
        # logits_to_keep is the causal LM's: refused before anything is sent.
        with pytest.raises(ValueError, match="logits_to_keep is a causal LM's"), torch.no_grad():
            model(ids, attention_mask=mask, logits_to_keep=1)

        assert [n for n, p in model.named_parameters() if p.requires_grad] == ["score.weight"]
        before = model.score.weight.detach().clone()
        targets = torch.tensor([0, 1, 2])
        optimizer = torch.optim.Adam([model.score.weight], lr=5e-2)
        losses = []
        for _ in range(4):
            loss = model(ids, attention_mask=mask, labels=targets).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0]
        assert not torch.equal(model.score.weight, before)
    finally:
        model.shutdown()
