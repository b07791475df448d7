"""What a server loads for the MODEL it is given."""

from __future__ import annotations

import pytest

from petals_core.server import ServerConfig
from petals_core.server._config import resolve_model


@pytest.mark.parametrize(
    ("model", "loaded"),
    [
        # Petals' converted BLOOM repos hold no weights any more: their originals do.
        ("bigscience/bloom-petals", "bigscience/bloom"),
        ("bigscience/bloomz-7b1-petals", "bigscience/bloomz-7b1"),
        ("bigscience/bloom-7b1", "bigscience/bloom-7b1"),
        ("meta-llama/Llama-2-70b-hf", "meta-llama/Llama-2-70b-hf"),
        # The command line's alias of the packaged SmolLM2 means nothing to the library.
        ("smollm2", "smollm2"),
    ],
)
def test_the_repo_loaded_for_a_model_name(model: str, loaded: str) -> None:
    config = ServerConfig(model=model, new_swarm=True)
    assert resolve_model(config) == loaded
