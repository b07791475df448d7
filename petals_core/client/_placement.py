"""Where the client's tensors live: on the wire, on the CPU in a dtype every server takes; back
home, on the device and in the dtype of what the caller gave.

A client may hold its tensors on a GPU, or in a dtype servers refuse (float64). What goes to the
servers is copied to the CPU once, before encoding, in its own dtype if every server accepts it
and in float32 otherwise; the servers cast to their blocks' dtype and answer in the dtype they
were sent. What comes back (hidden states, gradients of inputs and prompts) is moved to the
device and dtype of the tensor it answers.  Everything the client keeps for later (a session's
history, a forward's inputs for its backward) stays on the CPU in wire form.
"""

from __future__ import annotations

from typing import Final

import torch

__all__ = ["WIRE_DTYPES", "describe", "like", "to_wire"]

#: The floating-point dtypes every server accepts; others travel as float32.
WIRE_DTYPES: Final = (torch.float32, torch.float16, torch.bfloat16)


def to_wire(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """``tensor`` as it is sent: detached, contiguous, on the CPU, in a wire dtype.

    ``what`` names the tensor in the :class:`ValueError` raised for one that cannot be sent (not
    a floating-point tensor, or one without data, on the ``meta`` device).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        raise ValueError(f"{what} must be a floating-point tensor, got {describe(tensor)}")
    if tensor.is_meta:
        raise ValueError(f"{what} are on the meta device: they hold no values to send")
    dtype = tensor.dtype if tensor.dtype in WIRE_DTYPES else torch.float32
    return tensor.detach().to("cpu", dtype).contiguous()


def like(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``tensor`` on the device and in the dtype of ``reference`` (itself if already there)."""
    return tensor.to(device=reference.device, dtype=reference.dtype)


def describe(value: object) -> str:
    """A tensor's shape and dtype, or the type of anything else, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor"
    return type(value).__name__
