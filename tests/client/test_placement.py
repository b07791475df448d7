"""A client whose tensors live elsewhere than the servers' (another dtype, a GPU): what comes back
from the servers follows what was sent (hidden states, gradients of inputs and prompts), and
equals the same client in float32 on the CPU.

fp32 CPU servers throughout. The CPU runs cover dtypes (float64, which servers refuse and which
travels as float32; bfloat16); the CUDA cases run the same checks with the client on a GPU, and
are skipped where there is none.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from petals_core.client import RemoteSequential
from petals_core.client._placement import like, to_wire
from petals_core.distributed import (
    AutoDistributedModelForCausalLM,
    AutoDistributedModelForSequenceClassification,
)

from .._served_swarm import ServedModel
from ..distributed._causal_lm import load_prompt_tuned, no_eos, random_ids
from ._swarm_helpers import HIDDEN, N_BLOCKS, manager_for, training_inputs

#: Outputs in float32 on another device, or in float64 (sent as float32), equal the CPU's up to
#: this.
TOLERANCE = 1e-4
#: bfloat16 keeps 8 bits of mantissa: outputs of order 1-10 differ from float32 by this much.
BF16_TOLERANCE = 0.15

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: (device, dtype) of the client under test; the reference is the same client on the CPU in
#: float32.
PLACEMENTS = [
    pytest.param("cpu", torch.float64, id="cpu-float64"),
    pytest.param("cuda", torch.float32, id="cuda-float32", marks=CUDA),
    pytest.param("cuda", torch.float64, id="cuda-float64", marks=CUDA),
]
BF16_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=CUDA),
]


def _assert_on(tensor: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    assert (tensor.device.type, tensor.dtype) == (device, dtype)


# -- the wire ------------------------------------------------------------------------------------


def test_to_wire_gives_cpu_tensors_in_a_dtype_every_server_takes() -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64).transpose(0, 1)  # not contiguous
    sent = to_wire(x, "hidden states")
    assert (sent.device.type, sent.dtype, sent.shape) == ("cpu", torch.float32, (3, 2, 4))
    assert sent.is_contiguous()
    torch.testing.assert_close(sent, x.float())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert to_wire(x.to(dtype), "hidden states").dtype == dtype
    back = like(sent, x)
    assert back.dtype == torch.float64 and torch.equal(back, sent.double())


def test_to_wire_refuses_what_cannot_be_sent() -> None:
    with pytest.raises(ValueError, match="hidden states must be a floating-point tensor"):
        to_wire(torch.ones(2, 3, 4, dtype=torch.int64), "hidden states")
    with pytest.raises(ValueError, match="deep prompts must be a floating-point tensor"):
        to_wire([[1.0]], "deep prompts")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="meta device"):
        to_wire(torch.empty(2, 3, 4, device="meta"), "hidden states")


# -- RemoteSequential ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sequential(served_llama: ServedModel) -> Iterator[RemoteSequential]:
    seq = RemoteSequential(
        manager_for(initial_peers=served_llama.initial_peers, dht_prefix=served_llama.dht_prefix)
    )
    yield seq
    seq.shutdown()


def _forward_backward(
    seq: RemoteSequential, x: torch.Tensor, prompts: torch.Tensor, grad_output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    prompts = prompts.detach().clone().requires_grad_(True)
    output = seq(x, prompts)
    output.backward(grad_output)
    assert x.grad is not None and prompts.grad is not None
    return output.detach(), x.grad, prompts.grad


@pytest.mark.parametrize(("device", "dtype"), PLACEMENTS)
def test_remote_sequential_answers_on_the_device_and_in_the_dtype_of_its_inputs(
    sequential: RemoteSequential, device: str, dtype: torch.dtype
) -> None:
    x, prompts, grad_output = training_inputs(1, rows=2, length=5)
    expected = _forward_backward(sequential, x, prompts, grad_output)

    # The prompts stay in float32 on the CPU: each gradient follows its own input.
    output, grad, prompt_grad = _forward_backward(
        sequential, x.to(device, dtype), prompts, grad_output.to(device, dtype)
    )
    _assert_on(output, device, dtype)
    _assert_on(grad, device, dtype)
    _assert_on(prompt_grad, "cpu", torch.float32)
    for ours, theirs in zip((output, grad, prompt_grad), expected, strict=True):
        torch.testing.assert_close(ours.cpu().float(), theirs, atol=TOLERANCE, rtol=1e-3)

    # Inference steps, with beam reordering: each output on the device, in the dtype of its step.
    hypo_ids = torch.tensor([1, 0])
    with torch.no_grad(), sequential.inference_session(max_length=8) as session:
        first = session.step(x[:, :4].to(device, dtype))
        second = session.step(x[:, 4:].to(device, dtype), hypo_ids=hypo_ids.to(device))
    with torch.no_grad():
        full = sequential(x)
        reordered = sequential(torch.cat([x[hypo_ids, :4], x[:, 4:]], dim=1))
    for step in (first, second):
        _assert_on(step, device, dtype)
    torch.testing.assert_close(first.cpu().float(), full[:, :4], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(second.cpu().float(), reordered[:, 4:], atol=TOLERANCE, rtol=0)


def test_remote_sequential_refuses_inputs_it_cannot_send_and_loses_nothing(
    sequential: RemoteSequential,
) -> None:
    x = torch.randn(1, 3, HIDDEN)
    with pytest.raises(ValueError, match="hidden states must be a floating-point tensor"):
        sequential(x.to(torch.int32))
    with pytest.raises(ValueError, match="deep prompts must be a floating-point tensor"):
        sequential(x, torch.zeros(N_BLOCKS, 1, 1, HIDDEN, dtype=torch.int64) + 1)
    with torch.no_grad(), sequential.inference_session(max_length=4) as session:
        with pytest.raises(ValueError, match="hidden states must be a floating-point tensor"):
            session.step(x.to(torch.int64))
        first = session.step(x[:, :2])
        with pytest.raises(ValueError, match=r"hypo_ids must be \(1,\) integers in \[0, 1\)"):
            session.step(x[:, 2:], hypo_ids=torch.tensor([1]))
        with pytest.raises(ValueError, match=r"hypo_ids must be \(1,\) integers"):
            session.step(x[:, 2:], hypo_ids=torch.tensor([True]))
        # The session goes on where it was, and no server was blamed.
        assert session.position == 2
        second = session.step(x[:, 2:])
    with torch.no_grad():
        full = sequential(x)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=TOLERANCE, rtol=0)
    assert not sequential.sequence_manager.state.bans


# -- distributed models --------------------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype"), PLACEMENTS)
def test_causal_lm_forward_sessions_and_generate_follow_the_model(
    served: ServedModel, device: str, dtype: torch.dtype
) -> None:
    """Logits, session steps, and greedy / beam / left-padded / sampled generation of the moved
    model equal the model's on the CPU in float32."""
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served.folder, initial_peers=served.initial_peers
    )
    try:
        pad = model.config.pad_token_id
        ids = random_ids(2, 6, seed=1)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding, as tokenizers pad for generation
        padded = ids.masked_fill(mask == 0, pad or 0)
        greedy = {"do_sample": False, "max_new_tokens": 5, **no_eos(model)}
        beams = {"num_beams": 3, "num_return_sequences": 2, **greedy}
        with torch.no_grad():
            logits = model(ids).logits
            with model.inference_session(max_length=6):
                stepped = torch.cat([model(ids[:, :4]).logits, model(ids[:, 4:]).logits], dim=1)
        expected = [
            model.generate(ids, **greedy),
            model.generate(ids, **beams),
            model.generate(padded, attention_mask=mask, **greedy),
        ]
        torch.testing.assert_close(stepped, logits, atol=TOLERANCE, rtol=0)

        model.to(device, dtype)
        on = ids.to(device)
        with torch.no_grad():
            moved = model(on).logits
            with model.inference_session(max_length=6):
                moved_steps = [model(on[:, :4]).logits, model(on[:, 4:]).logits]
        for result in (moved, *moved_steps):
            _assert_on(result, device, dtype)
        torch.testing.assert_close(moved.cpu().float(), logits, atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(
            torch.cat(moved_steps, dim=1).cpu().float(), logits, atol=TOLERANCE, rtol=0
        )
        ours = [
            model.generate(on, **greedy),
            model.generate(on, **beams),
            model.generate(padded.to(device), attention_mask=mask.to(device), **greedy),
        ]
        for result, reference in zip(ours, expected, strict=True):
            assert result.device.type == device
            assert torch.equal(result.cpu(), reference)

        # Sampling draws from the random stream of the device: the reference is transformers'
        # model on the same device.
        reference_lm = AutoModelForCausalLM.from_pretrained(served.folder).eval().to(device)
        sampling = {"do_sample": True, "top_k": 20, "max_new_tokens": 6, **no_eos(model)}
        torch.manual_seed(7)
        sampled = model.generate(on, **sampling)
        torch.manual_seed(7)
        assert torch.equal(sampled, reference_lm.generate(on, **sampling))
    finally:
        model.shutdown()


@pytest.mark.parametrize(("device", "dtype"), PLACEMENTS)
def test_a_session_goes_on_after_the_model_moves(
    served: ServedModel, device: str, dtype: torch.dtype
) -> None:
    """generate() calls in one session continue across a move of the model: the tokens so far
    (on the CPU) go along to where the model is."""
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served.folder, initial_peers=served.initial_peers
    )
    try:
        ids = random_ids(2, 4, seed=8)
        greedy = {"do_sample": False, **no_eos(model)}
        whole = model.generate(ids, max_new_tokens=8, **greedy)
        with model.inference_session(max_length=16):
            first = model.generate(ids, max_new_tokens=4, **greedy)
            model.to(device, dtype)
            second = model.generate(first.to(device), max_new_tokens=2, **greedy)  # the whole
            third = model.generate(None, max_new_tokens=2, **greedy)  # only the new tokens
        for result in (second, third):
            assert result.device.type == device
        assert torch.equal(second.cpu(), whole[:, :10])
        assert torch.equal(third.cpu(), whole[:, 10:])
    finally:
        model.shutdown()


