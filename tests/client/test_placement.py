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

from petals_core.client import RemoteSequential
from petals_core.client._placement import like, to_wire

from ._swarm_helpers import HIDDEN, N_BLOCKS, manager_for
from .conftest import ServedModel

#: Outputs in float32 on another device, or in float64 (sent as float32), equal the CPU's up to
#: this.
TOLERANCE = 1e-4

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: (device, dtype) of the client under test; the reference is the same client on the CPU in
#: float32.
PLACEMENTS = [
    pytest.param("cpu", torch.float64, id="cpu-float64"),
    pytest.param("cuda", torch.float32, id="cuda-float32", marks=CUDA),
    pytest.param("cuda", torch.float64, id="cuda-float64", marks=CUDA),
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
    torch.manual_seed(1)
    x = torch.randn(2, 5, HIDDEN)
    prompts = torch.randn(N_BLOCKS, 1, 2, HIDDEN) * 0.5
    grad_output = torch.randn(2, 5, HIDDEN)
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
