"""The marks of a test that needs a CUDA GPU and compiled Triton kernels.

Such a test is skipped without CUDA, and under Triton's interpreter (which the default test run
selects for the CPU parity tests); ``python -m bench gpu`` runs it with compiled kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

__all__ = ["CUDA_MARKS", "needs_cuda"]

_Test = TypeVar("_Test", bound=Callable[..., object])

#: A module's ``pytestmark`` when all of its tests need CUDA.
CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a CUDA GPU and compiled Triton kernels (run by python -m bench gpu)",
    ),
]


def needs_cuda(test: _Test) -> _Test:
    """:data:`CUDA_MARKS` on one test."""
    for mark in CUDA_MARKS:
        test = mark(test)
    return test