@pytest.mark.parametrize(("device", "dtype"), PLACEMENTS)
@pytest.mark.parametrize("tuning_mode", ["ptune", "deep_ptune"])
def test_prompt_tuning_gradients_follow_the_model(
    served: ServedModel, tuning_mode: str, device: str, dtype: torch.dtype
) -> None:
    model = load_prompt_tuned(served, tuning_mode)
    try:
        ids = random_ids(2, 5, seed=2)
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert len(trainable) == (1 if tuning_mode == "ptune" else 2)

        loss = model(ids, labels=ids).loss
        loss.backward()
        expected_grads = [p.grad.clone() for p in trainable if p.grad is not None]
        model.zero_grad(set_to_none=True)

        model.to(device, dtype)
        on = ids.to(device)
        moved_loss = model(on, labels=on).loss
        moved_loss.backward()
        assert moved_loss.device.type == device  # transformers' loss is computed in float32
        torch.testing.assert_close(moved_loss.cpu().float(), loss, atol=TOLERANCE, rtol=0)
        assert len(expected_grads) == len(trainable)
        for parameter, expected in zip(trainable, expected_grads, strict=True):
            assert parameter.grad is not None
            _assert_on(parameter.grad, device, dtype)
            torch.testing.assert_close(
                parameter.grad.cpu().float(), expected, atol=TOLERANCE, rtol=1e-3
            )
            assert bool(expected.abs().sum() > 0)
    finally:
        model.shutdown()


