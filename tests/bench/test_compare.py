"""``python -m bench compare``: a quick benchmark of this tree beside the committed one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import compare


def test_times_and_rates_are_judged_in_their_own_direction() -> None:
    assert compare._worse(11.0, 10.0, "ms") == pytest.approx(1.1)
    assert compare._worse(2.0, 2.5, "x") == pytest.approx(0.8)
    assert compare._worse(90.0, 100.0, "tok/s") == pytest.approx(100 / 90)
    assert compare._worse(0.0, 100.0, "tok/s") == float("inf")
    # A speed-up (its row's target a floor) is worse when smaller.
    assert compare._worse(3.0, 3.3, "x", ">= 2x") == pytest.approx(1.1)
    assert compare._worse(0.7, 0.66, "x", "<= 1.1x") == pytest.approx(0.7 / 0.66)


def test_a_benchmark_runs_in_both_trees_and_its_rows_are_paired(tmp_path: Path) -> None:
    result = compare.compare("HEAD", ["routing"], rounds=2, within=0.05, folder=tmp_path)
    assert result["rows"], result
    for row in result["rows"]:
        assert row["benchmark"] == "routing" and row["unit"] == "ms"
        assert len(row["ours_rounds"]) == len(row["theirs_rounds"]) == 2
        assert row["ours"] > 0 and row["theirs"] > 0
        assert row["worse"] == pytest.approx(row["ours"] / row["theirs"])
        assert row["met"] == (row["worse"] <= 1.05)
    # Each run wrote its own results, none into the tree's bench/results.
    assert len(list(tmp_path.glob("*/summary.json"))) == 4


def test_a_failing_benchmark_says_which_and_why(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"bench no_such_benchmark in .* failed"):
        compare.compare("HEAD", ["no_such_benchmark"], rounds=1, within=0.05, folder=tmp_path)
