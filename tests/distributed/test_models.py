"""Distributed models over a real (in-process) swarm equal transformers' models on the same
checkpoint, and load nothing but the client's tensors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

import petals_core
from petals_core import ConfigError
from petals_core.distributed import (
    AutoDistributedModel,
    AutoDistributedModelForCausalLM,
    ChunkedLMHead,
    DistributedBloomForCausalLM,
    DistributedLlamaForCausalLM,
    DistributedLlamaModel,
)

from .._served_swarm import ServedModel
from ._causal_lm import random_ids

TOLERANCE = 1e-4


def test_logits_and_loss_equal_transformers(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(3, 9)
    with torch.no_grad():
        ours = model(ids, labels=ids)
        theirs = reference(ids, labels=ids)
    assert ours.logits.shape == (3, 9, 256)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=TOLERANCE, rtol=0)
    # transformers' logits_to_keep: only the last position through the head.
    with torch.no_grad():
        last = model(ids, logits_to_keep=1).logits
    torch.testing.assert_close(last, theirs.logits[:, -1:], atol=TOLERANCE, rtol=0)


def test_logits_to_keep_selects_positions_as_transformers(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(2, 7)
    with torch.no_grad():
        theirs = reference(ids).logits
        every = model(ids, logits_to_keep=0).logits
        last_three = model(ids, logits_to_keep=3).logits
        chosen = model(ids, logits_to_keep=torch.tensor([0, 4, 6])).logits
    torch.testing.assert_close(every, theirs, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(last_three, theirs[:, -3:], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(chosen, theirs[:, [0, 4, 6]], atol=TOLERANCE, rtol=0)
    bad_values = (-1, True, 1.5, torch.tensor([[0, 1]]), torch.tensor([0.0]), torch.tensor([True]))
    for bad in bad_values:
        with pytest.raises(ValueError, match="logits_to_keep"), torch.no_grad():
            model(ids, logits_to_keep=bad)
    # Refused before the step is sent: the session holds nothing more, and goes on.
    with torch.no_grad(), model.inference_session(max_length=8) as session:
        for bad in bad_values:
            with pytest.raises(ValueError, match="logits_to_keep"):
                model(ids[:, :3], logits_to_keep=bad)
        assert session.token_position == 0
        first = model(ids[:, :3], logits_to_keep=1).logits
    torch.testing.assert_close(first, theirs[:, 2:3], atol=TOLERANCE, rtol=0)


def test_right_padding_equals_transformers_with_its_mask(models: tuple[Any, Any]) -> None:
    model, reference = models
    ids = random_ids(2, 8, seed=1)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        theirs = reference(ids, attention_mask=mask).logits
    # Causal attention never lets a real token see the pads after it.
    torch.testing.assert_close(ours[0], theirs[0], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(ours[1, :5], theirs[1, :5], atol=TOLERANCE, rtol=0)


def test_masks_and_positions_the_servers_cannot_honour_are_refused(
    models: tuple[Any, Any],
) -> None:
    model, _ = models
    ids = random_ids(2, 6, seed=2)
    left_padded = torch.ones_like(ids)
    left_padded[1, :2] = 0
    with pytest.raises(ValueError, match="left padding"):
        model(ids, attention_mask=left_padded)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=torch.arange(1, 7)[None])


def test_only_client_tensors_are_local_and_none_train(
    models: tuple[Any, Any], served: ServedModel
) -> None:
    model, reference = models
    names = {name for name, _ in model.named_parameters()}
    assert not any(".layers." in name or ".h." in name for name in names)
    assert len(model.distributed_base.remote_blocks) == reference.config.num_hidden_layers
    assert not [name for name, p in model.named_parameters() if p.requires_grad]
    assert model.config.dht_prefix == served.dht_prefix
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight


def test_base_model_equals_transformers(served: ServedModel) -> None:
    model = AutoDistributedModel.from_pretrained(served.folder, initial_peers=served.initial_peers)
    reference = AutoModel.from_pretrained(served.folder).eval()
    ids = random_ids(2, 7, seed=3)
    try:
        with torch.no_grad():
            ours = model(ids).last_hidden_state
            theirs = reference(ids).last_hidden_state
        torch.testing.assert_close(ours, theirs, atol=TOLERANCE, rtol=0)
    finally:
        model.shutdown()


def test_family_classes_refuse_other_families(
    served_llama: ServedModel, served_bloom: ServedModel
) -> None:
    with pytest.raises(ConfigError, match="model_type"):
        DistributedLlamaForCausalLM.from_pretrained(served_bloom.folder)
    with pytest.raises(ConfigError, match="model_type"):
        DistributedBloomForCausalLM.from_pretrained(served_llama.folder)
    with pytest.raises(ConfigError, match="tuning_mode"):
        DistributedLlamaModel.from_pretrained(served_llama.folder, tuning_mode="lora")
    with pytest.raises(ConfigError, match="pre_seq_len"):
        DistributedLlamaModel.from_pretrained(served_llama.folder, tuning_mode="ptune")
    with pytest.raises(ConfigError, match="request_timeout_s or request_timeout"):
        DistributedLlamaModel.from_pretrained(
            served_llama.folder, request_timeout=1.0, request_timeout_s=2.0
        )


def test_config_overrides_dtype_and_manager_options(served_llama: ServedModel) -> None:
    model = DistributedLlamaForCausalLM.from_pretrained(
        served_llama.folder,
        initial_peers=served_llama.initial_peers,
        torch_dtype=torch.bfloat16,
        request_timeout_s=30.0,
        ban_timeout=3.0,  # Petals' name of ban_timeout_s
        dht_prefix="another-swarm",
        rms_norm_eps=1e-3,
    )
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.config.rms_norm_eps == 1e-3
    manager = model.model.layers.sequence_manager
    assert (manager.config.request_timeout_s, manager.config.ban_timeout_s) == (30.0, 3.0)
    assert manager.config.dht_prefix == "another-swarm"
    assert manager.config.initial_peers == served_llama.initial_peers


def test_the_client_node_listens_where_it_reaches_its_peers(served_llama: ServedModel) -> None:
    """On loopback peers it stays on loopback; on every interface (as for peers on other
    machines, which a loopback socket cannot reach) it reaches loopback peers as well."""
    ids = random_ids(1, 5, seed=3)
    outputs = {}
    for host, listens_on in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        model = AutoDistributedModelForCausalLM.from_pretrained(
            served_llama.folder, initial_peers=served_llama.initial_peers, host=host
        )
        try:
            outputs[host] = model.generate(ids, max_new_tokens=3, do_sample=False)
            dht = model.model.layers.sequence_manager.state.dht
            assert dht is not None and dht.listen_multiaddr.host == listens_on
        finally:
            model.shutdown()
    assert torch.equal(outputs[None], outputs["0.0.0.0"])


def test_chunked_lm_head_is_the_same_matmul() -> None:
    torch.manual_seed(0)
    head = ChunkedLMHead(16, 1000, chunk_rows=96)
    torch.nn.init.normal_(head.weight)
    # A few rows (decoding: one matmul) and many (prefill: chunks of the vocabulary).
    for hidden in (torch.randn(2, 5, 16), torch.randn(2, 40, 16)):
        torch.testing.assert_close(head(hidden), F.linear(hidden, head.weight), atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="chunk_rows"):
        ChunkedLMHead(16, 1000, chunk_rows=0)


def test_root_package_exports_lazily() -> None:
    assert petals_core.AutoDistributedModelForCausalLM is AutoDistributedModelForCausalLM
    assert petals_core.DistributedLlamaForCausalLM is DistributedLlamaForCausalLM
    with pytest.raises(AttributeError):
        _ = petals_core.NoSuchThing
