"""A distributed model's client as a benchmark watches it from outside: its sequence manager,
and waiting (in the thread that drives the model) until it sees what the benchmark needs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["sequence_manager", "wait_for_servers", "wait_until"]

#: How often :func:`wait_until` checks its condition.
POLL_INTERVAL_S = 0.05


def sequence_manager(model: Any) -> Any:
    """The sequence manager of a distributed model's remote blocks."""
    return model.distributed_base.remote_blocks.sequence_manager


def wait_until(condition: Callable[[], bool], failure: str, timeout_s: float) -> None:
    """Check ``condition`` every :data:`POLL_INTERVAL_S` until it holds; ``TimeoutError``
    (``"<failure> within <timeout_s> s"``) if it still does not after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{failure} within {timeout_s:.0f} s")
        time.sleep(POLL_INTERVAL_S)


def wait_for_servers(manager: Any, servers: int, timeout_s: float, *, banned: bool = False) -> None:
    """Wait until the sequence manager ``manager`` sees ``servers`` servers (with ``banned``,
    counting those it has banned among them)."""

    def seen() -> int:
        return len(manager.servers()) + (len(manager.state.caught) if banned else 0)

    wait_until(lambda: seen() >= servers, f"the client did not see {servers} servers", timeout_s)
