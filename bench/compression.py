"""``python -m bench compression``: what each wire compression costs and saves.

For each scheme (none, float16, blockwise8), a random 8-block LLaMA (hidden 1024, fp32) on 2
server processes of 4 blocks each, started with ``--compression SCHEME``, and a client loaded
with ``compression=SCHEME``: a 128-token prefill, then single-token decode steps (LM head
included), then a p-tuning step of 4 x 128 tokens (forward, backward through the servers, Adam).
Bytes are what the client's node sent and received (QUIC datagrams, headers included): the
servers pass a step's output on to the next server themselves, so those hops are not counted.
Milliseconds are medians; on loopback compression costs CPU and saves little time, its gain is
on slow links.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import trio
from transformers import LlamaForCausalLM

from petals_core.testing import LocalSwarm, open_local_swarm, tiny_llama_config

from ._client import sequence_manager
from ._decode import quiet_transformers, server_args
from ._report import print_table, summarize, write_json

HIDDEN = 1024
BLOCKS = 8
VOCAB = 1024
SPANS = ((0, 4), (4, 8))
PREFILL = 128
DECODE_STEPS = 24
PTUNE_BATCH, PTUNE_LENGTH, PTUNE_STEPS = 4, 128, 3
SCHEMES = ("none", "float16", "blockwise8")
SCHEME_TIMEOUT_S = 900


def _save(folder: Path) -> str:
    torch.manual_seed(0)
    config = tiny_llama_config(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=BLOCKS,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        pad_token_id=0,
    )
    path = folder / "llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


class _Meter:
    """Bytes through the client's node, and wall time, per measured step."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.bytes: list[int] = []
        self.ms: list[float] = []

    def _total(self) -> int:
        dht = sequence_manager(self._model).state.dht
        stats = dht.node.statistics()
        return int(stats.bytes_sent + stats.bytes_received)

    def measure(self, step: Any) -> Any:
        before, began = self._total(), time.perf_counter()
        result = step()
        self.ms.append((time.perf_counter() - began) * 1e3)
        self.bytes.append(self._total() - before)
        return result

    def summary(self) -> dict[str, float]:
        return {"ms": statistics.median(self.ms), "bytes": statistics.median(self.bytes)}


def _measure(folder: str, swarm: LocalSwarm, scheme: str) -> dict[str, dict[str, float]]:
    from petals_core.distributed import AutoDistributedModelForCausalLM

    options = {"initial_peers": swarm.initial_peers, "compression": scheme}
    torch.manual_seed(1)
    ids = torch.randint(4, VOCAB, (1, PREFILL))
    model = AutoDistributedModelForCausalLM.from_pretrained(folder, **options).eval()
    prefill, decode = _Meter(model), _Meter(model)
    try:
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm up the route
            for _ in range(2):
                with model.inference_session(max_length=PREFILL + DECODE_STEPS + 1):
                    prefill.measure(lambda: model.generate(ids, max_new_tokens=1))
                    for _ in range(DECODE_STEPS):
                        decode.measure(lambda: model.generate(None, max_new_tokens=1))
    finally:
        model.shutdown()
    torch.manual_seed(2)
    tuned = AutoDistributedModelForCausalLM.from_pretrained(
        folder, tuning_mode="ptune", pre_seq_len=16, **options
    )
    ptune = _Meter(tuned)
    try:
        optimizer = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad])
        batch = torch.randint(4, VOCAB, (PTUNE_BATCH, PTUNE_LENGTH))

        def step() -> None:
            tuned(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # warm-up
        for _ in range(PTUNE_STEPS):
            ptune.measure(step)
    finally:
        tuned.shutdown()
    return {"prefill": prefill.summary(), "decode": decode.summary(), "ptune": ptune.summary()}


async def _run(scheme: str, temp: Path, folder: str) -> dict[str, dict[str, float]]:
    args = [server_args(span, cache_dir=temp / "cache", compression=scheme) for span in SPANS]
    with trio.fail_after(SCHEME_TIMEOUT_S):
        async with open_local_swarm(folder, args) as swarm:
            return await trio.to_thread.run_sync(_measure, folder, swarm, scheme)


def main() -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with quiet_transformers(), tempfile.TemporaryDirectory(prefix="bench-compression-") as temp:
        folder = _save(Path(temp))
        for scheme in SCHEMES:
            results[scheme] = trio.run(_run, scheme, Path(temp), folder)
    rows = []
    for what in ("decode", "prefill", "ptune"):
        plain = results["none"][what]["bytes"]
        for scheme in SCHEMES:
            measured = results[scheme][what]
            rows.append(
                (
                    what,
                    scheme,
                    f"{measured['bytes'] / 1e3:.1f}",
                    f"{measured['bytes'] / plain:.2f}x",
                    f"{measured['ms']:.1f}",
                )
            )
    print_table(
        f"compression: a {BLOCKS}-block LLaMA (hidden {HIDDEN}, fp32) on 2 servers x 4 blocks, "
        f"loopback; decode: one token; prefill: {PREFILL} tokens; ptune: a "
        f"{PTUNE_BATCH}x{PTUNE_LENGTH} step; bytes through the client's node",
        ["what", "compression", "kB", "of none", "ms (median)"],
        rows,
    )
    for scheme in SCHEMES[1:]:
        summarize(
            "compression",
            f"{scheme}: decode bytes per token through the client, vs none",
            results[scheme]["decode"]["bytes"],
            results["none"]["decode"]["bytes"],
            unit="B",
        )
    write_json("compression", results)


if __name__ == "__main__":
    main()
