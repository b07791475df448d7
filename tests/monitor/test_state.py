"""The state the monitor shows, from the registry, peer tables and round-trip times: coverage
block by block (holes, joining servers), one row per server, and the JSON the API sends."""

from __future__ import annotations

import json
from typing import Any

import attrs

from petals_core.client import Verdict
from petals_core.dht import ModelInfo, PeerTableSnapshot, ServerInfo, ServerState
from petals_core.monitor import BlockCoverage, SwarmState, build_state
from petals_core.transport import Identity

A, B, C = (str(Identity.from_private_bytes(bytes([seed]) * 32).peer_id) for seed in (1, 2, 3))
LLAMA = ModelInfo(num_blocks=6, repository="org/llama", model_type="llama")


def info(start: int, end: int, **changes: Any) -> ServerInfo:
    announced = ServerInfo(
        state=ServerState.ONLINE,
        throughput=10.0,
        start_block=start,
        end_block=end,
        version="0.1.0",
        torch_dtype="bfloat16",
        quant_type="nf4",
        public_name=f"{start}:{end}",
        cache_tokens_left=4096,
    )
    return attrs.evolve(announced, **changes)


def snapshot(prefix: str, servers: dict[str, ServerInfo]) -> PeerTableSnapshot:
    """The peer table in which each server is listed under every block of its span."""
    blocks: dict[int, dict[str, ServerInfo]] = {}
    for peer_id, announced in servers.items():
        for block in range(announced.start_block, announced.end_block):
            blocks.setdefault(block, {})[peer_id] = announced
    return PeerTableSnapshot(prefix=prefix, now=0.0, version=1, blocks=blocks)


def test_coverage_counts_servers_per_block_and_shows_holes_and_joining() -> None:
    servers = {
        A: info(0, 3),
        B: info(1, 3),
        C: info(4, 6, state=ServerState.JOINING),
    }
    state = build_state(
        {"llama": LLAMA}, {"llama": snapshot("llama", servers)}, {}, version=3, updated_at=1.5
    )
    (model,) = state.models
    assert [(block.online, block.joining) for block in model.blocks] == [
        (1, 0),
        (2, 0),
        (2, 0),
        (0, 0),  # a hole
        (0, 1),
        (0, 1),
    ]
    assert model.served_blocks == 3
    assert (model.dht_prefix, model.repository, model.model_type) == ("llama", "org/llama", "llama")
    assert (state.version, state.updated_at) == (3, 1.5)


def test_one_row_per_server_sorted_by_span_with_its_round_trip() -> None:
    servers = {C: info(3, 6), A: info(0, 3), B: info(0, 2)}
    rtts = {A: 0.0123, B: None}  # C not measured yet
    state = build_state(
        {"llama": LLAMA}, {"llama": snapshot("llama", servers)}, rtts, version=1, updated_at=0.0
    )
    rows = state.models[0].servers
    assert [row.peer_id for row in rows] == [B, A, C]
    by_peer = {row.peer_id: row for row in rows}
    assert (by_peer[A].rtt_ms, by_peer[A].reachable) == (12.3, True)
    assert (by_peer[B].rtt_ms, by_peer[B].reachable) == (None, False)
    assert (by_peer[C].rtt_ms, by_peer[C].reachable) == (None, None)
    row = by_peer[A]
    assert row.short_id == "…" + A[-8:]
    assert (row.public_name, row.state, row.start_block, row.end_block) == ("0:3", "online", 0, 3)
    assert (row.throughput, row.cache_tokens_left) == (10.0, 4096)
    assert (row.torch_dtype, row.quant_type, row.version) == ("bfloat16", "nf4", "0.1.0")


def test_an_online_server_that_does_not_answer_is_no_cover() -> None:
    servers = {A: info(0, 3), B: info(0, 6), C: info(3, 6, state=ServerState.JOINING)}
    rtts = {A: 0.001, B: None, C: None}
    state = build_state(
        {"llama": LLAMA}, {"llama": snapshot("llama", servers)}, rtts, version=1, updated_at=0.0
    )
    (model,) = state.models
    coverage = [(block.online, block.joining, block.unreachable) for block in model.blocks]
    assert coverage == [(1, 0, 1)] * 3 + [(0, 1, 1)] * 3
    assert model.served_blocks == 3


def test_announced_texts_lose_control_and_format_characters() -> None:
    servers = {A: info(0, 6, public_name="evil\u202egnp.exe", version="1.0\n<b>")}
    state = build_state(
        {"llama": LLAMA}, {"llama": snapshot("llama", servers)}, {}, version=1, updated_at=0.0
    )
    (row,) = state.models[0].servers
    assert row.public_name == "evil\ufffdgnp.exe"
    assert row.version == "1.0\ufffd<b>"  # markup stays text: the page never parses it


