"""The layering rules of the architecture, checked by importing in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "triton")


@pytest.mark.parametrize("module", ["petals_core", "petals_core.transport", "petals_core.testing"])
def test_transport_imports_no_torch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
