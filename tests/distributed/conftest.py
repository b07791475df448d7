"""The distributed causal LM of each served family, next to transformers' model of the same
checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from petals_core.distributed import AutoDistributedModelForCausalLM

from .._served_swarm import ServedModel


@pytest.fixture(scope="module")
def models(served: ServedModel) -> Iterator[tuple[Any, Any]]:
    """(distributed causal LM, transformers causal LM) for each family."""
    model = AutoDistributedModelForCausalLM.from_pretrained(
        served.folder, initial_peers=served.initial_peers
    )
    reference = AutoModelForCausalLM.from_pretrained(served.folder).eval()
    yield model, reference
    model.shutdown()
