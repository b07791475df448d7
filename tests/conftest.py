"""Settings and fixtures for the whole test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

# The skips' count by reason at the end of every run, and CI's rule that only CUDA tests skip.
from ._system import in_ci, pytest_sessionfinish, pytest_terminal_summary

# Hosts behind real NATs (network namespaces), for the NAT tests of several packages.
from ._topology import topology

if TYPE_CHECKING:
    from ._served_swarm import InProcessSwarm, ServedModel
    from .client._swarm_helpers import Model

# The Triton kernels are tested on CPU through Triton's interpreter, which must be selected before
# anything imports triton (bitsandbytes and transformers may, in other test modules).  This
# process never launches compiled kernels: there is no GPU in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/browser drives a real Chromium through selenium: CI runs it (it installs Chromium first),
# the default run elsewhere leaves it out, naming it runs it (`pytest tests/browser`, which
# `nox -s browser` does).
collect_ignore = [] if in_ci() else ["browser"]

__all__ = ["pytest_sessionfinish", "pytest_terminal_summary", "topology"]


# The swarm serves tests/distributed and tests/client alike: one for the whole session.  Its
# module (torch, transformers, the server) is imported only when a test asks for it.
@pytest.fixture(scope="session")
def client_swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSwarm]:
    from ._served_swarm import open_client_swarm

    with open_client_swarm(tmp_path_factory) as swarm:
        yield swarm


@pytest.fixture(scope="session")
def served_llama(client_swarm: InProcessSwarm) -> ServedModel:
    return client_swarm.served["llama"]


@pytest.fixture(scope="session")
def served_bloom(client_swarm: InProcessSwarm) -> ServedModel:
    return client_swarm.served["bloom"]


@pytest.fixture(scope="session")
def served_falcon(client_swarm: InProcessSwarm) -> ServedModel:
    return client_swarm.served["falcon"]


@pytest.fixture(scope="session")
def served_mixtral(client_swarm: InProcessSwarm) -> ServedModel:
    return client_swarm.served["mixtral"]


@pytest.fixture(scope="session", params=["llama", "bloom", "falcon", "mixtral"])
def served(request: pytest.FixtureRequest, client_swarm: InProcessSwarm) -> ServedModel:
    """Each family in turn."""
    return client_swarm.served[request.param]


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    """The tiny LLaMA of the client and chaos tests, saved once, with its blocks loaded here as the
    reference each test starts its own servers of."""
    from .client._swarm_helpers import make_model

    return make_model(tmp_path_factory.mktemp("client-llama"))
