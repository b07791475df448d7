"""Which servers a client's requests go through: the sequence manager.

A :class:`RemoteSequenceManager` covers blocks ``[start, end)`` of one model.  It reads the model's
peer table (a client-mode DHT node following the model's topic: DHT reads plus gossip), keeps
round-trip times to servers and a ban list, and plans routes with the pure planners of
:mod:`petals_core.routing`: min-latency for inference, throughput-weighted sampling for
forward/backward.

Configuration and state are apart on purpose:

- :class:`SequenceManagerConfig` is frozen and given by the caller; nothing inside changes it.
- :class:`SequenceManagerState` is what a manager and its slices share (``manager[3:5]``,
  iteration): the peer-table view, pings, bans, and the running DHT node.  A slice keeps every
  setting of its parent.

Nothing starts at construction.  The DHT node starts on first use, inside the nursery the caller
provides (``async with manager:`` in a trio program) or the client bridge's service nursery
(plain scripts): building models before a fork, or in a web backend's parent process, starts no
thread and no task.  A refresh makes one attempt; retries belong to the requests, with
exponential backoff between ``min_backoff_s`` and ``max_backoff_s`` (:meth:`retry_delay`).  A failed
server is banned for ``ban_timeout_s``, twice as long after each further failure.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

from .._errors import ConfigError, PeerUnreachable, TransportError
from .._validators import compression_scheme, positive
from ..dht import DHTNode, PeerTableSnapshot, ServerInfo, ServerState, Topic, open_dht_node
from ..protocol import PUSH_GRANTS
from ..routing import (
    MissingBlocksError,
    RouteSpan,
    make_route_impartial,
    make_route_max_throughput,
    make_route_min_latency,
    usable_servers,
)
from ..transport import Connection, Multiaddr, call_unary, client_listen_host

if TYPE_CHECKING:
    import torch

__all__ = ["RemoteSequenceManager", "SequenceManagerConfig", "SequenceManagerState"]

#: A server whose measured forward speed is below its claim by more than this factor is routed
#: by what we measured instead.
OVERCLAIM_FACTOR = 10.0
#: How long each of the hooks run when the network part stops may take, in seconds.
STOP_HOOK_S = 5.0
#: The slowest link a step's timeout allows for, in bytes per second.
_SLOW_LINK_BYTES_PER_S = 1e6

logger = logging.getLogger(__name__)

NO_INITIAL_PEERS = (
    "no initial_peers: pass initial_peers=[ADDRESS, ...] (from_pretrained, ClientConfig or "
    "SequenceManagerConfig), the multiaddr of any peer of the swarm, like "
    "/ip4/203.0.113.7/udp/31337/quic-v1/p2p/12D3KooW...; every server prints its addresses at "
    "start ('Server listening on ...'), and so does `python -m petals_core.dht` ('DHT node "
    "listening on ...')"
)


def _takes(info: ServerInfo, max_length: int) -> bool:
    """Whether a server takes ``max_length`` positions, as far as it announces."""
    return info.inference_max_length is None or info.inference_max_length >= max_length


def _peers(value: Any) -> frozenset[str] | None:
    return None if value is None else frozenset(str(v) for v in value)


@attrs.frozen(kw_only=True)
class SequenceManagerConfig:
    """How a client finds and uses servers; also ``from_pretrained`` keyword arguments.

    Times are in seconds (``*_s``; ``from_pretrained`` also takes them under Petals' names,
    without the suffix).  ``max_retries=None`` retries for ever.  ``show_route`` logs routes (True),
    inference routes only (``"inference"``), or none (False).  ``use_server_to_server``: an
    inference step goes from each server straight to the next (each still answers the client,
    which keeps every span's inputs to replay); False: every step returns through the client.
    A route waits up to ``missing_blocks_timeout_s`` for servers of blocks nobody holds, then
    raises :class:`MissingBlocksError`.  An inference step's answer is awaited for
    ``min_step_timeout_s`` plus ten times what the server's announced speed says the step takes
    (at most ``request_timeout_s``), a replay's, a check's and a follower's alike: a server
    alive but stuck, or slower than it claims, is given up on in seconds.
    ``compression`` (None, ``"float16"``, ``"blockwise8"``): how the activations and
    gradients this client sends travel (servers choose for their answers).  ``host``: where the
    client's node listens; None picks loopback when every initial peer is on loopback, else every
    interface (a socket on loopback cannot reach other machines).  ``verify``: which answers of
    forward passes another server recomputes to check them: ``"sample"`` (each server's first
    ``verify_first`` answers, then a ``verify_share`` of them at random), ``"all"`` or
    ``"none"``; a server caught answering wrongly is never used again, and the right answer is
    used in its place.  The client publishes what it caught as fraud reports in the DHT, and
    reads the model's every ``reports_period_s``, banning a server only once other servers
    confirm that the reported answer is wrong.
    """

    initial_peers: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    dht_prefix: str | None = None
    show_route: bool | Literal["inference"] = "inference"
    allowed_servers: frozenset[str] | None = attrs.field(default=None, converter=_peers)
    blocked_servers: frozenset[str] = attrs.field(factory=frozenset, converter=frozenset)
    connect_timeout_s: float = attrs.field(default=5.0, validator=positive)
    request_timeout_s: float = attrs.field(default=3 * 60.0, validator=positive)
    update_period_s: float = attrs.field(default=60.0, validator=positive)
    max_retries: int | None = None
    min_backoff_s: float = attrs.field(default=1.0, validator=positive)
    max_backoff_s: float = attrs.field(default=60.0, validator=positive)
    ban_timeout_s: float = attrs.field(default=15.0, validator=positive)
    active_adapter: str | None = None
    max_pinged: int = attrs.field(default=3, validator=positive)
    ping_timeout_s: float = attrs.field(default=2.0, validator=positive)
    use_server_to_server: bool = True
    missing_blocks_timeout_s: float = attrs.field(default=10.0, validator=positive)
    min_step_timeout_s: float = attrs.field(default=5.0, validator=positive)
    compression: str | None = attrs.field(default=None, converter=compression_scheme)
    host: str | None = None
    verify: Literal["sample", "all", "none"] = attrs.field(default="sample")
    verify_first: int = attrs.field(default=2)
    verify_share: float = attrs.field(default=0.05)
    reports_period_s: float = attrs.field(default=60.0, validator=positive)

    def __attrs_post_init__(self) -> None:
        if self.max_retries is not None and self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0 or None, got {self.max_retries}")
        if self.min_backoff_s > self.max_backoff_s:
            raise ConfigError("min_backoff_s must not exceed max_backoff_s")
        if self.verify not in ("sample", "all", "none"):
            raise ConfigError(f"verify must be 'sample', 'all' or 'none', got {self.verify!r}")
        if isinstance(self.verify_first, bool) or not isinstance(self.verify_first, int):
            raise ConfigError(f"verify_first must be an integer, got {self.verify_first!r}")
        if self.verify_first < 0:
            raise ConfigError(f"verify_first must be >= 0, got {self.verify_first}")
        if not 0.0 <= self.verify_share <= 1.0:
            raise ConfigError(f"verify_share must be within [0, 1], got {self.verify_share!r}")


@attrs.define(eq=False)
class _Ban:
    until: float
    failures: int


@attrs.define(eq=False)
class SequenceManagerState:
    """What a manager and its slices share."""

    #: The model's servers (from the followed topic), the last time we looked.
    snapshot: PeerTableSnapshot | None = None
    #: Round-trip times from this client, seconds.
    pings: dict[str, float] = attrs.field(factory=dict)
    #: Servers being pinged now.
    pinging: set[str] = attrs.field(factory=set)
    bans: dict[str, _Ban] = attrs.field(factory=dict)
    dht: DHTNode | None = None
    topic: Topic | None = None
    #: Set once the DHT node runs (or failed to start: ``start_error``).
    started: trio.Event | None = None
    start_error: BaseException | None = None
    stop: trio.Event | None = None
    #: The loop the network part runs on (sync callers reach it through the client bridge).
    loop_token: trio.lowlevel.TrioToken | None = None
    #: Measured forward speed per server: token-blocks per second (a moving average).
    measured_rps: dict[str, float] = attrs.field(factory=dict)
    #: Servers caught answering wrongly, and how: never routed through again.
    caught: dict[str, str] = attrs.field(factory=dict)
    #: Per server, how many of its answers were checked and agreed.
    verified: dict[str, int] = attrs.field(factory=dict)
    #: The client's fraud reports (``petals_core.client._reports.ReportBook``), once it has any.
    reports: Any = None
    #: Tasks that run beside the network part once it has started (the client's report
    #: watcher), cancelled when it stops.
    services: list[Callable[[], Awaitable[None]]] = attrs.field(factory=list)
    #: Where background work of the network part runs (pings of new servers), while it runs.
    nursery: trio.Nursery | None = None
    #: Run when the network part stops, before the DHT node closes (each bounded by
    #: :data:`STOP_HOOK_S`): what must reach the swarm before the client leaves.
    on_stop: list[Callable[[], Awaitable[None]]] = attrs.field(factory=list)


class RemoteSequenceManager:
    """Routes over blocks ``block_indices`` (a range) of the model ``dht_prefix`` with
    ``num_blocks`` blocks in all.  See the module docstring."""

    def __init__(
        self,
        config: SequenceManagerConfig,
        num_blocks: int,
        *,
        block_indices: range | None = None,
        hidden_size: int | None = None,
        dht: DHTNode | None = None,
        state: SequenceManagerState | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if config.dht_prefix is None:
            raise ConfigError("the sequence manager needs config.dht_prefix")
        if hidden_size is not None and (not isinstance(hidden_size, int) or hidden_size < 1):
            raise ConfigError(f"hidden_size must be a positive integer, got {hidden_size!r}")
        self.config = config
        self.num_blocks = num_blocks
        #: The size of the model's hidden states, if known (a model's config gives it): inputs
        #: of another size are the caller's mistake, refused before they are sent.
        self.hidden_size = hidden_size
        self.block_indices = block_indices if block_indices is not None else range(num_blocks)
        if (
            self.block_indices.step != 1
            or not 0 <= self.block_indices.start < self.block_indices.stop <= num_blocks
        ):
            raise ConfigError(f"block_indices {self.block_indices} outside [0, {num_blocks})")
        self.state = state if state is not None else SequenceManagerState()
        if dht is not None and self.state.dht is None:
            self.state.dht = dht
        self._rng = rng if rng is not None else random.Random()

    # -- slicing ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.block_indices)

    def __getitem__(self, index: int | slice) -> RemoteSequenceManager:
        if isinstance(index, slice):
            blocks = self.block_indices[index]
        else:
            position = self.block_indices[index]  # raises IndexError out of range
            blocks = range(position, position + 1)
        if len(blocks) == 0 or blocks.step != 1:
            raise IndexError("a slice of a sequence manager is a non-empty contiguous range")
        return RemoteSequenceManager(
            self.config,
            self.num_blocks,
            block_indices=blocks,
            hidden_size=self.hidden_size,
            state=self.state,
            rng=self._rng,
        )

    def __iter__(self) -> Iterator[RemoteSequenceManager]:
        for i in range(len(self)):
            yield self[i]

    # -- running ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the DHT node (unless one was given) until :meth:`close`; for ``nursery.start``."""
        state = self.state
        if state.started is not None:
            raise RuntimeError("this manager's network part already runs")
        state.started, state.stop = trio.Event(), trio.Event()
        try:
            if state.dht is None:
                if not self.config.initial_peers:
                    raise ConfigError(NO_INITIAL_PEERS)
                async with open_dht_node(
                    host=self.config.host or client_listen_host(self.config.initial_peers),
                    client_mode=True,
                    initial_peers=self.config.initial_peers,
                    request_timeout_s=self.config.connect_timeout_s,
                ) as dht:
                    state.dht = dht
                    await self._serve(task_status)
                state.dht = None
            else:
                await self._serve(task_status)
        except BaseException as exc:
            state.start_error = exc
            raise
        finally:
            state.started.set()
            state.started = None
            state.topic = None

    async def _serve(self, task_status: trio.TaskStatus[None]) -> None:
        state = self.state
        assert state.dht is not None and state.started is not None and state.stop is not None
        assert self.config.dht_prefix is not None
        state.topic = state.dht.follow(
            self.config.dht_prefix, self.num_blocks, update_period_s=self.config.update_period_s
        )
        state.start_error = None
        state.loop_token = trio.lowlevel.current_trio_token()
        state.started.set()
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                state.nursery = nursery
                for service in state.services:
                    nursery.start_soon(service)
                await state.stop.wait()
                for hook in state.on_stop:
                    with trio.move_on_after(STOP_HOOK_S):
                        await hook()
                nursery.cancel_scope.cancel()
        finally:
            state.loop_token = None
            state.nursery = None

    def close(self) -> None:
        """Stop the network part (the task running :meth:`run` returns)."""
        if self.state.stop is not None:
            self.state.stop.set()

    @property
    def running(self) -> bool:
        return self.state.topic is not None

    def _topic(self) -> Topic:
        if self.state.topic is None:
            raise RuntimeError(
                "the sequence manager is not running: use it inside `async with` of its owner "
                "(or through the client bridge)"
            )
        return self.state.topic

    # -- routing ---------------------------------------------------------------------------------

    def servers(self) -> dict[str, ServerInfo]:
        """Usable servers now (online, unbanned, allowed, with the active adapter), each with
        the announcement of its lowest block."""
        return usable_servers(
            self._announced(),
            banned=self._banned(),
            allowed=self.config.allowed_servers,
            blocked=self.config.blocked_servers,
            adapter=self.config.active_adapter,
        )

    def _announced(self) -> dict[str, ServerInfo]:
        """Every server of the model's peer table now, with the announcement of its lowest
        block."""
        snapshot = self._topic().snapshot()
        self.state.snapshot = snapshot
        everyone: dict[str, ServerInfo] = {}
        for block in sorted(snapshot.blocks):
            for peer, info in snapshot.servers_for(block).items():
                if peer not in everyone:
                    everyone[peer] = self._as_measured(peer, info)
        return everyone

    def _banned(self) -> set[str]:
        # An expired ban stops applying but is remembered (its count doubles the next one) until
        # a request through that server succeeds.
        now = time.monotonic()
        banned = {peer for peer, ban in self.state.bans.items() if ban.until > now}
        return banned | self.state.caught.keys()

    def _servers_seen(
        self, *, max_length: int = 0, refused: Mapping[str, str] | None = None
    ) -> tuple[str, ...]:
        """Each server of the peer table: its span, and why it is not used if it is not (for a
        route of ``max_length`` positions, avoiding the servers that ``refused`` it)."""
        banned = self._banned()
        config = self.config
        refused = refused or {}
        seen = []
        for peer, info in sorted(self._announced().items()):
            if info.state is not ServerState.ONLINE:
                status = info.state.name.lower()
            elif peer in refused:
                status = f"refused it ({refused[peer]})"
            elif not _takes(info, max_length):
                status = f"takes at most {info.inference_max_length} positions"
            elif peer in self.state.caught:
                status = f"caught answering wrongly ({self.state.caught[peer]})"
            elif peer in banned:
                status = "banned after failing"
            elif peer in config.blocked_servers:
                status = "in blocked_servers"
            elif config.allowed_servers is not None and peer not in config.allowed_servers:
                status = "not in allowed_servers"
            elif config.active_adapter is not None and config.active_adapter not in info.adapters:
                status = f"without adapter {config.active_adapter!r}"
            else:
                status = "usable"
            seen.append(f"{peer} [{info.start_block}:{info.end_block}) {status}")
        return tuple(seen)

    async def make_sequence(
        self,
        start: int | None = None,
        end: int | None = None,
        *,
        mode: Literal["min_latency", "max_throughput", "impartial"] = "min_latency",
        cache_tokens_needed: int = 0,
        max_length: int = 0,
        exclude: Collection[str] = (),
        refused: Mapping[str, str] | None = None,
        like: ServerInfo | None = None,
        wait: bool = True,
        whole: bool = False,
        rank: Callable[[str], bytes] | None = None,
    ) -> list[RouteSpan]:
        """A route over ``[start, end)`` (default: this manager's blocks).

        Waits (up to ``missing_blocks_timeout_s``; not at all if not ``wait``) until the peer
        table holds servers for every block; then raises :class:`MissingBlocksError` naming the
        blocks nobody serves and the servers seen, each with why it is not used.
        ``max_length``: only servers that take sessions (and sequences) of that many positions,
        as far as they announce; ``refused``: servers that refused this session as larger than
        they take, and why (not used).  ``exclude``: servers not to use;
        ``like``: only servers of its dtype and quantisation; ``whole``: only servers holding
        every block of the range (a route of one span).  ``mode="impartial"`` (for checking
        answers): each block's server first in ``rank`` (default: a fresh random draw),
        whatever servers announce (:func:`~petals_core.routing.make_route_impartial`).
        """
        start = self.block_indices.start if start is None else start
        end = self.block_indices.stop if end is None else end
        topic = self._topic()
        refused = refused or {}

        def plan() -> list[RouteSpan]:
            servers = {
                peer: info
                for peer, info in self.servers().items()
                if peer not in exclude
                and peer not in refused
                and _takes(info, max_length)
                and (
                    like is None
                    or (info.torch_dtype, info.quant_type) == (like.torch_dtype, like.quant_type)
                )
                and (not whole or (info.start_block <= start and end <= info.end_block))
            }
            if mode == "min_latency":
                return make_route_min_latency(
                    servers,
                    start,
                    end,
                    client_pings=self.state.pings,
                    cache_tokens_needed=cache_tokens_needed,
                )
            if mode == "impartial":
                drawn: dict[str, bytes] = {}
                return make_route_impartial(
                    servers,
                    start,
                    end,
                    rank=rank or (lambda peer: drawn.setdefault(peer, self._rng.randbytes(8))),
                )
            return make_route_max_throughput(servers, start, end, rng=self._rng)

        route: list[RouteSpan] | None = None
        with trio.move_on_after(self.config.missing_blocks_timeout_s if wait else 0):
            while route is None:
                try:
                    route = plan()
                except MissingBlocksError:
                    await topic.wait_snapshot(_newer_than(topic.snapshot().version))
        if route is None:
            try:
                route = plan()
            except MissingBlocksError as exc:
                raise MissingBlocksError(
                    exc.blocks,
                    exc.start,
                    exc.end,
                    dht_prefix=self.config.dht_prefix,
                    servers_seen=self._servers_seen(max_length=max_length, refused=refused),
                ) from None
        if mode == "min_latency" and self.state.nursery is not None:
            # Measure the servers of this route for next time (routes improve as pings arrive),
            # beside the route's use: its first step need not wait for them.
            self.state.nursery.start_soon(self._ping_unknown, {span.peer_id for span in route})
        if self.config.show_route is True or (
            self.config.show_route == "inference" and mode == "min_latency"
        ):
            logger.info(
                "route for blocks %d:%d: %s",
                start,
                end,
                " => ".join(f"{span.peer_id[-6:]}[{span.start}:{span.end}]" for span in route),
            )
        return route

    async def _ping_unknown(self, peers: set[str]) -> None:
        state = self.state
        unknown = [peer for peer in peers if peer not in state.pings and peer not in state.pinging]
        unknown = unknown[: self.config.max_pinged]
        if not unknown:
            return
        state.pinging.update(unknown)
        try:
            async with trio.open_nursery() as nursery:
                for peer in unknown:
                    nursery.start_soon(self._ping, peer)
        finally:
            state.pinging.difference_update(unknown)

    async def _ping(self, peer: str) -> None:
        with trio.move_on_after(self.config.ping_timeout_s):
            try:
                began = trio.current_time()
                connection = await self.connect(peer)
                await call_unary(connection, "dht.ping", {"client": True})
                self.state.pings[peer] = trio.current_time() - began
            except TransportError:
                pass

    async def connect(self, peer: str) -> Connection:
        """A connection to the server ``peer`` (at the address it announced)."""
        topic = self._topic()
        addresses: list[Multiaddr] = topic.addresses_of(peer)
        if not addresses:
            raise PeerUnreachable(f"server {peer} announced no address")
        assert self.state.dht is not None
        with trio.move_on_after(self.config.connect_timeout_s):
            return await self.state.dht.node.connect_any(addresses)
        raise PeerUnreachable(
            f"server {peer} did not answer within {self.config.connect_timeout_s} s"
        )

    def step_timeout(self, span: RouteSpan, *, tokens: int, nbytes: int) -> float:
        """Seconds to wait for ``span``'s server to answer an inference step of ``tokens``
        (rows x positions) carrying ``nbytes`` each way: ``min_step_timeout_s`` plus ten times
        the compute its announced speed implies and the transfer at 1 MB/s, at most
        ``request_timeout_s``."""
        config = self.config
        rate = self.announced_rate(span, tokens=tokens)
        compute_s = tokens * span.length / rate if rate else 0.0
        expected = compute_s + 2 * nbytes / _SLOW_LINK_BYTES_PER_S
        return min(config.request_timeout_s, config.min_step_timeout_s + 10 * expected)

    def answer_timeout(self, span: RouteSpan, hidden: torch.Tensor, unconfirmed: bool) -> float:
        """Seconds to wait for ``span``'s server to answer an inference step of ``hidden`` (a
        replay's, a check's or a follower's too): :meth:`step_timeout`, or, for a step of
        several tokens, ``request_timeout_s`` where the peer table no longer has the server;
        while its answer to the session's opening (``unconfirmed``) comes first, the time an
        opening may take besides."""
        config = self.config
        tokens = hidden.shape[0] * hidden.shape[1]
        if tokens > 1 and self.announced_rate(span, tokens=tokens) is None:
            timeout = config.request_timeout_s
        else:
            timeout = self.step_timeout(span, tokens=tokens, nbytes=hidden.nbytes)
        return timeout + (config.request_timeout_s if unconfirmed else 0.0)

    def _announcement(self, span: RouteSpan) -> ServerInfo | None:
        """What ``span``'s server announces in the peer table routes were last planned from
        (under any block: a table still filling may lack some of its blocks), if anything."""
        snapshot = self.state.snapshot
        if snapshot is None:
            return None
        first = (snapshot.servers_for(span.start),)  # (where it is once the table is full)
        for servers in itertools.chain(first, snapshot.blocks.values()):
            if (info := servers.get(span.peer_id)) is not None:
                return info
        return None

    def announced_rate(self, span: RouteSpan, *, tokens: int) -> float | None:
        """The blocks per second ``span``'s server announces for steps of ``tokens`` (rows x
        positions), 0.0 where it announces none; None where the peer table lacks the server."""
        info = self._announcement(span)
        if info is None:
            return None
        rate = info.inference_rps if tokens == 1 else info.forward_rps
        rate = rate if rate else info.throughput
        return max(rate, 0.0)

    def knows_push_grants(self, span: RouteSpan) -> bool:
        """Whether ``span``'s server announces that it passes on and checks push grants of the
        form this client makes (one from before grants drops them, and the next servers then
        refuse its pushes; one of another form refuses ours)."""
        info = self._announcement(span)
        return info is not None and info.push_grants == PUSH_GRANTS

    # -- what servers deliver --------------------------------------------------------------------

    def on_forward_measured(self, peer: str, *, tokens: int, blocks: int, seconds: float) -> None:
        """Note that ``peer`` ran ``tokens`` through ``blocks`` blocks in ``seconds`` (a whole
        forward or backward call, as the client saw it)."""
        if seconds <= 0 or tokens <= 0 or blocks <= 0:
            return
        rate = tokens * blocks / seconds
        previous = self.state.measured_rps.get(peer)
        self.state.measured_rps[peer] = rate if previous is None else 0.7 * previous + 0.3 * rate

    def _as_measured(self, peer: str, info: ServerInfo) -> ServerInfo:
        """``info`` with its throughput cut to what we measured, when that is far below what it
        claims (:data:`OVERCLAIM_FACTOR`): a server announcing more than it delivers would
        otherwise draw every request for as long as it keeps claiming."""
        measured = self.state.measured_rps.get(peer)
        if measured is None:
            return info
        # Announced throughput is forward token-blocks per second over the average request
        # span ((n + 1) / 2 of its n blocks): bring it to the unit measured.
        claimed = info.throughput * (info.end_block - info.start_block + 1) / 2
        if claimed <= measured * OVERCLAIM_FACTOR:
            return info
        scale = measured / claimed
        return attrs.evolve(info, throughput=info.throughput * scale)

    # -- failures --------------------------------------------------------------------------------

    def on_request_failure(self, peer: str | None) -> None:
        """Ban ``peer`` for ``ban_timeout_s``, doubling with each failure in a row.

        A server reached through relays is not banned for its first failure in a row: what
        failed may be the relay, and the server announced others (or holds a new one by now);
        it is tried again at once, and banned from its second failure on."""
        if peer is None:
            return
        ban = self.state.bans.get(peer)
        failures = 1 if ban is None else ban.failures + 1
        exponent = failures - 1
        if self._relayed(peer):
            exponent -= 1
        duration = 0.0 if exponent < 0 else self.config.ban_timeout_s * 2**exponent
        self.state.bans[peer] = _Ban(until=time.monotonic() + duration, failures=failures)
        self.state.pings.pop(peer, None)
        if duration == 0.0:
            logger.info("%s failed; it is reached through relays: trying it again at once", peer)
        else:
            logger.info("banned %s for %.1f s after %d failure(s)", peer, duration, failures)

    def _relayed(self, peer: str) -> bool:
        topic = self.state.topic
        return topic is not None and any(a.is_relayed for a in topic.addresses_of(peer))

    def should_verify(self, peer: str) -> bool:
        """Whether to check this answer of ``peer`` (``verify``: every answer, none, or a
        server's first ``verify_first`` answers and then a ``verify_share`` of them at random)."""
        if self.config.verify != "sample":
            return self.config.verify == "all"
        if self.state.verified.get(peer, 0) < self.config.verify_first:
            return True
        return self._rng.random() < self.config.verify_share

    def should_follow(self, peer: str) -> Literal["first", "session"] | None:
        """Whether a session's span on ``peer`` is checked by a server that follows it step by
        step: until ``peer`` has ``verify_first`` answers checked (``"first"``), for the whole
        session (``"session"``: every session with ``verify="all"``, a ``verify_share`` of them
        otherwise), or not at all (None)."""
        if self.config.verify == "none":
            return None
        if self.config.verify == "all":
            return "session"
        if self.state.verified.get(peer, 0) < self.config.verify_first:
            return "first"
        return "session" if self._rng.random() < self.config.verify_share else None

    def on_verified(self, peer: str) -> None:
        """One more answer of ``peer`` checked and found right."""
        self.state.verified[peer] = self.state.verified.get(peer, 0) + 1

    def on_caught(self, peer: str, reason: str) -> None:
        """``peer`` answered wrongly: no route of this client goes through it again."""
        self.state.caught[peer] = reason
        self.state.pings.pop(peer, None)
        logger.warning("server %s answered wrongly (%s): it is no longer used", peer, reason)

    def server_info(self, peer: str) -> ServerInfo | None:
        """``peer``'s announcement (of its lowest block), if the peer table holds it."""
        return self._announced().get(peer)

    def on_request_success(self, peer: str) -> None:
        self.state.bans.pop(peer, None)

    def is_banned(self, peer: str) -> bool:
        ban = self.state.bans.get(peer)
        return ban is not None and ban.until > time.monotonic()

    def retry_delay(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt`` (0: none)."""
        if attempt <= 0:
            return 0.0
        return float(min(self.config.min_backoff_s * 2 ** (attempt - 1), self.config.max_backoff_s))

    def may_retry(self, attempt: int) -> bool:
        """Whether retry number ``attempt`` (1 = the first retry) is allowed."""
        return self.config.max_retries is None or attempt <= self.config.max_retries


def _newer_than(version: int) -> Callable[[PeerTableSnapshot], bool]:
    return lambda snapshot: snapshot.version > version
