"""A generating client driven over stdin and stdout, for processes a test or benchmark runs
elsewhere (inside a host of a NAT topology: ``petals_core.testing.open_host_client``).

``python -m petals_core.demo._remote_client '<json>'`` with ``folder``, ``initial_peers``,
``dht_prefix``, ``prompt`` (token ids, batch x length) and ``max_new_tokens``: a Petals-style
script (the distributed causal LM's ``generate``).  It prints ``READY`` once the model is loaded;
each ``go`` line on stdin then runs one greedy generation, printing ``TOKEN <seconds since go>``
as each new token comes (batch 1) and then ``DONE <json>``: the token ids and the live
connections (peer, and the relay each goes through, or null).  ``quit`` ends it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["generate"]


def generate(settings: dict[str, Any]) -> None:
    import torch
    from transformers.generation.streamers import BaseStreamer

    from petals_core.distributed import AutoDistributedModelForCausalLM

    class Printer(BaseStreamer):
        def __init__(self, began: float) -> None:
            self.began = began
            self.prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            print(f"TOKEN {time.perf_counter() - self.began:.4f}", flush=True)

        def end(self) -> None:
            pass

    model = AutoDistributedModelForCausalLM.from_pretrained(
        settings["folder"],
        initial_peers=settings["initial_peers"],
        dht_prefix=settings["dht_prefix"],
    )
    manager = model.distributed_base.remote_blocks.sequence_manager
    prompt = torch.tensor(settings["prompt"])
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        began = time.perf_counter()
        streamer = Printer(began) if prompt.shape[0] == 1 else None
        with torch.no_grad():
            output = model.generate(
                prompt,
                max_new_tokens=settings["max_new_tokens"],
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                streamer=streamer,
            )
        # The network part starts with the first generation.
        node = manager.state.dht.node
        connections = [
            [str(c.peer_id), None if c.relay is None else str(c.relay)] for c in node.connections
        ]
        report = {"tokens": output.tolist(), "connections": connections}
        print(f"DONE {json.dumps(report)}", flush=True)


if __name__ == "__main__":
    generate(json.loads(sys.argv[1]))
