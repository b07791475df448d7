"""``python -m petals_core.api``: flags, the line it prints, answering, and stopping on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

import pytest
import torch
import trio

from petals_core.api.__main__ import (
    API_KEY_ENV,
    LISTENING,
    build_parser,
    config_from_args,
    main,
)

TIMEOUT_S = 120.0


def _config(*argv: str) -> Any:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_flags_map_onto_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = _config(
        "org/model",
        "--initial_peers",
        "/ip4/1.2.3.4/udp/1/quic-v1/p2p/QmX",
        "--port",
        "0",
        "--model_name",
        "mine",
        "--dht_prefix",
        "swarm-name",
        "--max_concurrent_requests",
        "3",
        "--max_choices",
        "2",
        "--request_timeout",
        "30",
    )
    assert config.model == "org/model"
    assert config.name == "mine"
    assert config.port == 0
    assert config.limits.max_concurrent_requests == 3
    assert config.limits.max_rows == 2
    assert config.api_key is None
    assert dict(config.client_options) == {"dht_prefix": "swarm-name", "request_timeout": 30.0}
    assert config.device is None
    on_gpu = _config("m", "--initial_peers", "x", "--device", "cuda", "--torch_dtype", "bfloat16")
    assert on_gpu.device == "cuda"
    assert on_gpu.allow_origins == ()
    assert on_gpu.decode_groups == 1
    assert _config("m", "--initial_peers", "x", "--decode_groups", "2").decode_groups == 2
    web = _config("m", "--initial_peers", "x", "--allow_origins", "http://a:1", "http://b:2")
    assert web.allow_origins == ("http://a:1", "http://b:2")
    assert dict(on_gpu.client_options) == {"torch_dtype": torch.bfloat16}
    assert (on_gpu.speculative, on_gpu.prompt_lookup_num_tokens) == (None, 10)
    drafting = _config("m", "--initial_peers", "x", "--speculative", "prompt_lookup")
    assert (drafting.speculative, drafting.prompt_lookup_num_tokens) == ("prompt_lookup", 10)
    fewer = _config("m", "--initial_peers", "x", "--prompt_lookup_num_tokens", "4")
    assert fewer.prompt_lookup_num_tokens == 4
    monkeypatch.setenv(API_KEY_ENV, "secret")
    assert _config("m", "--initial_peers", "x").api_key == "secret"


@pytest.mark.parametrize(
    "argv",
    [
        ["m"],  # no --initial_peers
        ["m", "--initial_peers", "x", "--max_concurrent_requests", "0"],
        ["m", "--initial_peers", "x", "--port", "70000"],
        ["m", "--initial_peers", "x", "--decode_groups", "0"],
        ["m", "--initial_peers", "x", "--request_timeout", "-1"],
        ["m", "--initial_peers", "x", "--prompt_lookup_num_tokens", "0"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_an_unknown_speculative_method_is_named_with_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["m", "--initial_peers", "x", "--speculative", "medusa"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "--speculative: invalid choice: 'medusa'" in error
    assert "prompt_lookup" in error


def _get(url: str, key: str | None = None) -> tuple[int, Any]:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


async def test_serves_until_sigterm_with_an_api_key(endpoint: Any) -> None:
    env_key = {API_KEY_ENV: "s3cret"}
    command = [
        sys.executable,
        "-m",
        "petals_core.api",
        endpoint.repo,
        "--initial_peers",
        *endpoint.swarm.initial_peers,
        "--port",
        "0",
        "--model_name",
        "smol",
    ]
    process = await trio.lowlevel.open_process(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env_key, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    try:
        with trio.fail_after(TIMEOUT_S):
            assert process.stdout is not None
            buffer = b""
            while b"\n" not in buffer:
                data = await process.stdout.receive_some()
                assert data, "the endpoint exited before it listened"
                buffer += data
            line = buffer.split(b"\n")[0].decode()
            assert line.startswith(LISTENING) and line.endswith("(model smol)")
            base = line[len(LISTENING) :].split(" ")[0]
            status, body = await trio.to_thread.run_sync(_get, f"{base}/models")
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
            status, body = await trio.to_thread.run_sync(_get, f"{base}/models", "s3cret")
            assert status == 200 and body["data"][0]["id"] == "smol"
            process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
