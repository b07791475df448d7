"""What tests need of the system (Chromium, nftables, ...), what happens when it is missing, and
which skips a run allows.

In CI (``CI=true``), and wherever ``PETALS_REQUIRE_SYSTEM=1`` asks for it (``nox -s browser``),
the system's parts are installed before the tests (the ``tests`` session of noxfile.py does it in
CI), so a test that finds one missing fails (:func:`missing`); elsewhere it is skipped, the
reason naming the command that installs it.  Every run ends with its skips counted by reason; in
CI the only tests that may skip are those marked ``cuda``, and a run where others did fails.
tests/conftest.py takes this module's hooks; ``pytest -p tests._system`` does too.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, NoReturn

import pytest

__all__ = ["in_ci", "missing", "pytest_sessionfinish", "pytest_terminal_summary", "required"]


def in_ci() -> bool:
    """Whether the run is CI's."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def required() -> bool:
    """Whether a missing part fails a test instead of skipping it."""
    return in_ci() or os.environ.get("PETALS_REQUIRE_SYSTEM") == "1"


def missing(what: str, install: str) -> NoReturn:
    """``what`` is missing: fail the test where parts are required, else skip it, saying how to
    install it (``install``: a command)."""
    if required():
        where = "CI" if in_ci() else "PETALS_REQUIRE_SYSTEM=1"
        pytest.fail(f"missing: {what}, which {where} requires (install it with: {install})")
    pytest.skip(f"missing: {what} (install it with: {install})")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _unexpected_skips(config: pytest.Config) -> list[pytest.TestReport]:
    """In CI, skipped tests that are not CUDA's: CI installs what the others need."""
    if not in_ci():
        return []
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    skipped = [] if reporter is None else reporter.stats.get("skipped", [])
    return [report for report in skipped if "cuda" not in report.keywords]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The run's skips, counted by reason; in CI, those that are not allowed."""
    reasons = Counter(_skip_reason(report) for report in terminalreporter.stats.get("skipped", []))
    if reasons:
        counted = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common())
        terminalreporter.write_line(f"skipped, by reason: {counted}")
    unexpected = _unexpected_skips(config)
    if unexpected:
        terminalreporter.write_line(
            f"CI allows only CUDA tests to skip; {len(unexpected)} others did: "
            + ", ".join(report.nodeid for report in unexpected),
            red=True,
        )


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A CI run with skips that are not allowed fails."""
    if _unexpected_skips(session.config) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
