"""The layering rules of the architecture, checked by importing in fresh interpreters."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "triton")
# Our network layers (trio itself may come in through huggingface_hub's HTTP client).
NETWORK = ("aioquic", "petals_core.transport", "petals_core.dht", "petals_core.client")


def _imported_after(module: str, watched: tuple[str, ...]) -> list[str]:
    code = f"import sys, {module}\nprint(','.join(m for m in {watched!r} if m in sys.modules))\n"
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True
    )
    return [name for name in result.stdout.strip().split(",") if name]


@pytest.mark.parametrize(
    "module",
    [
        "petals_core",
        "petals_core.transport",
        "petals_core.testing",
        "petals_core.dht",
        "petals_core.routing",
    ],
)
def test_transport_imports_no_torch(module: str) -> None:
    assert _imported_after(module, HEAVY) == []


@pytest.mark.parametrize(
    "module",
    [
        "petals_core.models.llama",
        "petals_core.models.bloom",
        "petals_core.models._loading",
        "petals_core.models._config",
        "petals_core.models._cpu_decode",
        "petals_core.models._span_steps",
        "petals_core.kernels",
    ],
)
def test_model_code_knows_nothing_of_the_network(module: str) -> None:
    assert _imported_after(module, NETWORK) == []


def test_kernels_import_no_triton_on_cpu() -> None:
    # Triton is loaded only when a CUDA tensor first needs a kernel.
    assert _imported_after("petals_core.kernels", ("triton",)) == []


def test_the_library_reads_no_private_module_state() -> None:
    """torch's hook tables and nn.Module's dicts are torch's own: what a block may compute with
    is decided from public information (module types, adapters added) by the block's owner."""
    private = re.compile(r"_global_forward|\._modules\b|\._parameters\b|_forward_(pre_)?hooks")
    package = Path(__file__).resolve().parent.parent / "petals_core"
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == []
