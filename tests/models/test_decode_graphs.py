"""Decode graphs' row-table steps against the eager ``forward_many``, on CPU.

On CPU nothing is captured: :class:`DecodeGraphs` runs the same step on its static buffers
eagerly, the row-table kernels through Triton's interpreter.  So these tests cover everything
but the capture (buckets, tables, padding rows, groups beyond ``max_rows``, sub-spans, the graph
cache) and compare with the eager path, outputs and caches both.  The capture itself runs in
``tests/models/test_decode_graphs_cuda.py`` on machines with a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from petals_core import ConfigError
from petals_core.models import BloomBlock, FalconBlock, KVCache, LlamaBlock, MixtralBlock
from petals_core.models._decode_graphs import DecodeGraphs, DecodeGraphsConfig
from petals_core.models._row_caches import bucket
from petals_core.testing import tiny_falcon_config, tiny_mixtral_config

from ._steps import eager_steps, perturbed, twin
from .conftest import HIDDEN, tiny_bloom_config, tiny_llama_config

torch.set_num_threads(1)

Block = LlamaBlock | BloomBlock | FalconBlock | MixtralBlock
TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
SPAN = 3


FAMILIES: dict[str, Callable[[int], Block]] = {
    "llama-gqa": lambda i: LlamaBlock(tiny_llama_config(), i),
    "llama3-rope": lambda i: LlamaBlock(
        tiny_llama_config(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
        i,
    ),
    "bloom": lambda i: BloomBlock(tiny_bloom_config(), i),
    "bloom-residual-post-ln": lambda i: BloomBlock(
        tiny_bloom_config(apply_residual_connection_post_layernorm=True), i
    ),
    "falcon-40b-layout": lambda i: FalconBlock(tiny_falcon_config(), i),
    "falcon-7b-layout": lambda i: FalconBlock(
        tiny_falcon_config(new_decoder_architecture=False, multi_query=True), i
    ),
    "falcon-sequential": lambda i: FalconBlock(
        tiny_falcon_config(
            new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True
        ),
        i,
    ),
    "mixtral": lambda i: MixtralBlock(tiny_mixtral_config(), i),
}


def _span(family: str) -> list[Block]:
    return [perturbed(FAMILIES[family](i), seed=10 + i) for i in range(SPAN)]  # type: ignore[misc]


def _sessions(
    blocks: list[Block], specs: list[tuple[int, int, int]], seed: int = 0
) -> list[list[KVCache]]:
    """Each spec (batch, max_length, filled): that many positions prefilled eagerly."""
    generator = torch.Generator().manual_seed(seed)
    sessions = []
    for batch, max_length, filled in specs:
        caches = [block.allocate_cache(batch, max_length) for block in blocks]
        x = torch.randn(batch, filled, HIDDEN, generator=generator)
        with torch.inference_mode():
            if not filled:
                sessions.append(caches)
                continue
            for block, cache in zip(blocks, caches, strict=True):
                x = block(x, cache=cache)
        sessions.append(caches)
    return sessions


def _tokens(specs: list[tuple[int, int, int]], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 1, HIDDEN, generator=generator) for batch, _, _ in specs]


def _assert_same_caches(a: list[list[KVCache]], b: list[list[KVCache]]) -> None:
    for caches_a, caches_b in zip(a, b, strict=True):
        for cache_a, cache_b in zip(caches_a, caches_b, strict=True):
            assert cache_a.length == cache_b.length
            filled = slice(0, cache_a.length)
            torch.testing.assert_close(
                cache_a.keys[:, :, filled], cache_b.keys[:, :, filled], **TOL
            )
            torch.testing.assert_close(
                cache_a.values[:, :, filled], cache_b.values[:, :, filled], **TOL
            )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_steps_equal_the_eager_path(family: str) -> None:
    """Three sessions of 1, 2 and 1 rows (4 rows: no padding, then 3 rows padded to 4 when the
    first one is left out), at different lengths and max lengths, over three steps."""
    blocks = _span(family)
    specs = [(1, 40, 0), (2, 24, 9), (1, 300, 257)]  # the last one needs a 512 length bucket
    eager_sessions = _sessions(blocks, specs)
    graph_sessions = twin(eager_sessions)
    graphs = DecodeGraphs(blocks, config=DecodeGraphsConfig(min_length_bucket=16))
    assert not graphs.capture  # CPU: the same step, run eagerly
    for step in range(3):
        chosen = [0, 1, 2] if step != 1 else [1, 2]
        xs = _tokens(specs, seed=step)
        xs = [xs[i] for i in chosen]
        expected = eager_steps(blocks, xs, [eager_sessions[i] for i in chosen])
        actual = graphs.step(0, SPAN, xs, [graph_sessions[i] for i in chosen])
        assert actual is not None
        for got, want in zip(actual, expected, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, **TOL)
        _assert_same_caches(graph_sessions, eager_sessions)
    statistics = graphs.statistics()
    assert statistics.replays == 3 and statistics.declined == 0
    # (rows 4, length 512) for steps 0 and 2, (rows 4 from 3, length 512) for step 1: one graph.
    assert statistics.graphs == statistics.captured == 1


def test_warm_up_writes_only_the_scratch_cache() -> None:
    blocks = _span("llama-gqa")
    graphs = DecodeGraphs(blocks, config=DecodeGraphsConfig(min_length_bucket=16))
    sessions = _sessions(blocks, [(1, 32, 4)])
    before = twin(sessions)
    graphs.warm_up()
    _assert_same_caches(sessions, before)
    assert graphs.statistics().captured == 0  # nothing kept: graphs are made on first use
    xs = _tokens([(1, 32, 4)], seed=3)
    expected = eager_steps(blocks, xs, before)
    actual = graphs.step(0, SPAN, xs, sessions)
    assert actual is not None
    torch.testing.assert_close(actual[0], expected[0], **TOL)


def test_groups_beyond_max_rows_and_sub_spans() -> None:
    blocks = _span("llama-gqa")
    specs = [(2, 32, 5), (3, 32, 7), (1, 32, 1)]
    eager_sessions = _sessions(blocks, specs)
    graph_sessions = twin(eager_sessions)
    graphs = DecodeGraphs(blocks, config=DecodeGraphsConfig(max_rows=4, min_length_bucket=16))
    # Blocks 1 and 2 only: the sessions' caches of those blocks.
    xs = _tokens(specs, seed=5)
    expected = eager_steps(blocks[1:], xs, [caches[1:] for caches in eager_sessions])
    with torch.inference_mode():  # as a server runs it
        actual = graphs.step(1, SPAN, xs, [caches[1:] for caches in graph_sessions])
    assert actual is not None
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    _assert_same_caches(graph_sessions, eager_sessions)
    # 2 rows, then 3 + 1 (4 rows): two replays of two buckets.
    statistics = graphs.statistics()
    assert statistics.replays == 2 and statistics.graphs == 2


def test_the_graph_cache_keeps_the_most_recent() -> None:
    blocks = _span("bloom")
    graphs = DecodeGraphs(
        blocks, config=DecodeGraphsConfig(max_graphs=2, min_length_bucket=16, max_rows=8)
    )
    for batch in (1, 2, 4, 1):  # buckets 1, 2, 4, then 1 again (evicted by 4)
        sessions = _sessions(blocks, [(batch, 20, 3)])
        assert graphs.step(0, SPAN, _tokens([(batch, 20, 3)], seed=batch), sessions) is not None
    statistics = graphs.statistics()
    assert statistics.graphs == 2
    assert statistics.captured == 4 and statistics.evicted == 2


def test_steps_it_declines_change_nothing() -> None:
    blocks = _span("llama-gqa")
    graphs = DecodeGraphs(blocks, config=DecodeGraphsConfig(max_rows=2, min_length_bucket=16))

    def declined(xs: list[torch.Tensor], sessions: list[list[KVCache]]) -> None:
        before = [[(cache.length, cache.keys.clone()) for cache in caches] for caches in sessions]
        assert graphs.step(0, SPAN, xs, sessions) is None
        for caches, saved in zip(sessions, before, strict=True):
            for cache, (length, keys) in zip(caches, saved, strict=True):
                assert cache.length == length and torch.equal(cache.keys, keys)

    one = _sessions(blocks, [(1, 8, 2)])
    declined([torch.randn(1, 2, HIDDEN)], one)  # two new tokens
    declined([torch.randn(1, 1, HIDDEN, dtype=torch.float64)], one)  # another dtype
    declined([torch.randn(2, 1, HIDDEN)], one)  # rows that do not match the cache
    declined([torch.randn(1, 1, HIDDEN)] * 2, one * 2)  # one session twice
    declined([torch.randn(3, 1, HIDDEN)], _sessions(blocks, [(3, 8, 2)]))  # over max_rows
    full = _sessions(blocks, [(1, 4, 4)])
    declined([torch.randn(1, 1, HIDDEN)], full)  # no room left
    padded = _sessions(blocks, [(1, 8, 2)])
    for cache in padded[0]:
        cache.set_padding(torch.tensor([1]))
    declined([torch.randn(1, 1, HIDDEN)], padded)  # left padding: the eager path handles it
    uneven = _sessions(blocks, [(1, 8, 2)])
    uneven[0][1].rollback(1)
    declined([torch.randn(1, 1, HIDDEN)], uneven)  # caches at different lengths
    declined([torch.randn(1, 1, HIDDEN)], [one[0][:2]])  # caches of fewer blocks than the span
    assert graphs.statistics().declined == 9
    assert graphs.statistics().replays == 0


def test_unsupported_blocks() -> None:
    dynamic = LlamaBlock(
        tiny_llama_config(
            max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        )
    )
    assert "dynamic" in (DecodeGraphs.unsupported_reason([dynamic]) or "")
    mixed = [LlamaBlock(tiny_llama_config()), BloomBlock(tiny_bloom_config())]
    assert "only spans of one of" in (DecodeGraphs.unsupported_reason(mixed) or "")
    assert DecodeGraphs.unsupported_reason([]) == "no blocks"
    alibi = FalconBlock(tiny_falcon_config(alibi=True))
    assert "ALiBi" in (DecodeGraphs.unsupported_reason([alibi]) or "")
    with pytest.raises(ValueError, match="cannot run decode graphs: dynamic"):
        DecodeGraphs([dynamic])
    with pytest.raises(ValueError, match="CUDA graphs need blocks on a CUDA device"):
        DecodeGraphs([LlamaBlock(tiny_llama_config())], capture=True)


def test_mixtral_takes_steps_of_enough_rows_within_its_window() -> None:
    """Its experts run on every row in a graph: replays of fewer rows than make the chosen
    experts number all 8 (2 each: 4 rows) are left to the eager path, which reads fewer weights;
    so are positions past a sliding window, which the eager path refuses."""
    blocks = [
        perturbed(MixtralBlock(tiny_mixtral_config(sliding_window=12), i), seed=i)
        for i in range(SPAN)
    ]
    graphs = DecodeGraphs(blocks, config=DecodeGraphsConfig(min_length_bucket=16))
    few = _sessions(blocks, [(1, 16, 3), (2, 16, 3)])  # 3 rows: bucket 4
    assert graphs.step(0, SPAN, _tokens([(1, 16, 3), (2, 16, 3)], seed=1), few) is not None
    assert graphs.step(0, SPAN, _tokens([(2, 16, 3)], seed=2), few[1:]) is None  # 2 rows
    late = _sessions(blocks, [(4, 16, 12)])  # the 13th position is past the window
    assert graphs.step(0, SPAN, _tokens([(4, 16, 12)], seed=3), late) is None
    # 5 rows in replays of at most 4: the second would hold 1 row, too few.
    split = DecodeGraphs(blocks, config=DecodeGraphsConfig(min_length_bucket=16, max_rows=4))
    five = _sessions(blocks, [(4, 16, 3), (1, 16, 3)])
    assert split.step(0, SPAN, _tokens([(4, 16, 3), (1, 16, 3)], seed=4), five) is None
    assert split.statistics().declined == 1
    assert graphs.statistics().declined == 2 and graphs.statistics().replays == 1
    with pytest.raises(ValueError, match="sliding window"):
        eager_steps(blocks, _tokens([(4, 16, 12)], seed=3), late)


def test_the_steps_a_server_meets_are_made_ahead() -> None:
    """Every rows bucket at every length bucket up to the longest session, shortest first, up to
    max_graphs; steps in steady state then make no graph.  (On CPU "making" a graph is keeping its
    step; on a GPU it is the capture.)"""
    blocks = _span("llama-gqa")
    config = DecodeGraphsConfig(max_rows=4, min_length_bucket=16, ahead_max_length=40)
    graphs = DecodeGraphs(blocks, config=config)
    assert graphs.capture_ahead() == 3 * 3  # rows 1, 2 and 4 at lengths 16, 32 and 64
    for specs in ([(1, 48, 3)], [(2, 48, 20)], [(1, 48, 38), (2, 48, 5)], [(3, 48, 30)]):
        sessions = _sessions(blocks, specs)
        assert graphs.step(0, SPAN, _tokens(specs, seed=1), sessions) is not None
    assert graphs.statistics().captured == graphs.statistics().graphs == 9
    assert graphs.capture_ahead() == 0  # nothing left to make
    bounded = DecodeGraphs(blocks, config=attrs.evolve(config, max_graphs=4))
    assert bounded.capture_ahead() == 4
    assert DecodeGraphs(blocks, config=DecodeGraphsConfig()).capture_ahead() == 0  # not asked
    mixtral = [MixtralBlock(tiny_mixtral_config(), i) for i in range(SPAN)]
    assert DecodeGraphs(mixtral, config=config).capture_ahead() == 1 * 3  # from 4 rows


def test_every_table_starts_16_bytes_after_the_last() -> None:
    """The row kernels are compiled for 16-byte aligned tables: so is every table of every rows
    bucket, one row's included (8 bytes of positions would leave the next table off by 8)."""
    graphs = DecodeGraphs(_span("bloom"), config=DecodeGraphsConfig(max_rows=8))
    for rows in (1, 2, 4, 8):
        staging, tables = graphs._tables_for(rows)
        for line in (*staging[:, :rows], *tables[:, :rows]):
            assert line.is_contiguous() and line.data_ptr() % 16 == 0


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_rows must be an int >= 1"):
        DecodeGraphsConfig(max_rows=0)
    with pytest.raises(ConfigError, match="max_graphs"):
        DecodeGraphsConfig(max_graphs=True)


