"""What the tests of the distributed causal LMs share: random token ids, generation settings that
run to ``max_new_tokens``, and a prompt-tuned model of the served swarm."""

from __future__ import annotations

from typing import Any

import torch

from petals_core.distributed import AutoDistributedModelForCausalLM

from .._served_swarm import ServedModel

#: Trainable prompt tokens of the prompt-tuned models.
PROMPT_LEN = 3


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """``(batch, length)`` token ids past the special tokens of the tiny checkpoints."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (batch, length), generator=generator)


def no_eos(model: Any) -> dict[str, Any]:
    """Generation settings that run to max_new_tokens whatever the random ``model`` says."""
    return {"eos_token_id": None, "pad_token_id": model.config.pad_token_id or 0}


def load_prompt_tuned(served: ServedModel, tuning_mode: str, *, seed: int = 0) -> Any:
    """A distributed causal LM of ``served`` with :data:`PROMPT_LEN` trainable prompt tokens
    (``"ptune"`` or ``"deep_ptune"``), drawn after seeding torch with ``seed``."""
    torch.manual_seed(seed)
    return AutoDistributedModelForCausalLM.from_pretrained(
        served.folder,
        initial_peers=served.initial_peers,
        tuning_mode=tuning_mode,
        pre_seq_len=PROMPT_LEN,
    )
