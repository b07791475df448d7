"""The ``swarm`` phases of ``bench gpu``: a model served by server processes on this GPU.

One family per phase (a TinyLlama-1.1B-shaped LLaMA, a bloom-560m-shaped BLOOM; with
``--families``, a 1B Falcon and a 1.5B Mixtral), random weights made on the GPU and saved as
sharded safetensors, each variant (fp32 and bf16; nf4 and int8 with ``--variants``) served by 2
server processes under its own DHT prefix, every server started at once.  With the client on the
GPU:

- fp32: the logits of a 16-token prompt and 24 greedy tokens against transformers' own model on
  the same GPU;
- each other variant: a 128-token prefill and the decode ms per token, beside transformers' own
  model in the same dtype and quantisation on the same GPU (eager, ``DynamicCache``);
- 1, 8 and 32 concurrent sessions (bf16, the trio client in this process), each level first run
  untimed, then timed: total tokens per second through the swarm;
- what torch holds on the GPU in each server, and its decode-graph counters (``petals.info``).

Each part is recorded as soon as it is measured.  The ``--dry-run`` of
``bench gpu`` runs the same on the CPU with tiny shapes and few tokens: a check of the benchmark
itself (its numbers mean nothing).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from petals_core.testing import (
    bloom_560m_config,
    tiny_bloom_config,
    tiny_falcon_config,
    tiny_llama_config,
    tiny_mixtral_config,
    tinyllama_1b_config,
)

from ._report import print_table

FAMILIES = ("llama", "bloom", "falcon", "mixtral")
#: variant -> (--torch_dtype, --quant_type) of its servers.
VARIANTS = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "nf4": ("bfloat16", "nf4"),
    "int8": ("bfloat16", "int8"),
}
PROMPT = 16
GREEDY_TOKENS = 24
PREFILL = 128
PREFILL_REPEATS = 3
DECODE_WARMUP = 4
DECODE_TOKENS = 24
CONCURRENT_STEPS = 16


@attrs.frozen(kw_only=True)
class SwarmSetup:
    """Where and at what size the phase runs."""

    device: str
    family: str
    variants: tuple[str, ...]
    concurrency: tuple[int, ...]
    #: Tiny shapes on the CPU (``--dry-run``).
    dry: bool


def run(setup: SwarmSetup, record: Callable[[dict[str, Any]], None]) -> None:
    """Measure the family, handing each part to ``record`` as soon as it is measured."""
    if "fp32" not in setup.variants:
        raise ValueError("the fp32 variant is the parity check: it cannot be left out")
    trio.run(_swarm, setup, record)


def _family_config(setup: SwarmSetup) -> Any:
    """The config of the family's benchmark shape."""
    if setup.dry:
        # Positions past the tiny configs' 128: a PREFILL-token prompt and then decode steps.
        long = {"num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 2048}
        tiny = {
            "llama": lambda: tiny_llama_config(**long),
            "bloom": lambda: tiny_bloom_config(n_layer=4, vocab_size=512),
            "falcon": lambda: tiny_falcon_config(**long),
            "mixtral": lambda: tiny_mixtral_config(**long),
        }
        return tiny[setup.family]()
    full = {
        "llama": tinyllama_1b_config,
        "bloom": bloom_560m_config,
        "falcon": lambda: tiny_falcon_config(
            hidden_size=2048,
            num_attention_heads=32,
            num_kv_heads=4,
            num_hidden_layers=22,
            vocab_size=65024,
            max_position_embeddings=2048,
        ),
        "mixtral": lambda: tiny_mixtral_config(
            hidden_size=1024,
            intermediate_size=3584,
            num_attention_heads=16,
            num_key_value_heads=4,
            num_hidden_layers=16,
            vocab_size=32000,
            max_position_embeddings=2048,
        ),
    }
    return full[setup.family]()


def _make_checkpoint(setup: SwarmSetup, folder: Path) -> Any:
    """Random fp32 weights made on the device, saved in shards; returns the model (fp32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(_family_config(setup))
    model.eval().requires_grad_(False)
    model.save_pretrained(folder, max_shard_size="1GB")
    return model


async def _swarm(setup: SwarmSetup, record: Callable[[dict[str, Any]], None]) -> None:
    from petals_core.testing import open_local_swarm

    family = setup.family
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / f"{family}-bench"
        started = time.monotonic()
        reference = _make_checkpoint(setup, folder)
        record({"checkpoint_s": time.monotonic() - started})
        async with open_local_swarm(str(folder), [], env={"OMP_NUM_THREADS": "2"}) as swarm:
            started = time.monotonic()
            blocks = reference.config.num_hidden_layers
            async with trio.open_nursery() as nursery:
                for variant in setup.variants:
                    dtype, quant = VARIANTS[variant]
                    for span in ((0, blocks // 2), (blocks // 2, blocks)):
                        args = ["--block_indices", f"{span[0]}:{span[1]}",
                                "--throughput", "1", "--device", setup.device,
                                "--torch_dtype", dtype, "--quant_type", quant,
                                "--dht_prefix", f"{family}-{variant}"]  # fmt: skip
                        nursery.start_soon(swarm.add_server, str(folder), args)
            count = 2 * len(setup.variants)
            record({"servers": count, "servers_start_s": time.monotonic() - started})
            print(f"{count} servers up in {time.monotonic() - started:.1f} s", flush=True)
            peers = swarm.initial_peers
            fp32 = await trio.to_thread.run_sync(_fp32_check, setup, folder, reference, peers)
            record({"fp32": fp32})
            for variant in setup.variants:
                if variant == "fp32":
                    continue
                try:
                    measured = await trio.to_thread.run_sync(
                        _speed, setup, folder, reference, peers, variant
                    )
                except Exception:
                    measured = {"error": traceback.format_exc()}
                    print(measured["error"], flush=True)
                record({variant: measured})
            if "bf16" in setup.variants:
                concurrency = await _concurrency(setup, peers, reference.config)
                record({"concurrency": concurrency})
            record({"servers_info": await _server_info(swarm)})


def _client(setup: SwarmSetup, folder: Path, peers: list[str], prefix: str, dtype: Any) -> Any:
    from petals_core import AutoDistributedModelForCausalLM

    model = AutoDistributedModelForCausalLM.from_pretrained(
        str(folder), initial_peers=peers, dht_prefix=prefix, torch_dtype=dtype
    )
    return model.to(setup.device).eval()


def _fp32_check(
    setup: SwarmSetup, folder: Path, reference: Any, peers: list[str]
) -> dict[str, Any]:
    client = _client(setup, folder, peers, f"{setup.family}-fp32", torch.float32)
    vocab = reference.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, PROMPT), generator=generator).to(setup.device)
    with torch.no_grad():
        ours = client(ids).logits.float()
        expected = reference(ids).logits.float()
    greedy = {"max_new_tokens": GREEDY_TOKENS, "min_new_tokens": GREEDY_TOKENS, "do_sample": False}
    ours_tokens = client.generate(ids, **greedy)
    expected_tokens = reference.generate(ids, **greedy)
    return {
        "logits_max_abs_diff": (ours - expected).abs().max().item(),
        "logits_scale": expected.abs().max().item(),
        "greedy_equal": bool(torch.equal(ours_tokens.cpu(), expected_tokens.cpu())),
        "greedy_tokens": GREEDY_TOKENS,
    }


def _hf_model(folder: Path, reference: Any, variant: str) -> Any:
    """transformers' own model of the variant on the device."""
    import copy

    if variant == "bf16":
        return copy.deepcopy(reference).to(torch.bfloat16)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = (
        BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        )
        if variant == "nf4"
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    return AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=quantization, dtype=torch.bfloat16, device_map={"": 0}
    ).eval()


