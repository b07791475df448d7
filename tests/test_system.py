"""tests/_system.py: a missing system part skips a test, naming how to install it, or fails it
where parts are required; every run counts its skips by reason; CI fails a run where a test
that is not CUDA's skipped.  Each case is a pytest run of its own (pytester, in this process)."""

from __future__ import annotations

import pytest

INI = """
[pytest]
markers =
    cuda: needs a CUDA GPU
"""

TESTS = """
import pytest

from tests._system import missing


@pytest.mark.cuda
def test_on_a_gpu():
    pytest.skip("needs a CUDA GPU")


def test_with_nftables():
    missing("nftables", "apt-get install -y nftables")


def test_plain():
    pass
"""


@pytest.fixture
def runs(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("PETALS_REQUIRE_SYSTEM", raising=False)
    pytester.makeini(INI)
    return pytester


def test_elsewhere_a_missing_part_skips_naming_its_install_command(runs: pytest.Pytester) -> None:
    runs.makepyfile(test_parts=TESTS)
    result = runs.runpytest_inprocess("-p", "tests._system")
    result.assert_outcomes(passed=1, skipped=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "skipped, by reason: 1 needs a CUDA GPU; "
            "1 missing: nftables (install it with: apt-get install -y nftables)"
        ]
    )


def test_where_parts_are_required_a_missing_one_fails(
    runs: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs.makepyfile(test_parts=TESTS)
    monkeypatch.setenv("PETALS_REQUIRE_SYSTEM", "1")
    result = runs.runpytest_inprocess("-p", "tests._system")
    result.assert_outcomes(passed=1, skipped=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*missing: nftables, which PETALS_REQUIRE_SYSTEM=1 requires "
            "(install it with: apt-get install -y nftables)*"
        ]
    )


def test_ci_allows_only_cuda_tests_to_skip(
    runs: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    runs.makepyfile(test_parts=TESTS)
    failing = runs.runpytest_inprocess("-p", "tests._system")
    failing.assert_outcomes(passed=1, skipped=1, failed=1)  # the missing part fails
    runs.makepyfile(
        test_parts=TESTS.replace(
            'missing("nftables", "apt-get install -y nftables")', 'pytest.skip("no IPv6 here")'
        )
    )
    skipping = runs.runpytest_inprocess("-p", "tests._system")
    skipping.assert_outcomes(passed=1, skipped=2)
    assert skipping.ret == pytest.ExitCode.TESTS_FAILED
    skipping.stdout.fnmatch_lines(
        ["CI allows only CUDA tests to skip; 1 others did: test_parts.py::test_with_nftables"]
    )
    runs.makepyfile(test_parts=TESTS.replace("def test_with_nftables", "def _unused"))
    allowed = runs.runpytest_inprocess("-p", "tests._system")
    allowed.assert_outcomes(passed=1, skipped=1)
    assert allowed.ret == pytest.ExitCode.OK
