"""Server announcements for the routing tests."""

from __future__ import annotations

from collections.abc import Mapping

from petals_core.dht import ServerInfo, ServerState

ONLINE, JOINING, OFFLINE = ServerState.ONLINE, ServerState.JOINING, ServerState.OFFLINE


def server(
    start: int,
    end: int,
    *,
    throughput: float = 100.0,
    state: ServerState = ONLINE,
    inference_rps: float | None = None,
    forward_rps: float | None = None,
    cache_tokens_left: int | None = None,
    adapters: tuple[str, ...] = (),
    next_pings: Mapping[str, float] | None = None,
    reachability: str | None = None,
) -> ServerInfo:
    """What a server of blocks ``start:end`` announces (fp32, no measurements unless given)."""
    return ServerInfo(
        state=state,
        throughput=throughput,
        start_block=start,
        end_block=end,
        version="test",
        torch_dtype="float32",
        inference_rps=inference_rps,
        forward_rps=forward_rps,
        adapters=adapters,
        cache_tokens_left=cache_tokens_left,
        next_pings=dict(next_pings or {}),
        reachability=reachability,
    )