def _speed(
    setup: SwarmSetup, folder: Path, reference: Any, peers: list[str], variant: str
) -> dict[str, Any]:
    client = _client(setup, folder, peers, f"{setup.family}-{variant}", torch.bfloat16)
    vocab = reference.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (1, PREFILL), generator=generator).to(setup.device)
    ours = _time_swarm(setup, client, ids)
    del client
    hf = _hf_model(folder, reference, variant)
    theirs = _time_transformers(setup, hf, ids)
    del hf
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return {"ours": ours, "transformers": theirs}


def _synchronized(setup: SwarmSetup) -> float:
    if setup.device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _time_swarm(setup: SwarmSetup, client: Any, ids: torch.Tensor) -> dict[str, Any]:
    prefill_ms = []
    decode_ms = []
    with (
        torch.no_grad(),
        client.inference_session(max_length=PREFILL + DECODE_WARMUP + DECODE_TOKENS + 1) as session,
    ):
        client(ids[:, :1])  # opens the route (connections, server sessions)
        for _ in range(PREFILL_REPEATS):
            session.position = 0
            started = _synchronized(setup)
            logits = client(ids).logits
            prefill_ms.append((_synchronized(setup) - started) * 1e3)
        token = logits[:, -1:].argmax(-1)
        for index in range(DECODE_WARMUP + DECODE_TOKENS):
            started = _synchronized(setup)
            token = client(token).logits[:, -1:].argmax(-1)
            elapsed = (_synchronized(setup) - started) * 1e3
            if index >= DECODE_WARMUP:
                decode_ms.append(elapsed)
    return _timings(prefill_ms, decode_ms)