@pytest.mark.parametrize(("device", "dtype"), PLACEMENTS)
def test_sequence_classification_follows_the_model(
    served: ServedModel, device: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(3)
    model = AutoDistributedModelForSequenceClassification.from_pretrained(
        served.folder, initial_peers=served.initial_peers, num_labels=3, pad_token_id=1
    )
    try:
        ids = random_ids(3, 6, seed=4)
        mask = torch.ones_like(ids)
        ids[1, 4:], mask[1, 4:] = 1, 0  # right padding
        labels = torch.tensor([0, 2, 1])
        outputs = model(ids, attention_mask=mask, labels=labels)
        outputs.loss.backward()
        expected_grad = model.score.weight.grad.clone()
        model.zero_grad(set_to_none=True)

        model.to(device, dtype)
        moved = model(ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
        moved.loss.backward()
        _assert_on(moved.logits, device, dtype)
        torch.testing.assert_close(
            moved.logits.detach().cpu().float(), outputs.logits.detach(), atol=TOLERANCE, rtol=0
        )
        assert model.score.weight.grad is not None
        _assert_on(model.score.weight.grad, device, dtype)
        torch.testing.assert_close(
            model.score.weight.grad.cpu().float(), expected_grad, atol=TOLERANCE, rtol=1e-3
        )
    finally:
        model.shutdown()


@pytest.mark.parametrize("device", BF16_DEVICES)
def test_bfloat16_client_over_float32_servers(served: ServedModel, device: str) -> None:
    """bfloat16 travels as it is; logits and prompt gradients come back in bfloat16, close to
    float32's, and generate() picks the tokens the model's own forwards pick."""
    model = load_prompt_tuned(served, "deep_ptune", seed=5)
    try:
        ids = random_ids(1, 5, seed=5)
        loss = model(ids, labels=ids).loss
        loss.backward()
        trainable = [p for p in model.parameters() if p.requires_grad]
        expected_grads = [p.grad.clone() for p in trainable if p.grad is not None]
        with torch.no_grad():
            logits = model(ids).logits
        model.zero_grad(set_to_none=True)

        model.to(device, torch.bfloat16)
        on = ids.to(device)
        moved_loss = model(on, labels=on).loss
        moved_loss.backward()
        with torch.no_grad():
            moved = model(on).logits
        _assert_on(moved, device, torch.bfloat16)
        torch.testing.assert_close(moved.cpu().float(), logits, atol=BF16_TOLERANCE, rtol=0)
        torch.testing.assert_close(moved_loss.cpu().float(), loss, atol=BF16_TOLERANCE, rtol=0)
        for parameter, expected in zip(trainable, expected_grads, strict=True):
            assert parameter.grad is not None
            _assert_on(parameter.grad, device, torch.bfloat16)
            scale = float(expected.abs().max())
            torch.testing.assert_close(
                parameter.grad.cpu().float(), expected, atol=0.1 * scale, rtol=0
            )

        # Greedy decoding by hand, step by step in a session, as generate() steps.
        greedy = {"do_sample": False, "max_new_tokens": 4, **no_eos(model)}
        generated = model.generate(on, **greedy)
        tokens = on
        with torch.no_grad(), model.inference_session(max_length=9):
            step = on
            for _ in range(4):
                last = model(step, logits_to_keep=1).logits[:, -1]
                step = last.float().argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, step], dim=1)
        assert generated.device.type == device
        assert torch.equal(generated, tokens)
    finally:
        model.shutdown()


def test_inputs_on_another_device_than_the_model_are_refused(served_llama: ServedModel) -> None:
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served_llama.folder, initial_peers=served_llama.initial_peers
    )
    try:
        embeddings = torch.empty(1, 3, HIDDEN, device="meta")
        with pytest.raises(ValueError, match="inputs_embeds are on meta, but the model's local"):
            model(inputs_embeds=embeddings)
        if torch.cuda.is_available():
            model.cuda()
            with pytest.raises(ValueError, match="input_ids are on cpu, but the model's local"):
                model(random_ids(1, 3, seed=6))
    finally:
        model.shutdown()
