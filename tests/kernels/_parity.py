"""How close a kernel's result must be to its reference's."""

from __future__ import annotations

import torch


def assert_parity(actual: torch.Tensor, expected: torch.Tensor, *, ulps: float = 1) -> None:
    """fp32 within 1e-5 (only the summation order differs); fp16/bf16 within ``ulps`` rounding
    steps relative, with a 1e-5 absolute floor for outputs near zero."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        rtol = ulps * torch.finfo(actual.dtype).eps
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-5)
