"""Which servers hold which blocks, as routing and block selection see it.

A server hosts a contiguous span ``[start, end)`` of a model's blocks and announces a throughput
(requests per second).  A block's throughput is the sum over the live (joining or online) spans
that cover it; offline spans count for nothing.  Sums are exact-then-rounded (:func:`math.fsum`),
so a block's throughput does not depend on the order spans come in, nor on how it was reached:
two blocks covered by the same servers always compare equal, which keeps tie-breaking (and hence
block choice) deterministic across peers.

Pure functions, no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import attrs

from .._errors import ConfigError
from ..dht import PeerTableSnapshot, ServerInfo, ServerState

__all__ = ["ServerSpan", "block_throughputs", "check_spans", "spans_from_snapshot"]


def _check_peer_id(instance: ServerSpan, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"a span's peer_id is a non-empty str, not {value!r}")


def _check_start(instance: ServerSpan, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"span of {instance.peer_id}: start is an integer >= 0, not {value!r}")


def _check_end(instance: ServerSpan, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= instance.start:
        raise ConfigError(
            f"span of {instance.peer_id}: end is an integer > start={instance.start}, not {value!r}"
        )


def _check_throughput(
    instance: ServerSpan, attribute: attrs.Attribute[float], value: float
) -> None:
    if not isinstance(value, float) or not 0.0 <= value < math.inf:
        raise ConfigError(
            f"span of {instance.peer_id}: throughput is a finite number >= 0, not {value!r}"
        )


def _check_state(
    instance: ServerSpan, attribute: attrs.Attribute[ServerState], value: object
) -> None:
    if not isinstance(value, ServerState):
        raise ConfigError(f"span of {instance.peer_id}: state is a ServerState, not {value!r}")


def _to_float(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@attrs.frozen(kw_only=True)
class ServerSpan:
    """Blocks ``[start, end)`` served by ``peer_id`` at ``throughput`` requests per second."""

    peer_id: str = attrs.field(validator=_check_peer_id)
    start: int = attrs.field(validator=_check_start)
    end: int = attrs.field(validator=_check_end)
    throughput: float = attrs.field(converter=_to_float, validator=_check_throughput)
    state: ServerState = attrs.field(validator=_check_state)

    @property
    def length(self) -> int:
        """How many blocks the span holds."""
        return self.end - self.start

    @property
    def is_live(self) -> bool:
        """Whether it counts towards block throughputs (joining or online)."""
        return self.state is not ServerState.OFFLINE

    def moved_to(self, start: int) -> ServerSpan:
        """The same server holding as many blocks from ``start``."""
        return attrs.evolve(self, start=start, end=start + self.length)


def check_spans(spans: Iterable[ServerSpan], num_blocks: int) -> list[ServerSpan]:
    """``spans`` as a list, after checking that each lies within ``[0, num_blocks)``."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ConfigError(f"num_blocks is an integer >= 1, not {num_blocks!r}")
    checked = list(spans)
    for span in checked:
        if not isinstance(span, ServerSpan):
            raise ConfigError(f"expected ServerSpan, got {type(span).__name__}")
        if span.end > num_blocks:
            raise ConfigError(
                f"span of {span.peer_id} is [{span.start}, {span.end}), outside the model's "
                f"{num_blocks} blocks [0, {num_blocks})"
            )
    return checked


def block_throughputs(spans: Iterable[ServerSpan], num_blocks: int) -> list[float]:
    """Per block of ``[0, num_blocks)``, the summed throughput of the live spans covering it.

    Offline spans are ignored; a span reaching past ``num_blocks`` raises :class:`ConfigError`.
    """
    covering: list[list[float]] = [[] for _ in range(num_blocks if num_blocks > 0 else 0)]
    for span in check_spans(spans, num_blocks):
        if span.is_live:
            for block in range(span.start, span.end):
                covering[block].append(span.throughput)
    return [math.fsum(values) for values in covering]


def spans_from_snapshot(snapshot: PeerTableSnapshot, num_blocks: int) -> dict[str, ServerSpan]:
    """Each server's span in ``snapshot``, by PeerID, for a model of ``num_blocks`` blocks.

    A server files the same announcement under each of its blocks; its span is the range it
    announced, cut to ``[0, num_blocks)`` (a peer announcing blocks the model lacks is not
    trusted with them).  Should a server's announcements differ between blocks (one replaced and
    not yet gossiped everywhere), the one filed under its lowest block is used.  Offline
    announcements, and servers announcing no block of the model, are left out.
    """
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ConfigError(f"num_blocks is an integer >= 1, not {num_blocks!r}")
    chosen: dict[str, ServerInfo] = {}
    for block in sorted(snapshot.blocks):
        if not 0 <= block < num_blocks:
            continue
        for peer_id, info in snapshot.servers_for(block).items():
            if peer_id not in chosen and info.state is not ServerState.OFFLINE:
                chosen[peer_id] = info
    spans: dict[str, ServerSpan] = {}
    for peer_id in sorted(chosen):
        info = chosen[peer_id]
        start, end = max(info.start_block, 0), min(info.end_block, num_blocks)
        if start < end:
            spans[peer_id] = ServerSpan(
                peer_id=peer_id,
                start=start,
                end=end,
                throughput=info.throughput,
                state=info.state,
            )
    return spans


def live_spans(spans: Mapping[str, ServerSpan]) -> dict[str, ServerSpan]:
    """The joining and online spans of ``spans``, in PeerID order."""
    return {peer_id: spans[peer_id] for peer_id in sorted(spans) if spans[peer_id].is_live}
