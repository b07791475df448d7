"""``python -m bench nat``: serving across real NATs, directly, through a punched hole, and through
a relay, on one machine.

A :class:`~petals_core.testing.Topology` (network namespaces, nftables routers that let in only
replies): a bootstrap DHT node on the "Internet" (it relays too), and three servers of a tiny
random LLaMA (6 blocks, hidden size 64, fp32, one torch thread; each server holds every block and
is the only one of its model name, so each client reaches the server it is meant to):

- **direct**: the server on a public host;
- **hole-punched**: the server behind a home router (a cone NAT);
- **relayed**: the server behind a carrier-grade NAT (symmetric: a new port per destination), so
  only the relay reaches it.

Three clients, one per server, all behind one more home router, take turns: each round every
client generates ``NEW_TOKENS`` tokens greedily from a ``PROMPT``-token prompt (Petals-style
``generate``, a fresh inference session each time).  Time to first token is from the call to the
first new token (the prompt's prefill included), cold (the client's first generation: dialling,
the relay's circuit and the punch included) and warm; ms/token is the decode steps after it.
The tokens of the three paths must be identical.

Then hole punching, per pair of NATs: ``TRIES`` connections (``FEW_TRIES`` for the pairs where
punching cannot work), each from a fresh node (a new socket: a new mapping in the client's NAT),
counting those that ended direct, and the time each took.

The relay's extra leg is measured side by side: ``PINGS`` round trips from the clients' host to
the cone NAT's server through the relay and through a punched hole; the difference is what a
step through the relay pays on top (the links here add no delay, so it is the relay's own
forwarding, twice).

Targets: between cone NATs at least 49 of 50 punches succeed, each in under 2 s; relayed
ms/token at most 1.1x the direct path's plus the relay's extra leg; the relayed path's tokens
identical to the direct path's.

Needs root, iproute2 and nftables (``apt-get install nftables``); without them it says so and
is skipped.  Run with ``nox -s bench -- nat``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from petals_core.testing import (
    Host,
    LocalSwarm,
    SwarmProcess,
    fixed_server_args,
    missing_nat_tools,
    open_host_client,
    open_local_swarm,
    open_topology,
)
from petals_core.testing._host_client import read_lines

from ._report import median, percentile, print_table, summarize, write_json

PROMPT, NEW_TOKENS, ROUNDS = 32, 24, 8
TRIES, FEW_TRIES = 50, 10
#: Round trips measured through the relay and through a punched hole.
PINGS = 200
PUNCH_TARGET_S = 2.0
RELAYED_TARGET = 1.10
TIMEOUT_S = 900.0
PATHS = ("direct", "hole-punched", "relayed")
NUM_BLOCKS = 6


def _make_model(folder: Path) -> str:
    import torch
    from transformers import LlamaForCausalLM

    from petals_core.testing import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.save_pretrained(folder, max_shard_size="200KB")
    return str(folder)


async def _server(
    swarm: LocalSwarm, model: str, host: Host, prefix: str, *, relays: int
) -> SwarmProcess:
    args = fixed_server_args((0, NUM_BLOCKS), update_period=2, dht_prefix=prefix)
    server = await swarm.add_server(model, args, host=host)
    start = 0
    for _ in range(relays):
        line = await server.wait_output("reachable through relay", start=start)
        start = server.output.index(line) + 1
    return server


def _peer(process: SwarmProcess) -> str:
    return process.address.rsplit("/p2p/", 1)[1]


async def _generations(
    swarm: LocalSwarm, model: str, client_host: Host, prefixes: dict[str, str]
) -> dict[str, list[dict[str, Any]]]:
    import torch

    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(4, 256, (1, PROMPT), generator=generator).tolist()
    results: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    async with trio.open_nursery() as nursery:
        clients = {}
        for path in PATHS:
            settings = {
                "folder": model,
                "initial_peers": swarm.initial_peers,
                "dht_prefix": prefixes[path],
                "prompt": prompt,
                "max_new_tokens": NEW_TOKENS,
            }
            clients[path] = await nursery.start(_client, client_host, settings)
        for _ in range(ROUNDS):
            for path in PATHS:
                results[path].append(await clients[path].generate())
        nursery.cancel_scope.cancel()
    return results


async def _client(host: Host, settings: dict[str, Any], task_status: trio.TaskStatus[Any]) -> None:
    async with open_host_client(host, settings) as client:
        task_status.started(client)
        await trio.sleep_forever()


async def _punches(
    swarm: LocalSwarm, host: Host, prefix: str, peer: str, tries: int, *, pings: int = 0
) -> dict[str, Any]:
    settings = {
        "initial_peers": swarm.initial_peers,
        "dht_prefix": prefix,
        "num_blocks": NUM_BLOCKS,
        "peer": peer,
        "tries": tries,
        "pings": pings,
    }
    command = host.command(
        sys.executable, "-m", "petals_core.testing._host_client", json.dumps(settings)
    )
    process = await trio.lowlevel.open_process(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    tracked = SwarmProcess("punch", process, "", [])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_lines, tracked)
        done = await tracked.wait_output("DONE ")
        await process.wait()
        nursery.cancel_scope.cancel()
    report: dict[str, Any] = json.loads(done.removeprefix("DONE "))
    return report


async def run(model: str) -> dict[str, Any]:
    with open_topology() as topology, trio.fail_after(TIMEOUT_S):
        boot = topology.public("boot")
        public = topology.public("public")
        home = topology.behind_nat("home", "cone")
        cgnat = topology.behind_nat("cgnat", "symmetric")
        away = topology.behind_nat("away", "cone")
        spare = topology.public("spare")
        office = topology.public("office")
        sym_client = topology.behind_nat("mobile", "symmetric")
        prefixes = {path: f"nat-{path.replace('-', '')}" for path in PATHS}
        async with open_local_swarm(model, [], bootstrap_host=boot) as swarm:
            # A second public DHT node: the symmetric NAT shows itself to two peers.
            await swarm.add_bootstrap(host=spare)
            servers = {
                "direct": await _server(swarm, model, public, prefixes["direct"], relays=0),
                "hole-punched": await _server(
                    swarm, model, home, prefixes["hole-punched"], relays=1
                ),
                "relayed": await _server(swarm, model, cgnat, prefixes["relayed"], relays=1),
            }
            generations = await _generations(swarm, model, away, prefixes)
            pairs = {
                ("cone", "cone"): (away, "hole-punched", TRIES),
                ("cone", "public"): (office, "hole-punched", TRIES),
                ("cone", "symmetric"): (sym_client, "hole-punched", FEW_TRIES),
                ("symmetric", "cone"): (away, "relayed", FEW_TRIES),
            }
            punches = {}
            rtts: dict[str, list[float]] = {}
            for (server_nat, client_nat), (host, path, tries) in pairs.items():
                # The relay's extra leg, side by side: round trips to the cone NAT's server
                # through the relay and through a punched hole, from the clients' host.
                pings = PINGS if (server_nat, client_nat) == ("cone", "cone") else 0
                report = await _punches(
                    swarm, host, prefixes[path], _peer(servers[path]), tries, pings=pings
                )
                punches[f"{server_nat} server, {client_nat} client"] = report["tries"]
                rtts.update(report.get("rtt_ms", {}))
            relay_used = {
                path: sorted({str(relay) for g in gens for _, relay in g["connections"]})
                for path, gens in generations.items()
            }
    return {"generations": generations, "punches": punches, "relays": relay_used, "rtts": rtts}


def _timings(generations: list[dict[str, Any]]) -> dict[str, float]:
    first = [g["times"][0] * 1e3 for g in generations]
    per_token = [
        (g["times"][-1] - g["times"][0]) * 1e3 / (len(g["times"]) - 1) for g in generations
    ]
    warm = per_token[1:]
    return {
        "ttft_cold_ms": first[0],
        "ttft_warm_ms": median(first[1:]),
        "ms_per_token": median(warm),
        "ms_per_token_p90": percentile(warm, 0.9),
    }


def main() -> None:
    reason = missing_nat_tools()
    if reason is not None:
        print(f"nat: skipped: {reason} (apt-get install -y nftables iproute2, as root)")
        return
    started = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as work:
        model = _make_model(Path(work) / "tiny-llama")
        results = trio.run(run, model)
    load_after = os.getloadavg()
    generations = results["generations"]
    timings = {path: _timings(gens) for path, gens in generations.items()}
    tokens = {path: gens[0]["tokens"] for path, gens in generations.items()}
    same = all(g["tokens"] == tokens["direct"] for gens in generations.values() for g in gens)
    rows = [
        (
            path,
            timings[path]["ttft_cold_ms"],
            timings[path]["ttft_warm_ms"],
            timings[path]["ms_per_token"],
            timings[path]["ms_per_token_p90"],
            f"{timings[path]['ms_per_token'] / timings['direct']['ms_per_token']:.3f}x",
            "yes" if all(g["tokens"] == tokens["direct"] for g in generations[path]) else "NO",
        )
        for path in PATHS
    ]
    print_table(
        f"nat: tiny LLaMA (6 blocks, fp32), {PROMPT}-token prompt, {NEW_TOKENS} new tokens, "
        f"{ROUNDS} generations per path taken in turns; client behind a cone NAT",
        [
            "path",
            "TTFT cold ms",
            "TTFT warm ms",
            "ms/token",
            "p90",
            "vs direct",
            "tokens as direct",
        ],
        rows,
    )
    punch_rows = []
    for pair, tries in results["punches"].items():
        direct = [t for t in tries if t["direct"]]
        seconds = [t["seconds"] for t in direct]
        punch_rows.append(
            (
                pair,
                f"{len(direct)}/{len(tries)}",
                median(seconds) * 1e3 if seconds else None,
                max(seconds) * 1e3 if seconds else None,
            )
        )
    print_table(
        "nat: hole punching, each try from a fresh socket (what did not punch used the relay)",
        ["NATs", "direct", "median ms", "max ms"],
        punch_rows,
    )
    rtts = results["rtts"]
    relayed_rtt, direct_rtt = median(rtts["relayed"]), median(rtts["direct"])
    extra_leg_ms = relayed_rtt - direct_rtt
    print_table(
        f"nat: round trips (dht.ping, {PINGS} each) from the clients' host to the cone NAT's "
        "server, through the relay and through a punched hole",
        ["path", "median ms", "p90 ms"],
        [
            ("relayed", relayed_rtt, percentile(rtts["relayed"], 0.9)),
            ("punched", direct_rtt, percentile(rtts["direct"], 0.9)),
            ("the relay's extra leg", extra_leg_ms, None),
        ],
    )
    cone = results["punches"]["cone server, cone client"]
    punched = [t for t in cone if t["direct"]]
    slowest = max((t["seconds"] for t in punched), default=float("inf"))
    summarize(
        "nat",
        "hole punches between cone NATs that succeeded in < 2 s (of 50)",
        sum(t["seconds"] < PUNCH_TARGET_S for t in punched),
        TRIES,
        unit="tries",
        target=">= 49",
        met=sum(t["seconds"] < PUNCH_TARGET_S for t in punched) >= 49,
    )
    summarize("nat", "slowest successful punch between cone NATs", slowest * 1e3)
    relayed_ms = timings["relayed"]["ms_per_token"]
    direct_ms = timings["direct"]["ms_per_token"]
    allowed_ms = RELAYED_TARGET * (direct_ms + max(extra_leg_ms, 0.0))
    summarize(
        "nat",
        "relayed ms/token vs direct's plus the relay's extra leg (measured round trips)",
        relayed_ms,
        direct_ms + max(extra_leg_ms, 0.0),
        target=f"<= {RELAYED_TARGET}x",
        met=relayed_ms <= allowed_ms,
    )
    summarize(
        "nat",
        "relayed (symmetric NAT) tokens identical to direct",
        float(same),
        unit="bool",
        target="1",
        met=same,
    )
    print(f"machine: load before {load_before}; after {load_after}")
    print(f"total {time.perf_counter() - started:.0f} s")
    write_json(
        "nat",
        {
            "model": "tiny random LLaMA, 6 blocks, hidden 64, fp32, CPU, one thread",
            "prompt_tokens": PROMPT,
            "new_tokens": NEW_TOKENS,
            "rounds": ROUNDS,
            "timings": timings,
            "round_trips_ms": rtts,
            "relay_extra_leg_ms": extra_leg_ms,
            "tokens_identical": same,
            "relays_used": results["relays"],
            "punches": results["punches"],
            "load": {"before": load_before, "after": load_after},
        },
    )


if __name__ == "__main__":
    main()
