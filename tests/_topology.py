"""The ``topology`` fixture of the NAT tests: hosts behind real NATs, torn down after the test.

Needs root, iproute2 and nftables: CI installs nftables; elsewhere the tests skip, saying how to
install it (see ``_system.missing``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from ._system import missing

if TYPE_CHECKING:
    from petals_core.testing import Topology


@pytest.fixture
def topology() -> Iterator[Topology]:
    # Imported here: conftest takes this fixture before anything may import torch or triton.
    from petals_core.testing import missing_nat_tools, open_topology

    reason = missing_nat_tools()
    if reason is not None:
        missing(f"what NAT tests need ({reason})", "apt-get install -y nftables iproute2")
    with open_topology() as topology:
        yield topology