def _time_transformers(setup: SwarmSetup, model: Any, ids: torch.Tensor) -> dict[str, Any]:
    from petals_core._hf_compat import CACHE_ARG, cache_kwargs

    prefill_ms = []
    decode_ms = []
    with torch.no_grad():
        model(ids[:, :8])  # warm-up: kernels, allocator
        for _ in range(PREFILL_REPEATS):
            started = _synchronized(setup)
            output = model(ids, use_cache=True)
            prefill_ms.append((_synchronized(setup) - started) * 1e3)
        past = getattr(output, CACHE_ARG)
        token = output.logits[:, -1:].argmax(-1)
        for index in range(DECODE_WARMUP + DECODE_TOKENS):
            started = _synchronized(setup)
            output = model(token, use_cache=True, **cache_kwargs(past))
            past = getattr(output, CACHE_ARG)
            token = output.logits[:, -1:].argmax(-1)
            elapsed = (_synchronized(setup) - started) * 1e3
            if index >= DECODE_WARMUP:
                decode_ms.append(elapsed)
    return _timings(prefill_ms, decode_ms)


def _timings(prefill_ms: list[float], decode_ms: list[float]) -> dict[str, Any]:
    return {
        "prefill_ms": statistics.median(prefill_ms),
        "decode_ms": statistics.median(decode_ms),
        "decode_p90_ms": sorted(decode_ms)[int(0.9 * (len(decode_ms) - 1))],
        "decode_samples": len(decode_ms),
    }


async def _concurrency(setup: SwarmSetup, peers: list[str], config: Any) -> list[dict[str, Any]]:
    """Sessions stepping at once through the bf16 swarm: total tokens per second.  Each level
    first runs its steps untimed (captures, allocations, batching settle), then timed."""
    from petals_core.client import RemoteSequenceManager, RemoteSequential, SequenceManagerConfig

    manager = RemoteSequenceManager(
        SequenceManagerConfig(initial_peers=tuple(peers), dht_prefix=f"{setup.family}-bf16"),
        config.num_hidden_layers,
    )
    results = []
    async with RemoteSequential(manager) as remote:
        for count in setup.concurrency:
            async with contextlib.AsyncExitStack() as stack:
                sessions = [
                    await stack.enter_async_context(
                        remote.open_inference_session(max_length=8 + 2 * CONCURRENT_STEPS + 1)
                    )
                    for _ in range(count)
                ]
                prompt = torch.randn(1, 8, config.hidden_size, dtype=torch.bfloat16)
                token = torch.randn(1, 1, config.hidden_size, dtype=torch.bfloat16)
                async with trio.open_nursery() as nursery:
                    for session in sessions:
                        nursery.start_soon(_steps, session, prompt, 1)
                async with trio.open_nursery() as nursery:  # untimed: the warm-up
                    for session in sessions:
                        nursery.start_soon(_steps, session, token, CONCURRENT_STEPS)
                started = trio.current_time()
                cpu = time.process_time()
                async with trio.open_nursery() as nursery:
                    for session in sessions:
                        nursery.start_soon(_steps, session, token, CONCURRENT_STEPS)
                seconds = trio.current_time() - started
                results.append(
                    {
                        "sessions": count,
                        "tokens": count * CONCURRENT_STEPS,
                        "seconds": seconds,
                        "tokens_per_s": count * CONCURRENT_STEPS / seconds,
                        "client_cpu_fraction": (time.process_time() - cpu) / seconds,
                    }
                )
    return results


