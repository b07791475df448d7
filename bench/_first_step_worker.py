"""One tree's side of ``bench inference``'s first-step table, run as a script in a process of its
own: ``python bench/_first_step_worker.py '<json>'`` with ``PYTHONPATH`` at the tree to measure.

It imports nothing from the ``bench`` package (the tree measured may be another one's, whose
``bench`` differs) and only what every tree of the project has: ``open_local_swarm`` and the
distributed model.  It starts a swarm of that tree (``folder``: the checkpoint; ``server_args``:
one list of flags per server), prints ``READY``, and then for each ``go`` line on its standard
input measures one first step and prints ``RESULT <json>``:

- a client is made afresh (``from_pretrained``: a new node, no connection yet; not timed);
- timed: the first forward of an inference session, ``prefill`` tokens (the session's route is
  planned, its servers' sessions opened, the step run), then a second one of one token;
- ``parts``: where the first step spent its time, as the session says (``first_step``), when
  the tree's sessions say it.

Any other line ends it (and its swarm).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
import trio


def _measure(config: dict[str, Any], initial_peers: list[str]) -> dict[str, Any]:
    from petals_core.distributed import AutoDistributedModelForCausalLM

    prefill = int(config["prefill"])
    model = AutoDistributedModelForCausalLM.from_pretrained(
        config["folder"], initial_peers=initial_peers, request_timeout_s=60.0
    )
    try:
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(int(config["vocab"]), (1, prefill + 1), generator=generator)
        with torch.no_grad(), model.inference_session(max_length=prefill + 4) as session:
            started = time.perf_counter()
            model(ids[:, :prefill])
            first = time.perf_counter() - started
            started = time.perf_counter()
            model(ids[:, prefill:])
            second = time.perf_counter() - started
            parts = getattr(session, "first_step", None)
    finally:
        model.shutdown()
    result: dict[str, Any] = {"first_ms": first * 1e3, "second_ms": second * 1e3, "parts": None}
    if parts is not None:
        result["parts"] = {
            "route_ms": parts.route_s * 1e3,
            "open_ms": parts.open_s * 1e3,
            "connect_ms": parts.connect_s * 1e3,
            "step_ms": parts.total_s * 1e3,
        }
    return result


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
