"""Throughput measurement and its on-disk cache: real measurements of tiny blocks, counted."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import multiprocessing
import threading
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from transformers import GPT2Config, PretrainedConfig

from petals_core._errors import ConfigError
from petals_core.models import QuantType
from petals_core.server._throughput import (
    CACHE_FILE_NAME,
    DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S,
    LOCK_FILE_NAME,
    RELAY_PENALTY,
    ComputeMeasure,
    ThroughputInfo,
    get_server_throughput,
    measure_compute_rps,
    throughput_cache_key,
)
from petals_core.testing import tiny_falcon_config, tiny_mixtral_config
from tests.models.conftest import HIDDEN, tiny_bloom_config, tiny_llama_config

CPU = torch.device("cpu")


class CountingMeasure:
    """measure_compute_rps (shortened), counting its calls as lines of a file.

    A file, so that threads and processes sharing a cache directory are counted together.
    """

    def __init__(self, counter: Path, *, check_lock: Path | None = None) -> None:
        self.counter = counter
        self.check_lock = check_lock
        self.lock_was_held: list[bool] = []

    def __call__(
        self,
        config: PretrainedConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        quant_type: QuantType,
    ) -> tuple[float, float]:
        with self.counter.open("a") as file:
            file.write(f"{dtype}\n")
        if self.check_lock is not None:
            self.lock_was_held.append(_is_locked(self.check_lock))
        return measure_compute_rps(
            config,
            device=device,
            dtype=dtype,
            quant_type=quant_type,
            n_tokens=32,
            n_steps=2,
            n_decode_steps=4,
        )

    @property
    def calls(self) -> int:
        return len(self.counter.read_text().splitlines()) if self.counter.exists() else 0


def _is_locked(path: Path) -> bool:
    with path.open("a+b") as file:
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
        return False


def _throughput(
    cache_dir: Path,
    measure: ComputeMeasure,
    *,
    config: PretrainedConfig | None = None,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 4,
    network_bandwidth_bits_per_s: float | None = None,
    force_eval: bool = False,
) -> ThroughputInfo:
    return get_server_throughput(
        tiny_llama_config() if config is None else config,
        device=CPU,
        dtype=dtype,
        quant_type="none",
        num_blocks=num_blocks,
        cache_dir=cache_dir,
        network_bandwidth_bits_per_s=network_bandwidth_bits_per_s,
        force_eval=force_eval,
        measure=measure,
    )


def _cache_entries(cache_dir: Path) -> dict[str, dict[str, float]]:
    data = json.loads((cache_dir / CACHE_FILE_NAME).read_text())
    entries: dict[str, dict[str, float]] = data["entries"]
    return entries


@pytest.fixture
def measure(tmp_path: Path) -> CountingMeasure:
    return CountingMeasure(tmp_path / "measure-calls.txt")


# --- measuring ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_config", [tiny_llama_config, tiny_bloom_config, tiny_falcon_config, tiny_mixtral_config]
)
def test_tiny_blocks_measure_positive_finite_rates(
    make_config: Callable[[], PretrainedConfig],
) -> None:
    inference_rps, forward_rps = measure_compute_rps(
        make_config(), device=CPU, dtype=torch.float32, quant_type="none"
    )
    for rate in (inference_rps, forward_rps):
        assert math.isfinite(rate)
        assert rate > 0


def test_measuring_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    measure_compute_rps(
        tiny_llama_config(),
        device=CPU,
        dtype=torch.float32,
        quant_type="none",
        n_tokens=8,
        n_steps=1,
        n_decode_steps=1,
    )
    assert torch.equal(torch.rand(3), expected)


def test_unsupported_model_type_is_a_config_error(tmp_path: Path) -> None:
    config = GPT2Config(n_embd=HIDDEN, n_layer=1, n_head=4)
    with pytest.raises(ConfigError, match="gpt2"):
        measure_compute_rps(config, device=CPU, dtype=torch.float32, quant_type="none")


# --- the announced figure ----------------------------------------------------------------------


def test_throughput_follows_petals_formula(tmp_path: Path, measure: CountingMeasure) -> None:
    info = _throughput(tmp_path, measure, num_blocks=5)
    assert info.network_rps == pytest.approx(DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S / (HIDDEN * 16))
    # A request uses (5 + 1) / 2 = 3 of the server's blocks on average.
    assert info.throughput == pytest.approx(min(info.forward_rps / 3, info.network_rps))


def test_network_caps_the_throughput(tmp_path: Path, measure: CountingMeasure) -> None:
    bandwidth = 8 * HIDDEN * 16  # bits/s: 8 hidden states per second
    info = _throughput(tmp_path, measure, num_blocks=1, network_bandwidth_bits_per_s=bandwidth)
    assert info.network_rps == pytest.approx(8.0)
    assert info.throughput == info.network_rps
    assert info.throughput < info.forward_rps


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    num_blocks=st.integers(1, 1000),
    bandwidth=st.floats(1.0, 1e12, allow_nan=False, allow_infinity=False),
)
def test_throughput_never_exceeds_network_or_one_block(
    tmp_path: Path, measure: CountingMeasure, num_blocks: int, bandwidth: float
) -> None:
    info = _throughput(
        tmp_path, measure, num_blocks=num_blocks, network_bandwidth_bits_per_s=bandwidth
    )
    assert 0 < info.throughput <= info.network_rps
    assert info.throughput <= info.forward_rps
    # Neither the span nor the bandwidth is part of the cache key: one measurement serves all.
    assert measure.calls == 1


@pytest.mark.parametrize("num_blocks", [0, -3])
def test_no_blocks_is_a_config_error(
    tmp_path: Path, measure: CountingMeasure, num_blocks: int
) -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        _throughput(tmp_path, measure, num_blocks=num_blocks)
    assert measure.calls == 0


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.nan, math.inf])
def test_bad_bandwidth_is_a_config_error(
    tmp_path: Path, measure: CountingMeasure, bandwidth: float
) -> None:
    with pytest.raises(ConfigError, match="bandwidth"):
        _throughput(tmp_path, measure, network_bandwidth_bits_per_s=bandwidth)


@pytest.mark.parametrize("field", ["inference_rps", "forward_rps", "network_rps", "throughput"])
@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_throughput_info_refuses_non_positive_rates(field: str, bad: float) -> None:
    rates = dict.fromkeys(("inference_rps", "forward_rps", "network_rps", "throughput"), 1.0)
    with pytest.raises(ValueError, match=field):
        ThroughputInfo(**{**rates, field: bad})


def test_through_a_relay_the_network_counts_a_fifth() -> None:
    # Network-bound: its share shrinks.  Compute-bound far below the network: unchanged.
    network_bound = ThroughputInfo(
        inference_rps=50.0, forward_rps=5000.0, network_rps=1000.0, throughput=1000.0
    )
    assert network_bound.through_relay() == pytest.approx(1000.0 * RELAY_PENALTY)
    compute_bound = ThroughputInfo(
        inference_rps=5.0, forward_rps=100.0, network_rps=1000.0, throughput=50.0
    )
    assert compute_bound.through_relay() == 50.0


def test_a_broken_measurement_is_refused_and_not_cached(tmp_path: Path) -> None:
    def broken(
        config: PretrainedConfig,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        quant_type: QuantType,
    ) -> tuple[float, float]:
        return math.nan, 1.0

    with pytest.raises(ValueError, match="positive finite"):
        _throughput(tmp_path, broken, num_blocks=1)
    assert not (tmp_path / CACHE_FILE_NAME).exists()


# --- the cache ---------------------------------------------------------------------------------


def test_second_call_hits_the_cache(tmp_path: Path, measure: CountingMeasure) -> None:
    first = _throughput(tmp_path, measure)
    second = _throughput(tmp_path, measure)
    assert measure.calls == 1
    assert second == first
    key = throughput_cache_key(
        tiny_llama_config(), device=CPU, dtype=torch.float32, quant_type="none"
    )
    assert _cache_entries(tmp_path)[key] == {
        "inference_rps": first.inference_rps,
        "forward_rps": first.forward_rps,
    }


def test_force_eval_measures_again(tmp_path: Path, measure: CountingMeasure) -> None:
    _throughput(tmp_path, measure)
    _throughput(tmp_path, measure, force_eval=True)
    assert measure.calls == 2
    _throughput(tmp_path, measure)
    assert measure.calls == 2
    assert len(_cache_entries(tmp_path)) == 1


def test_each_dtype_and_family_has_its_own_entry(tmp_path: Path, measure: CountingMeasure) -> None:
    _throughput(tmp_path, measure, dtype=torch.float32)
    _throughput(tmp_path, measure, dtype=torch.bfloat16)
    _throughput(tmp_path, measure, config=tiny_bloom_config())
    assert measure.calls == 3
    assert len(_cache_entries(tmp_path)) == 3
    _throughput(tmp_path, measure, dtype=torch.bfloat16)
    assert measure.calls == 3


def test_cache_key_names_what_the_speed_depends_on() -> None:
    def key(
        config: PretrainedConfig, dtype: torch.dtype = torch.float32, quant: QuantType = "none"
    ) -> str:
        return throughput_cache_key(config, device=CPU, dtype=dtype, quant_type=quant)

    base = key(tiny_llama_config())
    assert key(tiny_llama_config()) == base
    # Depth and vocabulary do not change one block's speed; width, heads, dtype, quantisation do.
    assert key(tiny_llama_config(num_hidden_layers=2, vocab_size=512)) == base
    different = [
        key(tiny_llama_config(hidden_size=128)),
        key(tiny_llama_config(intermediate_size=256)),
        key(tiny_llama_config(num_key_value_heads=4)),
        key(tiny_llama_config(), dtype=torch.bfloat16),
        key(tiny_llama_config(), quant="nf4"),
        key(tiny_llama_config(), quant="int8"),
        key(tiny_bloom_config()),
    ]
    assert len({base, *different}) == len(different) + 1
    assert torch.__version__ in base


def test_cache_keys_tell_falcon_layouts_and_mixtral_routings_apart() -> None:
    def key(config: PretrainedConfig) -> str:
        return throughput_cache_key(config, device=CPU, dtype=torch.float32, quant_type="none")

    falcons = [
        tiny_falcon_config(),  # new decoder architecture, 2 key/value heads
        tiny_falcon_config(num_kv_heads=4),
        tiny_falcon_config(new_decoder_architecture=False, multi_query=True),
        tiny_falcon_config(new_decoder_architecture=False, multi_query=False),
        tiny_falcon_config(new_decoder_architecture=False, parallel_attn=False),
        tiny_falcon_config(new_decoder_architecture=False, parallel_attn=False, alibi=True),
        tiny_falcon_config(ffn_hidden_size=96),
    ]
    mixtrals = [
        tiny_mixtral_config(),
        tiny_mixtral_config(num_local_experts=4),
        tiny_mixtral_config(num_experts_per_tok=1),
    ]
    keys = [key(config) for config in [*falcons, *mixtrals]]
    assert len(set(keys)) == len(keys)
    assert "kv_heads=1" in key(falcons[2])  # multi-query: one key/value head
    assert key(tiny_mixtral_config(num_hidden_layers=2)) == keys[len(falcons)]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe\x00",
        b"[1, 2, 3]",
        b'{"version": 0, "entries": {}}',
        b'{"version": 1, "entries": []}',
        b"",
    ],
)
def test_corrupt_cache_file_is_logged_and_replaced(
    tmp_path: Path, measure: CountingMeasure, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    (tmp_path / CACHE_FILE_NAME).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="petals_core.server._throughput"):
        info = _throughput(tmp_path, measure)
    assert measure.calls == 1
    assert "Ignoring the throughput cache" in caplog.text
    assert info.throughput > 0
    assert len(_cache_entries(tmp_path)) == 1  # rewritten, readable
    _throughput(tmp_path, measure)
    assert measure.calls == 1


@pytest.mark.parametrize(
    "entry", [{"inference_rps": -1.0, "forward_rps": 5.0}, {"forward_rps": 5.0}, "fast", None]
)
def test_malformed_entry_is_measured_again(
    tmp_path: Path, measure: CountingMeasure, entry: object
) -> None:
    key = throughput_cache_key(
        tiny_llama_config(), device=CPU, dtype=torch.float32, quant_type="none"
    )
    other = {"inference_rps": 1.0, "forward_rps": 2.0}
    cache = {"version": 1, "entries": {key: entry, "other-key": other}}
    (tmp_path / CACHE_FILE_NAME).write_text(json.dumps(cache))
    _throughput(tmp_path, measure)
    assert measure.calls == 1
    entries = _cache_entries(tmp_path)
    assert entries["other-key"] == other  # entries of other setups survive
    assert entries[key]["inference_rps"] > 0


def test_cache_dir_is_created(tmp_path: Path, measure: CountingMeasure) -> None:
    cache_dir = tmp_path / "a" / "b"
    _throughput(cache_dir, measure)
    assert (cache_dir / CACHE_FILE_NAME).is_file()


# --- concurrency -------------------------------------------------------------------------------


def test_lock_is_held_while_measuring(tmp_path: Path) -> None:
    measure = CountingMeasure(tmp_path / "calls.txt", check_lock=tmp_path / LOCK_FILE_NAME)
    _throughput(tmp_path, measure)
    assert measure.lock_was_held == [True]
    assert not _is_locked(tmp_path / LOCK_FILE_NAME)  # and released afterwards


def test_racing_threads_measure_once(tmp_path: Path, measure: CountingMeasure) -> None:
    barrier = threading.Barrier(2, timeout=60)
    results: list[ThroughputInfo] = []
    errors: list[BaseException] = []

    def server() -> None:
        try:
            barrier.wait()
            results.append(_throughput(tmp_path, measure))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=server) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert len(results) == 2
    assert results[0] == results[1]
    assert measure.calls == 1


def _server_process(
    cache_dir: str, counter: str, start: threading.Barrier, out: multiprocessing.Queue[object]
) -> None:
    torch.set_num_threads(1)
    start.wait()  # both servers are up (torch imported) before either looks at the cache
    info = _throughput(Path(cache_dir), CountingMeasure(Path(counter)))
    out.put(attrs.asdict(info))


def test_racing_processes_measure_once(tmp_path: Path) -> None:
    # One spawned server races this process (a second spawned one would only add its start-up).
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2, timeout=120)
    out: multiprocessing.Queue[object] = context.Queue()
    counter = tmp_path / "calls.txt"
    process = context.Process(
        target=_server_process, args=(str(tmp_path), str(counter), start, out)
    )
    process.start()
    try:
        start.wait()
        here = attrs.asdict(_throughput(tmp_path, CountingMeasure(counter)))
        there = out.get(timeout=120)
    finally:
        process.join(timeout=60)
    assert process.exitcode == 0
    assert here == there
    assert CountingMeasure(counter).calls == 1
