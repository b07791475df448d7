"""What the monitor shows, built from what it read: no I/O here.

:func:`build_state` turns the registry's models, each model's peer table
(:class:`PeerTableSnapshot`), the round-trip times measured to servers and the monitor's verdicts
on fraud reports into a :class:`SwarmState`: per model, how many servers hold each block (holes
are blocks none holds) and one row per server.  ``SwarmState.to_json()`` is what
``GET /api/v1/state`` returns and what each server-sent event carries.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

from ..dht import ModelInfo, PeerTableSnapshot, ServerInfo, ServerState

if TYPE_CHECKING:
    from ..client import Verdict

__all__ = ["BlockCoverage", "ModelState", "ServerRow", "SwarmState", "build_state", "short_id"]

#: The characters of a PeerID a short one keeps: its end (PeerIDs share their first characters).
_SHORT_ID_CHARS: Final = 8


def short_id(peer_id: str) -> str:
    """A PeerID as the page shows it: an ellipsis and its last characters."""
    if len(peer_id) <= _SHORT_ID_CHARS:
        return peer_id
    return "…" + peer_id[-_SHORT_ID_CHARS:]


@attrs.frozen(kw_only=True)
class BlockCoverage:
    """How many servers hold one block: ``online`` serve it, ``joining`` are loading it, and
    ``unreachable`` announce it online but did not answer the monitor's last ping (counted
    apart: a client cannot count on them either)."""

    online: int = 0
    joining: int = 0
    unreachable: int = 0


@attrs.frozen(kw_only=True)
class ServerRow:
    """One server of a model, as announced, with the round-trip time the monitor measured.

    ``rtt_ms`` is None and ``reachable`` False when the server did not answer in time (or
    announced no address); both are None before the first measurement.
    """

    peer_id: str
    short_id: str
    public_name: str | None
    state: str
    start_block: int
    end_block: int
    throughput: float
    cache_tokens_left: int | None
    torch_dtype: str
    quant_type: str
    version: str
    adapters: tuple[str, ...]
    rtt_ms: float | None
    reachable: bool | None
    #: How peers reach it, as it announced: "public", "cone" or "symmetric" (behind such a NAT,
    #: served through relays and punched holes), "unknown", or None (not announced).
    reachability: str | None = None
    #: Whether it relays for servers behind NATs (None: not announced).
    relay: bool | None = None
    #: Fraud reports about it that the monitor upheld (other servers confirmed the reported
    #: answer wrong), and the reason of one of them.
    reports: int = 0
    report: str | None = None


@attrs.frozen(kw_only=True)
class ModelState:
    """One model of the registry: its coverage block by block and its servers (by span)."""

    dht_prefix: str
    repository: str | None
    model_type: str | None
    num_blocks: int
    blocks: tuple[BlockCoverage, ...]
    servers: tuple[ServerRow, ...]
    #: Fraud reports about its servers that the monitor refused (forged, expired, about a
    #: correct answer...).
    refused_reports: int = 0

    @property
    def served_blocks(self) -> int:
        """How many blocks at least one online server (not known unreachable) holds."""
        return sum(1 for block in self.blocks if block.online)


@attrs.frozen(kw_only=True)
class SwarmState:
    """Everything the page shows.  ``version`` grows each time ``models`` changes;
    ``updated_at`` is the wall time (seconds since the epoch) of the reading it comes from."""

    version: int
    updated_at: float
    models: tuple[ModelState, ...]

    def to_json(self) -> dict[str, Any]:
        """The state as JSON-ready data (what the HTTP API sends)."""
        return {
            "version": self.version,
            "updated_at": self.updated_at,
            "models": [
                {
                    **attrs.asdict(model, recurse=False),
                    "blocks": [attrs.asdict(block) for block in model.blocks],
                    "servers": [
                        {**attrs.asdict(row), "adapters": list(row.adapters)}
                        for row in model.servers
                    ],
                    "served_blocks": model.served_blocks,
                }
                for model in self.models
            ],
        }


def build_state(
    models: Mapping[str, ModelInfo],
    snapshots: Mapping[str, PeerTableSnapshot],
    rtts: Mapping[str, float | None],
    *,
    version: int,
    updated_at: float,
    verdicts: Mapping[str, Sequence[Verdict]] | None = None,
) -> SwarmState:
    """The state of ``models`` (by ``dht_prefix``), sorted by prefix.

    ``snapshots`` holds each model's peer table (none yet: no servers); ``rtts`` maps PeerIDs
    onto round-trip times in seconds, None for a server that did not answer (absent: not
    measured yet); ``verdicts``: the monitor's verdicts on each model's fraud reports.  A
    block's coverage counts the servers listed under it; a server is listed
    once, with the span it announced; blocks past the model's ``num_blocks`` are not shown.
    An online server that did not answer its ping counts as unreachable, not online.
    """
    return SwarmState(
        version=version,
        updated_at=updated_at,
        models=tuple(
            _model_state(
                prefix,
                models[prefix],
                snapshots.get(prefix),
                rtts,
                () if verdicts is None else verdicts.get(prefix, ()),
            )
            for prefix in sorted(models)
        ),
    )


def _model_state(
    prefix: str,
    info: ModelInfo,
    snapshot: PeerTableSnapshot | None,
    rtts: Mapping[str, float | None],
    verdicts: Sequence[Verdict],
) -> ModelState:
    blocks = {} if snapshot is None else snapshot.blocks
    coverage: list[BlockCoverage] = []
    for index in range(info.num_blocks):
        servers = blocks.get(index, {})
        online = [p for p, server in servers.items() if server.state is ServerState.ONLINE]
        silent = sum(1 for peer_id in online if peer_id in rtts and rtts[peer_id] is None)
        coverage.append(
            BlockCoverage(
                online=len(online) - silent,
                joining=len(servers) - len(online),
                unreachable=silent,
            )
        )
    # A server files one announcement under each block of its span: its first one stands for it.
    announced: dict[str, ServerInfo] = {}
    for index in sorted(blocks):
        for peer_id, server in blocks[index].items():
            announced.setdefault(peer_id, server)
    upheld: dict[str, list[str]] = {}
    for verdict in verdicts:
        if verdict.upheld:
            upheld.setdefault(verdict.accused, []).append(verdict.reason)
    rows = sorted(
        (
            attrs.evolve(
                _server_row(peer_id, server, rtts),
                reports=len(upheld.get(peer_id, ())),
                report=_plain(min(upheld[peer_id])) if peer_id in upheld else None,
            )
            for peer_id, server in announced.items()
        ),
        key=lambda row: (row.start_block, row.end_block, row.peer_id),
    )
    return ModelState(
        dht_prefix=prefix,
        repository=info.repository,
        model_type=info.model_type,
        num_blocks=info.num_blocks,
        blocks=tuple(coverage),
        servers=tuple(rows),
        refused_reports=sum(1 for verdict in verdicts if not verdict.upheld),
    )


def _plain(text: str) -> str:
    """An announced text without control and format characters (a right-to-left override in a
    server's name would turn the row around it): each becomes U+FFFD."""
    return "".join("\ufffd" if unicodedata.category(c) in ("Cc", "Cf") else c for c in text)


def _server_row(peer_id: str, info: ServerInfo, rtts: Mapping[str, float | None]) -> ServerRow:
    measured = peer_id in rtts
    rtt = rtts.get(peer_id)
    return ServerRow(
        peer_id=peer_id,
        short_id=short_id(peer_id),
        public_name=None if info.public_name is None else _plain(info.public_name),
        state=info.state.value,
        start_block=info.start_block,
        end_block=info.end_block,
        throughput=info.throughput,
        cache_tokens_left=info.cache_tokens_left,
        torch_dtype=_plain(info.torch_dtype),
        quant_type=_plain(info.quant_type),
        version=_plain(info.version),
        adapters=tuple(_plain(adapter) for adapter in info.adapters),
        rtt_ms=None if rtt is None else round(rtt * 1000.0, 2),
        reachable=(rtt is not None) if measured else None,
        reachability=None if info.reachability is None else _plain(info.reachability),
        relay=info.relay,
    )
