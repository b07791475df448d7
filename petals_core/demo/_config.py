"""What the demo runs (:class:`DemoConfig`) and what one run measured (:class:`DemoResult`)."""

from __future__ import annotations

from typing import Final

import attrs

from .._errors import ConfigError
from .._validators import positive

DEFAULT_PROMPT: Final = "What is the capital of France?"
#: The ``--model`` value meaning the packaged SmolLM2-135M-Instruct; the MODEL of the server's and
#: the API's command lines too (see ``resolve_alias``).
SMOLLM2: Final = "smollm2"


@attrs.frozen(kw_only=True)
class DemoConfig:
    """What the demo runs (the command line's options)."""

    #: ``"smollm2"``, a Hugging Face repo id, or a local checkpoint folder (with a tokenizer).
    model: str = SMOLLM2
    prompt: str = DEFAULT_PROMPT
    #: Servers started; the model's blocks are split evenly over them.
    servers: int = attrs.field(default=3, validator=positive)
    max_new_tokens: int = attrs.field(default=32, validator=positive)
    #: Longest wait for one request to the swarm (and for the route to be complete).
    request_timeout_s: float = attrs.field(default=60.0, validator=positive)
    #: Longest wait for the swarm to start (all servers loaded and announced).
    start_timeout_s: float = attrs.field(default=300.0, validator=positive)


@attrs.frozen(kw_only=True)
class RouteHop:
    """Server ``peer_id`` (process ``name``) ran blocks ``[start, end)`` of the answer."""

    name: str
    peer_id: str
    start: int
    end: int


@attrs.frozen(kw_only=True)
class DemoResult:
    """What one run of the demo measured; token ids are the generated ones only."""

    prompt_ids: tuple[int, ...]
    swarm_ids: tuple[int, ...]
    local_ids: tuple[int, ...]
    swarm_answer: str
    local_answer: str
    route: tuple[RouteHop, ...]
    #: Median over decode steps (every generated token but the first); None if only one.
    swarm_ms_per_token: float | None
    local_ms_per_token: float | None
    #: From the start of ``generate()`` to the first generated token (the prefill).
    swarm_first_token_ms: float
    local_first_token_ms: float
    #: From starting the bootstrap node until every server served its blocks.
    swarm_start_s: float

    @property
    def identical(self) -> bool:
        """The swarm's greedy answer equals the local model's, token for token."""
        return self.swarm_ids == self.local_ids


def split_blocks(num_blocks: int, servers: int) -> list[tuple[int, int]]:
    """``[start, end)`` spans of ``num_blocks`` blocks over ``servers`` servers, in order; sizes
    differ by at most one (the first servers get the extra blocks)."""
    if servers < 1 or servers > num_blocks:
        raise ConfigError(
            f"cannot split {num_blocks} blocks over {servers} servers: "
            f"use 1 to {num_blocks} servers"
        )
    base, extra = divmod(num_blocks, servers)
    spans = []
    start = 0
    for i in range(servers):
        end = start + base + (1 if i < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def short_peer_id(peer_id: str) -> str:
    """``12D3Ko...abcdef``: enough to tell the servers of one swarm apart."""
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}...{peer_id[-6:]}"
