"""What petals_core does so far: two peers on loopback exchanging tensors over the QUIC transport.

``python -m petals_core.demo`` starts a server peer in a separate process (with a persistent
identity file, as a real server would), dials it by its multiaddr (so the server must prove
its PeerID), sends hidden-state-sized tensors through an RPC that runs a small computation on
them, checks the results, and prints the measured round trips.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import trio

from .transport import (
    Handlers,
    ServerCall,
    call_unary,
    compress,
    load_or_create_identity,
    open_call,
    open_node,
    serve_rpc,
)

_READY = "listening on "


async def _serve(identity_path: str) -> None:
    import torch

    handlers = Handlers()

    @handlers.unary("scale")
    async def scale(request: dict, call: ServerCall) -> dict:
        hidden = request["hidden"]
        return {"hidden": hidden * request["factor"]}

    @handlers.stream("accumulate")
    async def accumulate(call: ServerCall) -> None:
        total = None
        async for message in call:
            part = message["hidden"].float()
            total = part if total is None else total + part
            await call.send({"running_sum": float(total.sum())})

    torch.set_num_threads(1)
    async with open_node(load_or_create_identity(identity_path)) as node:
        print(_READY + str(node.listen_multiaddr), flush=True)
        await serve_rpc(node, handlers)


async def _client(address: str, rounds: int) -> None:
    import torch

    torch.manual_seed(0)
    async with open_node() as node:
        with trio.fail_after(30):
            connection = await node.connect(address)
        print(f"connected to {connection.peer_id} (it proved the key its PeerID names)")
        print(f"{'tensor':<28} {'bytes':>10} {'median RTT ms':>14} {'p90 ms':>8}  check")
        for shape, dtype in (
            ((1, 1, 576), torch.float32),  # one token of SmolLM2-135M
            ((1, 1, 4096), torch.bfloat16),  # one token of a 7B model
            ((1, 128, 4096), torch.bfloat16),  # a 128-token prefill
            ((1, 2048, 4096), torch.float16),  # a long prefill, 16 MiB
        ):
            hidden = torch.randn(shape).to(dtype)
            times = []
            ok = True
            for _ in range(rounds if hidden.numel() < 1 << 20 else max(3, rounds // 10)):
                start = trio.current_time()
                with trio.fail_after(30):
                    reply = await call_unary(connection, "scale", {"hidden": hidden, "factor": 2})
                times.append(trio.current_time() - start)
                ok = ok and torch.equal(reply["hidden"], hidden * 2)
            nbytes = hidden.numel() * hidden.element_size()
            label = f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
            print(
                f"{label:<28} {nbytes:>10} {statistics.median(times) * 1e3:>14.3f} "
                f"{sorted(times)[int(len(times) * 0.9) - 1] * 1e3:>8.3f}  "
                f"{'exact' if ok else 'WRONG'}"
            )
        hidden = torch.randn(1, 64, 4096)
        async with open_call(connection, "accumulate") as call:
            for _ in range(4):
                await call.send({"hidden": compress(hidden, "blockwise8")})
                reply = await call.receive()
            await call.send_eof()
        error = abs(reply["running_sum"] - float(hidden.sum()) * 4) / float(hidden.abs().sum() * 4)
        print(f"streaming call with 8-bit blockwise compression: relative error {error:.2e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m petals_core.demo", description=__doc__)
    parser.add_argument("--rounds", type=int, default=200, help="round trips per tensor size")
    parser.add_argument("--serve", metavar="IDENTITY_PATH", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        trio.run(_serve, args.serve)
        return
    with tempfile.TemporaryDirectory() as folder:
        identity_path = os.path.join(folder, "server.key")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [sys.executable, "-m", "petals_core.demo", "--serve", identity_path],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert server.stdout is not None
            line = server.stdout.readline()
            if not line.startswith(_READY):
                raise SystemExit(f"the server peer did not start (it printed {line!r})")
            address = line[len(_READY) :].strip()
            print(f"server peer (pid {server.pid}) at {address}")
            trio.run(_client, address, args.rounds)
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
