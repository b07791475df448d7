"""The layering rules of the architecture, checked by importing in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

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
        "petals_core.kernels",
    ],
)
def test_model_code_knows_nothing_of_the_network(module: str) -> None:
    assert _imported_after(module, NETWORK) == []


def test_kernels_import_no_triton_on_cpu() -> None:
    # Triton is loaded only when a CUDA tensor first needs a kernel.
    assert _imported_after("petals_core.kernels", ("triton",)) == []


def test_the_client_loads_neither_the_server_nor_the_models() -> None:
    # The messages it shares with servers come from petals_core.protocol.
    watched = ("petals_core.server", "petals_core.models", "transformers", "triton")
    assert _imported_after("petals_core.client", watched) == []


def test_the_protocol_is_messages_only() -> None:
    # Message classes and transfers in parts over any send / receive: no event loop, no network,
    # neither side of the RPCs.
    watched = (
        "trio",
        "aioquic",
        "petals_core.transport",
        "petals_core.server",
        "petals_core.client",
        "petals_core.models",
        "transformers",
    )
    assert _imported_after("petals_core.protocol", watched) == []
