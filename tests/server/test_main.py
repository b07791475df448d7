"""``python -m petals_core.server`` as real processes: it serves the blocks it is told, a second
server fills the gap the first leaves, both stop cleanly on SIGTERM (announcing OFFLINE, so
that nobody lists them after); a config that cannot start exits 1; ``--throughput dry_run``
prints a throughput without serving.  In process: bad flags exit 2, and flags reach the
config."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from petals_core import ConfigError
from petals_core.dht import open_dht_node
from petals_core.models import default_dht_prefix
from petals_core.protocol import INFO
from petals_core.server.__main__ import build_parser, config_from_args, main, parse_nbytes
from petals_core.server._config import ServerConfig
from petals_core.transport import Multiaddr, call_unary, open_node

from ..models.conftest import TinyCheckpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
LISTENING = "Server listening on "
SERVING = re.compile(r"Serving blocks (\d+):(\d+) of (.+) \(prefix (.+)\)")
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
COMMAND = [sys.executable, "-m", "petals_core.server"]


class _Lines:
    """Lines of a process's stdout, read as they come."""

    def __init__(self, process: trio.Process) -> None:
        assert process.stdout is not None
        self._stream = process.stdout
        self._buffer = b""
        self.seen: list[str] = []

    async def next(self) -> str:
        while b"\n" not in self._buffer:
            chunk = await self._stream.receive_some()
            if not chunk:
                raise AssertionError(f"the server exited; its stdout: {self.seen!r}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.seen.append(line.decode())
        return self.seen[-1]


@asynccontextmanager
async def running_server(
    args: list[str], stderr_path: Path
) -> AsyncIterator[tuple[trio.Process, list[Multiaddr], range]]:
    """Start a server; yield it once it has printed its addresses and its blocks."""
    with stderr_path.open("wb") as stderr:
        process = await trio.lowlevel.open_process(
            COMMAND + args, stdout=subprocess.PIPE, stderr=stderr, env=ENV, cwd=REPO_ROOT
        )
    try:
        lines = _Lines(process)
        addresses: list[Multiaddr] = []
        with trio.fail_after(START_TIMEOUT_S):
            while True:
                line = await lines.next()
                if line.startswith(LISTENING):
                    addresses.append(Multiaddr.parse(line.removeprefix(LISTENING)))
                    continue
                match = SERVING.fullmatch(line)
                assert match is not None, f"unexpected line {line!r}; stderr: {stderr_path}"
                blocks = range(int(match.group(1)), int(match.group(2)))
                break
        assert addresses
        yield process, addresses, blocks
    finally:
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(STOP_TIMEOUT_S):
                await process.wait()


async def _info(address: Multiaddr) -> dict[str, Any]:
    async with open_node() as client:
        connection = await client.connect(address)
        return await call_unary(connection, INFO, {})


async def _stop(process: trio.Process) -> int:
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(STOP_TIMEOUT_S):
        return await process.wait()


async def test_servers_serve_their_blocks_fill_the_gap_and_stop_on_sigterm(
    server_llama: TinyCheckpoint, tmp_path: Path
) -> None:
    common = ["--host", "127.0.0.1", "--throughput", "1", "--cache_dir", str(tmp_path / "cache")]
    first_args = [str(server_llama.folder), "--new_swarm", "--block_indices", "0:3", *common]
    async with running_server(first_args, tmp_path / "first.err") as (first, addresses, blocks):
        assert blocks == range(0, 3)
        with trio.fail_after(START_TIMEOUT_S):
            info = await _info(addresses[0])
        assert (info["start_block"], info["end_block"]) == (0, 3)

        second_args = [str(server_llama.folder), "--num_blocks", "3", *common]
        second_args += ["--initial_peers", str(addresses[0])]
        async with running_server(second_args, tmp_path / "second.err") as (second, more, gap):
            assert gap == range(3, 6)
            with trio.fail_after(START_TIMEOUT_S):
                info = await _info(more[0])
            assert (info["start_block"], info["end_block"]) == (3, 6)
            assert await _stop(second) == 0
        # It left as it should, announcing itself OFFLINE: nobody lists it any more.
        with trio.fail_after(START_TIMEOUT_S):
            async with open_dht_node(
                initial_peers=[str(addresses[0])], client_mode=True, request_timeout_s=2.0
            ) as reader:
                prefix = default_dht_prefix(server_llama.folder, "llama")
                snapshot = await reader.get_servers(prefix, range(6))
        assert snapshot.peer_ids == {str(addresses[0].peer_id)}
        assert await _stop(first) == 0
    assert "leaving the swarm" in (tmp_path / "first.err").read_text()


async def test_a_config_that_cannot_start_exits_1_and_dry_run_measures(
    server_llama: TinyCheckpoint, tmp_path: Path
) -> None:
    model = str(server_llama.folder)
    cache = ["--cache_dir", str(tmp_path / "cache")]
    runs = {
        "no swarm": [model, "--host", "127.0.0.1", *cache],
        "dry_run": [model, "--throughput", "dry_run", "--num_blocks", "3", *cache],
    }
    results: dict[str, subprocess.CompletedProcess[bytes]] = {}

    async def run(name: str) -> None:
        results[name] = await trio.run_process(
            COMMAND + runs[name], capture_stdout=True, capture_stderr=True, check=False, env=ENV
        )

    with trio.fail_after(START_TIMEOUT_S):
        async with trio.open_nursery() as nursery:
            for name in runs:
                nursery.start_soon(run, name)

    no_swarm = results["no swarm"]
    assert no_swarm.returncode == 1, no_swarm.stderr
    assert b"error: give --initial_peers" in no_swarm.stderr
    assert b"--new_swarm" in no_swarm.stderr

    dry = results["dry_run"]
    assert dry.returncode == 0, dry.stderr
    assert re.fullmatch(
        rb"throughput: [0-9.]+ rps \(inference [0-9.]+, forward [0-9.]+, network [0-9.]+\)\n",
        dry.stdout,
    ), dry.stdout
    assert (tmp_path / "cache" / "throughput_v1.json").is_file()  # measured and cached
    assert b"Server listening" not in dry.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--block_indices", "3"], "argument --block_indices: '3' is not start:end"),
        (["--block_indices", "4:2"], "argument --block_indices: '4:2': need 0 <= start < end"),
        (["--throughput", "fast"], "argument --throughput: 'fast' is neither"),
        (["--max_disk_space", "10XB"], "argument --max_disk_space: '10XB' is not a size"),
        (["--step_timeout", "0"], "argument --step_timeout: must be a positive number"),
        (["--quant_type", "int4"], "argument --quant_type: invalid choice"),
        (["--inline_compute_ms", "-1"], "argument --inline_compute_ms: must be a number >= 0"),
        (["--cpu_decode", "fast"], "argument --cpu_decode: invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_argparse_message(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In process: argparse exits before anything else happens (no logging set up, no I/O)."""
    with pytest.raises(SystemExit) as exited:
        main(["model", "--new_swarm", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_inline_compute_flag_reaches_the_serving_limits() -> None:
    parser = build_parser()
    default = config_from_args(parser.parse_args(["model", "--new_swarm"]))
    assert default.limits.inline_compute_s == pytest.approx(0.025)
    off = config_from_args(parser.parse_args(["model", "--new_swarm", "--inline_compute_ms", "0"]))
    assert off.limits.inline_compute_s == 0.0
    set_ = config_from_args(
        parser.parse_args(["model", "--new_swarm", "--inline_compute_ms", "2.5"])
    )
    assert set_.limits.inline_compute_s == pytest.approx(0.0025)


def test_dtype_quantisation_and_block_count_default_to_auto() -> None:
    """Unset, they are decided when the server starts (nf4 and as many blocks as fit on CUDA);
    ``--quant_type none`` forces unquantised blocks on CUDA too."""
    parser = build_parser()
    default = config_from_args(parser.parse_args(["model", "--new_swarm"]))
    assert (default.torch_dtype, default.quant_type) == ("auto", None)
    assert (default.num_blocks, default.block_indices, default.attn_cache_tokens) == (None,) * 3
    for flag, expected in [("auto", None), ("none", "none"), ("int8", "int8"), ("nf4", "nf4")]:
        args = parser.parse_args(["model", "--new_swarm", "--quant_type", flag])
        assert config_from_args(args).quant_type == expected


def test_cpu_decode_flag_reaches_the_config() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["model", "--new_swarm"])).cpu_decode == "numpy"
    for choice in ("numpy", "torch"):
        args = parser.parse_args(["model", "--new_swarm", "--cpu_decode", choice])
        assert config_from_args(args).cpu_decode == choice
    with pytest.raises(ConfigError, match="cpu_decode 'fast' is not one of numpy, torch"):
        ServerConfig(model="model", cpu_decode="fast")  # type: ignore[arg-type]


def test_parse_nbytes() -> None:
    assert parse_nbytes("10GB") == 10 * 10**9
    assert parse_nbytes("500MB") == 500 * 10**6
    assert parse_nbytes("1.5GiB") == 3 * 2**29
    assert parse_nbytes("2 kb") == 2000
    assert parse_nbytes("123") == 123
    for bad in ("", "GB", "-1GB", "10XB", "1e9"):
        with pytest.raises(Exception, match="is not a size"):
            parse_nbytes(bad)


def test_disk_and_session_flags_reach_the_config() -> None:
    """``--max_disk_space`` bounds the model's files in the cache (tests/models/test_disk.py);
    unset, the attention cache and the longest session are the model's defaults."""
    parser = build_parser()
    default = config_from_args(parser.parse_args(["model", "--new_swarm"]))
    assert default.max_disk_space is None
    assert default.limits.inference_max_length is None
    flags = ["--max_disk_space", "10GB", "--inference_max_length", "4096"]
    given = config_from_args(parser.parse_args(["model", "--new_swarm", *flags]))
    assert given.max_disk_space == 10 * 10**9
    assert given.limits.inference_max_length == 4096