async def _steps(session: Any, hidden: torch.Tensor, count: int) -> None:
    for _ in range(count):
        await session.step(hidden)


async def _server_info(swarm: Any) -> list[dict[str, Any]]:
    from petals_core.protocol import INFO
    from petals_core.transport import call_unary, open_node

    infos = []
    async with open_node() as node:
        for server in swarm.servers:
            connection = await node.connect(server.address)
            info = await call_unary(connection, INFO, {})
            infos.append(
                {
                    "blocks": f"{info['start_block']}:{info['end_block']}",
                    "dtype": info["torch_dtype"],
                    "device_memory_reserved_gib": (info.get("device_memory_reserved_bytes") or 0)
                    / 2**30,
                    "decode_graphs": info.get("decode_graphs"),
                    "prefix": next(
                        (line.rsplit("prefix ", 1)[-1].rstrip(")") for line in server.output
                         if "prefix " in line), None,
                    ),
                }
            )  # fmt: skip
    return infos


def print_family(setup: SwarmSetup, results: dict[str, Any]) -> None:
    """The tables of what :func:`run` recorded."""
    family = setup.family
    fp32 = results.get("fp32")
    if fp32 is not None:
        print_table(
            f"{family}: fp32 swarm against transformers ({setup.device})",
            ["logits max |diff|", "logits scale", "greedy tokens equal"],
            [[fp32["logits_max_abs_diff"], fp32["logits_scale"], fp32["greedy_equal"]]],
        )
    rows = []
    for variant in setup.variants:
        entry = results.get(variant)
        if variant == "fp32" or entry is None:
            continue
        if "error" in entry:
            rows.append([variant, "error", None, None, None, None])
            continue
        ours, theirs = entry["ours"], entry["transformers"]
        rows.append([variant, ours["decode_ms"], theirs["decode_ms"],
                     theirs["decode_ms"] / ours["decode_ms"], ours["prefill_ms"],
                     theirs["prefill_ms"]])  # fmt: skip
    print_table(
        f"{family}: 2 servers, client on the {setup.device}, ms (median)",
        ["variant", "decode ours", "decode transformers", "speedup", f"prefill {PREFILL} ours",
         f"prefill {PREFILL} transformers"],
        rows,
    )  # fmt: skip
    concurrency = results.get("concurrency") or []
    if concurrency:
        one = concurrency[0]["tokens_per_s"]
        print_table(
            f"{family}: concurrent sessions (bf16), after an untimed run of each level",
            ["sessions", "tokens/s", "x one session", "client CPU"],
            [[c["sessions"], c["tokens_per_s"], c["tokens_per_s"] / one,
              c["client_cpu_fraction"]] for c in concurrency],
        )  # fmt: skip
    servers = results.get("servers_info") or []
    print_table(
        f"{family}: servers",
        ["prefix", "blocks", "dtype", "GPU GiB reserved", "graphs", "replays", "declined",
         "disabled"],
        [[s["prefix"], s["blocks"], s["dtype"], s["device_memory_reserved_gib"],
          (s["decode_graphs"] or {}).get("graphs"), (s["decode_graphs"] or {}).get("replays"),
          (s["decode_graphs"] or {}).get("declined"), (s["decode_graphs"] or {}).get("disabled")]
         for s in servers],
    )  # fmt: skip
