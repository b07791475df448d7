"""One tree's side of ``bench inference``'s first-step table, run as a script in a process of its
own: ``python bench/_first_step_worker.py '<json>'`` with ``PYTHONPATH`` at the tree to measure.

It imports nothing from the ``bench`` package (the tree measured may be another one's, whose
``bench`` differs) and only what every tree of the project has: ``open_local_swarm`` and the
distributed model.  It starts a swarm of that tree (``folder``: the checkpoint; ``server_args``:
one list of flags per server), prints ``READY``, and then for each ``go`` line on its standard
input measures one first step and prints ``RESULT <json>``:

- a client is made afresh (``from_pretrained``, timed as ``made_ms``);
- ``fresh``: its first session: the first forward, ``prefill`` tokens (the client's network part
  starts, the session's route is planned, its servers' sessions opened, the step run), then a
  second one of one token, each timed;
- ``running``: the same for a second session of that client, whose network part now runs;
- ``parts`` of each: where the first step spent its time, as the session says
  (``first_step``), when the tree's sessions say it.

Any other line ends it (and its swarm).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import trio


def _session(model: Any, ids: torch.Tensor, prefill: int) -> dict[str, Any]:
    """One session: its first forward (``prefill`` tokens) and a second (one token), timed."""
    with torch.no_grad(), model.inference_session(max_length=prefill + 4) as session:
        started = time.perf_counter()
        model(ids[:, :prefill])
        first = time.perf_counter() - started
        started = time.perf_counter()
        model(ids[:, prefill:])
        second = time.perf_counter() - started
        parts = getattr(session, "first_step", None)
    result: dict[str, Any] = {"first_ms": first * 1e3, "second_ms": second * 1e3, "parts": None}
    if parts is not None:
        result["parts"] = {
            "route_ms": parts.route_s * 1e3,
            "open_ms": parts.open_s * 1e3,
            "connect_ms": parts.connect_s * 1e3,
            "step_ms": parts.total_s * 1e3,
        }
    return result


def _measure(config: dict[str, Any], initial_peers: list[str]) -> dict[str, Any]:
    """A session on a client made afresh, then another on the same client, now running."""
    from petals_core.distributed import AutoDistributedModelForCausalLM

    prefill = int(config["prefill"])
    started = time.perf_counter()
    model = AutoDistributedModelForCausalLM.from_pretrained(
        config["folder"], initial_peers=initial_peers, request_timeout_s=60.0
    )
    made = time.perf_counter() - started
    try:
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(int(config["vocab"]), (1, prefill + 1), generator=generator)
        fresh = _session(model, ids, prefill)
        running = _session(model, ids, prefill)
    finally:
        model.shutdown()
    return {"made_ms": made * 1e3, "fresh": fresh, "running": running}


async def _serve(config: dict[str, Any]) -> None:
    from petals_core.testing import open_local_swarm

    async with open_local_swarm(config["folder"], config["server_args"]) as swarm:
        print("READY", flush=True)
        while (await trio.to_thread.run_sync(sys.stdin.readline)).strip() == "go":
            result = await trio.to_thread.run_sync(_measure, config, swarm.initial_peers)
            print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    trio.run(_serve, json.loads(sys.argv[1]))


if __name__ == "__main__":
    main()