def test_bucket() -> None:
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
    assert bucket(3, 256) == 256 and bucket(257, 256) == 512


_KERNELS_CANNOT_RUN = """
import torch
from petals_core.models._decode_graphs import DecodeGraphs, DecodeGraphsConfig
from tests.models._steps import eager_steps, twin
from tests.models.test_decode_graphs import SPAN, _assert_same_caches, _sessions, _span, _tokens

blocks = _span("llama-gqa")
specs = [(2, 32, 5), (3, 32, 7), (1, 32, 1)]
config = DecodeGraphsConfig(max_rows=4, min_length_bucket=16)

warmed = DecodeGraphs(blocks, config=config)
assert warmed.warm_up() is False
reason = warmed.disabled_reason
assert reason.startswith("warming up the decode step failed"), reason

graphs = DecodeGraphs(blocks, config=config)
sessions = _sessions(blocks, specs)
before = twin(sessions)
xs = _tokens(specs, seed=5)
assert graphs.step(0, SPAN, xs, sessions) is None  # two groups (2 rows, then 3 + 1): none kept
_assert_same_caches(sessions, before)
assert graphs.statistics().failures == 1
assert graphs.disabled_reason.startswith("a decode step failed"), graphs.disabled_reason
# The eager path goes on from the caches as they were.
for got, want in zip(eager_steps(blocks, xs, sessions), eager_steps(blocks, xs, before)):
    torch.testing.assert_close(got, want, atol=0, rtol=0)
assert graphs.step(0, SPAN, _tokens(specs, seed=6), sessions) is None  # off for good
assert graphs.statistics().failures == 1
print("ok", graphs.disabled_reason)
"""


def test_kernels_that_cannot_run_leave_every_step_to_the_eager_path() -> None:
    """Compiled Triton (not the interpreter) refuses CPU tensors: a real failure of the fast
    path, in a process of its own.  Warming up reports it; a step that fails changes no cache;
    the graphs stay off and say why."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _KERNELS_CANNOT_RUN],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok a decode step failed"), result.stdout
    assert "decode graphs off for this span" in result.stderr  # logged once per instance
    assert result.stderr.count("decode graphs off for this span") == 2