def test_models_without_a_table_have_no_servers_and_are_sorted_by_prefix() -> None:
    bloom = ModelInfo(num_blocks=2)
    state = build_state({"zeta": LLAMA, "alpha": bloom}, {}, {}, version=0, updated_at=0.0)
    assert [model.dht_prefix for model in state.models] == ["alpha", "zeta"]
    assert state.models[0].blocks == (BlockCoverage(), BlockCoverage())
    assert state.models[0].servers == ()
    assert state.models[0].repository is None


def test_blocks_past_the_model_are_not_shown_but_their_server_is() -> None:
    """A table may list blocks the registry does not count (a peer announcing more blocks than
    the model has): the bar stops at the model's end, the server is listed as it announced."""
    servers = {A: info(4, 8)}
    state = build_state(
        {"llama": LLAMA}, {"llama": snapshot("llama", servers)}, {}, version=1, updated_at=0.0
    )
    (model,) = state.models
    assert len(model.blocks) == 6
    assert [block.online for block in model.blocks] == [0, 0, 0, 0, 1, 1]
    assert [(row.start_block, row.end_block) for row in model.servers] == [(4, 8)]


def test_the_json_is_what_the_api_sends() -> None:
    servers = {A: info(0, 6, adapters=("lora",), public_name=None, cache_tokens_left=None)}
    state = build_state(
        {"llama": LLAMA},
        {"llama": snapshot("llama", servers)},
        {A: 0.002},
        version=7,
        updated_at=9.0,
    )
    data = json.loads(json.dumps(state.to_json()))
    assert data["version"] == 7 and data["updated_at"] == 9.0
    (model,) = data["models"]
    assert model["dht_prefix"] == "llama"
    assert model["num_blocks"] == 6 and model["served_blocks"] == 6
    assert model["blocks"] == [{"online": 1, "joining": 0, "unreachable": 0}] * 6
    (row,) = model["servers"]
    assert row["adapters"] == ["lora"]
    assert row["public_name"] is None and row["cache_tokens_left"] is None
    assert row["rtt_ms"] == 2.0 and row["reachable"] is True
    # How the server is reached, as it announced (nothing here: an older server's shape).
    assert row["reachability"] is None and row["relay"] is None
    assert set(row) == {
        "peer_id",
        "short_id",
        "public_name",
        "state",
        "start_block",
        "end_block",
        "throughput",
        "cache_tokens_left",
        "torch_dtype",
        "quant_type",
        "version",
        "adapters",
        "rtt_ms",
        "reachable",
        "reachability",
        "relay",
        "reports",
        "report",
    }
    assert row["reports"] == 0 and row["report"] is None
    assert model["refused_reports"] == 0


def test_upheld_reports_show_on_their_server_and_refused_ones_are_counted() -> None:
    servers = {A: info(0, 6), B: info(0, 6)}
    verdicts = [
        Verdict(accused=A, reporters=frozenset({"r1"}), upheld=True, reason="off by 0.4\u202e"),
        Verdict(accused=A, reporters=frozenset({"r2"}), upheld=True, reason="off by 0.3"),
        Verdict(accused=B, reporters=frozenset({"r3"}), upheld=False, reason="forged"),
    ]
    state = build_state(
        {"llama": LLAMA},
        {"llama": snapshot("llama", servers)},
        {},
        version=1,
        updated_at=1.0,
        verdicts={"llama": verdicts},
    )
    (model,) = state.models
    rows = {row.peer_id: row for row in model.servers}
    assert rows[A].reports == 2 and rows[A].report == "off by 0.3"
    assert rows[B].reports == 0 and rows[B].report is None
    assert model.refused_reports == 1
    only_a = build_state(
        {"llama": LLAMA},
        {"llama": snapshot("llama", servers)},
        {},
        version=1,
        updated_at=1.0,
        verdicts={"llama": verdicts[:1]},
    )
    (row,) = [row for row in only_a.models[0].servers if row.peer_id == A]
    assert row.report == "off by 0.4\ufffd"  # no format characters


def test_states_compare_by_what_they_show() -> None:
    """The monitor gives a state a new version only when its models differ: the same readings
    make equal models, another round-trip time does not."""
    table = {"llama": snapshot("llama", {A: info(0, 6)})}
    first = build_state({"llama": LLAMA}, table, {A: 0.01}, version=1, updated_at=1.0)
    again = build_state({"llama": LLAMA}, table, {A: 0.01}, version=1, updated_at=2.0)
    slower = build_state({"llama": LLAMA}, table, {A: 0.02}, version=1, updated_at=3.0)
    assert isinstance(first, SwarmState)
    assert first.models == again.models
    assert first.models != slower.models
