"""A server's life: join the swarm, choose blocks, load them, serve, announce, rebalance, leave.

:func:`open_server` does it all inside an ``async with`` (tests and embedding programs use it);
``python -m petals_core.server`` wraps it with signals and a command line.

1. The transport node and the DHT node share one QUIC endpoint: the DHT's methods and the
   block RPCs (:class:`BlockServer`) are served together.  The server follows its model's topic,
   so it sees the swarm by DHT reads and gossip.
2. Blocks: ``block_indices`` if given, else :func:`choose_best_blocks` over the swarm's
   throughput per block (after one read of the peer table).  How many: ``num_blocks``, else on
   CUDA as many as fit in free memory, else all (:mod:`._defaults`, with the dtype and the
   quantisation).  Its throughput counts the network bandwidth it measured to peers at
   start (:mod:`._bandwidth`; ``--network_bandwidth`` overrides).  It announces JOINING for
   them before loading (so others see what is coming) and ONLINE once it serves; each announcement
   files the model in the swarm's registry too (``MODELS_KEY``: prefix, repo, block count).
3. Loading reads only the shards holding those blocks, casts, quantises and adds the LoRA
   adapters, in a worker thread.
4. While serving it re-announces every ``update_period_s`` (cache tokens left, pings to the
   servers of the next blocks), and every ``mean_balance_check_period_s`` (randomised) it asks
   :func:`should_choose_other_blocks`; if moving would raise the swarm's bottleneck enough, it
   ends its sessions ("the server is moving to other blocks"), unloads, and starts over at 2.
5. Leaving: it announces OFFLINE, ends open sessions with "the server is shutting down", and
   closes.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import attrs
import torch
import trio

from .. import __version__
from .._errors import ConfigError, PeerUnreachable, TransportError
from .._groups import run_concurrently
from ..dht import (
    DHTNode,
    ModelInfo,
    Reachability,
    ServerInfo,
    ServerState,
    Topic,
    open_dht_node,
    register_model,
)
from ..models import (
    DecodeGraphsConfig,
    DistributedConfig,
    QuantType,
    add_adapter,
    load_blocks,
    load_lora_adapter,
    new_block,
    quantize_block,
)
from ..protocol import PUSH_GRANTS
from ..routing import choose_best_blocks, should_choose_other_blocks, spans_from_snapshot
from ..transport import (
    Connection,
    Identity,
    Multiaddr,
    RelayLimits,
    call_unary,
    dialable_multiaddrs,
    load_or_create_identity,
    open_node,
)
from ._backend import Block, BlockBackend
from ._bandwidth import NetworkBandwidth, find_network_bandwidth
from ._config import ServerConfig, load_model_config, resolve_model
from ._defaults import ServingDefaults, choose_defaults
from ._handler import BlockServer
from ._memory_cache import MemoryCache
from ._reach import Reach
from ._task_pool import open_task_pool
from ._throughput import ThroughputInfo, get_server_throughput

__all__ = ["Server", "open_server", "server_throughput"]

logger = logging.getLogger("petals_core.server")

#: A peer the peer table lacks makes us read the DHT, but not more often than this.
_PEER_LOOKUP_MIN_INTERVAL_S: Final = 5.0
#: How long the peer checking our reachability may take to dial back.
_REACHABILITY_TIMEOUT_S: Final = 10.0


def server_throughput(
    config: ServerConfig,
    model_config: DistributedConfig,
    defaults: ServingDefaults,
    *,
    num_blocks: int,
    network_bandwidth_bits_per_s: float | None = None,
) -> ThroughputInfo:
    """What a server of ``num_blocks`` blocks on ``defaults``' device, dtype and quantisation
    announces: see :func:`get_server_throughput`; the measures are cached in ``config.cache_dir``
    (default ``~/.cache/petals_core``), and ``--throughput eval`` measures again.  The network
    bandwidth is ``network_bandwidth_bits_per_s`` (measured), else ``--network_bandwidth``."""
    if network_bandwidth_bits_per_s is None:
        network_bandwidth_bits_per_s = config.network_bandwidth_bits_per_s
    return get_server_throughput(
        model_config,
        device=defaults.device,
        dtype=defaults.dtype,
        quant_type=defaults.quant_type,
        num_blocks=num_blocks,
        cache_dir=Path(config.cache_dir or Path.home() / ".cache" / "petals_core"),
        network_bandwidth_bits_per_s=network_bandwidth_bits_per_s,
        force_eval=config.throughput == "eval",
    )


class Server:
    """A running server (from :func:`open_server`)."""

    def __init__(
        self,
        config: ServerConfig,
        model_config: DistributedConfig,
        model: str,
        dht: DHTNode,
        topic: Topic,
        block_server: BlockServer,
        defaults: ServingDefaults,
        rng: random.Random,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.model = model
        self.dht = dht
        self.topic = topic
        self.block_server = block_server
        self.defaults = defaults
        self.device = defaults.device
        self.dtype = defaults.dtype
        self.quant_type: QuantType = defaults.quant_type
        self._rng = rng
        self.backend: BlockBackend | None = None
        self.throughput: ThroughputInfo | float | None = None
        #: The network bandwidth the throughput counts, and where it came from (None: not
        #: needed, the throughput is given as a number).
        self.bandwidth: NetworkBandwidth | None = None
        self.state = ServerState.JOINING
        self.blocks: range | None = None
        self._serving = trio.Event()
        self._announcements = 0
        self._announced = trio.Event()
        self.next_pings: dict[str, float] = {}
        self.moves = 0
        #: Whether peers can dial us, and our relays (None: not checked).
        self.reach: Reach | None = None
        self._reach_changed = trio.Event()

    @property
    def dht_prefix(self) -> str:
        assert self.model_config.dht_prefix is not None
        return self.model_config.dht_prefix

    @property
    def num_blocks_total(self) -> int:
        return int(self.model_config.num_hidden_layers)

    @property
    def multiaddrs(self) -> list[Multiaddr]:
        """Where clients reach this server, best first (relayed addresses first behind a NAT):
        what they pass in ``initial_peers``, and what it announces."""
        if self.reach is not None:
            return self.reach.addresses()
        return self.listen_multiaddrs()

    def listen_multiaddrs(self) -> list[Multiaddr]:
        """Where this server listens (or what ``--announce_host`` says), whoever can dial it."""
        return dialable_multiaddrs(
            self.dht.listen_multiaddr,
            announce_host=self.config.announce_host,
            announce_port=self.config.announce_port,
        )

    def relay_candidates(self) -> list[Multiaddr]:
        """Relays we may hold reservations with: our initial peers, then servers that announce
        that they relay (at the first direct address each announced)."""
        candidates = []
        for text in self.config.initial_peers:
            try:
                address = Multiaddr.parse(text)
            except ConfigError:
                continue
            if address.peer_id is not None and not address.is_relayed:
                candidates.append(address)
        for servers in self.topic.snapshot().blocks.values():
            for peer_id, info in servers.items():
                if info.relay is not True or info.state is not ServerState.ONLINE:
                    continue
                direct = [a for a in self.topic.addresses_of(peer_id) if not a.is_relayed]
                if direct and direct[0] not in candidates:
                    candidates.append(direct[0])
        return candidates

    def reachability_peers(self) -> list[str]:
        """Whom to ask whether they can dial us: initial peers, then DHT contacts."""
        peers = list(self.config.initial_peers)
        peers += [contact.address for contact in self.dht.routing_table if contact.address]
        return peers

    def reach_changed(self) -> None:
        """Our reachability or relays changed: announce anew (see ``_announce_changes``)."""
        self._reach_changed.set()

    async def _announce_changes(self) -> None:
        while True:
            await self._reach_changed.wait()
            self._reach_changed = trio.Event()
            if self.blocks is not None and self.state is not ServerState.OFFLINE:
                await self.announce()

    async def wait_serving(self) -> None:
        await self._serving.wait()

    async def wait_announcements(self, n: int = 1) -> None:
        """Wait until ``n`` more announcements have been stored."""
        target = self._announcements + n
        while self._announcements < target:
            await self._announced.wait()

    @property
    def dtype_name(self) -> str:
        """The blocks' dtype as announced (``"bfloat16"``)."""
        return str(self.dtype).removeprefix("torch.")

    def info(self) -> ServerInfo:
        assert self.blocks is not None
        throughput = self.throughput
        rps: dict[str, Any] = {}
        if isinstance(throughput, ThroughputInfo):
            rps = {"inference_rps": throughput.inference_rps, "forward_rps": throughput.forward_rps}
            value = throughput.throughput
            if self.reach is not None and self.reach.reachability is Reachability.SYMMETRIC:
                # Every byte goes through a relay: fewer requests should come our way, and
                # servers choosing blocks count us for less.
                value = throughput.through_relay()
        else:
            value = float(throughput) if throughput is not None else 0.0
        backend = self.backend
        return ServerInfo(
            state=self.state,
            throughput=value,
            start_block=self.blocks.start,
            end_block=self.blocks.stop,
            version=__version__,
            torch_dtype=self.dtype_name,
            quant_type=self.quant_type,
            public_name=self.config.public_name,
            adapters=tuple(sorted(backend.adapters)) if backend is not None else (),
            cache_tokens_left=self.block_server.cache_tokens_left if backend is not None else None,
            inference_max_length=self.block_server.limits.session_length,
            next_pings=self.next_pings,
            addresses=tuple(str(address) for address in self.multiaddrs[:8]),
            reachability=None if self.reach is None else self.reach.reachability.value,
            relay=None if self.reach is None else self.reach.relays_for_others,
            push_grants=PUSH_GRANTS,
            **rps,
        )

    def model_info(self) -> ModelInfo:
        """What we file in the swarm's registry of models: the repo we load (None for a local
        folder, whose path means nothing to others), the number of blocks and the family."""
        repository = None if os.path.isdir(self.model) else self.model
        return ModelInfo(
            num_blocks=self.num_blocks_total,
            repository=repository,
            model_type=str(self.model_config.model_type),
        )

    async def announce(self, *, timeout_s: float = 5.0) -> None:
        """Announce our info now: pushed by gossip at once, stored in the DHT within
        ``timeout_s`` if it can be (a store slowed by departed peers is cut short, and the next
        period stores it again).  While not leaving, the model's entry in the registry is stored
        along with it, with the same expiration."""
        expiration = time.time() + self.config.effective_expiration_s
        calls: list[Callable[[], Awaitable[object]]] = [
            functools.partial(
                self.dht.announce, self.dht_prefix, self.info(), expiration=expiration
            )
        ]
        if self.state is not ServerState.OFFLINE:
            calls.append(functools.partial(self._register_model, expiration))
        with trio.move_on_after(timeout_s):
            try:
                await run_concurrently(calls)
            except TransportError as exc:
                notes = getattr(exc, "__notes__", [])
                logger.warning("announcing failed: %s", "; ".join([str(exc), *notes]))
        self._announcements += 1
        self._announced.set()
        self._announced = trio.Event()

    async def _register_model(self, expiration: float) -> None:
        try:
            await register_model(
                self.dht, self.dht_prefix, self.model_info(), expiration=expiration
            )
        except TransportError as exc:
            logger.warning("filing the model in the registry failed: %s", exc)

    # -- the life --------------------------------------------------------------------------------

    async def _run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            self.blocks = await self._choose_blocks()
            self.state = ServerState.JOINING
            self.backend = None
            if self.throughput is None:
                # Known before joining, so that servers choosing their blocks meanwhile count us.
                if not isinstance(self.config.throughput, float | int):
                    self.bandwidth = await find_network_bandwidth(
                        self.config.network_bandwidth_bits_per_s,
                        self.dht.node,
                        self.reachability_peers(),
                    )
                self.throughput = await trio.to_thread.run_sync(self._throughput)
            await self.announce()
            backend = await trio.to_thread.run_sync(self._load, self.blocks)
            cache = MemoryCache(
                self._cache_bytes(backend),
                max_alloc_timeout_s=self.config.limits.max_alloc_timeout_s,
            )
            async with open_task_pool(
                workers=2,
                reserved_workers=1,
                # A batch of steps is no larger than one prefill chunk, which the memory set
                # aside for activations is sized for.
                max_batch_total_size=self.config.limits.max_batch_tokens,
                shared_inference=False,
                inline_below_s=self.config.limits.inline_compute_s,
            ) as pool:
                self.backend = backend
                self.block_server.attach(backend, pool, cache)
                self.state = ServerState.ONLINE
                await self.announce()
                for address in self.multiaddrs:
                    logger.info(
                        "serving blocks %d:%d of %s at %s",
                        self.blocks.start,
                        self.blocks.stop,
                        self.model,
                        address,
                    )
                self._serving.set()
                if not started:
                    started = True
                    task_status.started()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._announce_forever)
                    moving = await self._watch_balance()
                    nursery.cancel_scope.cancel()
                self.block_server.detach(moving)
                self._serving = trio.Event()
            self.moves += 1
            # Withdraw the old span: its announcements (filed under other blocks' keys than the
            # new ones) would list us there until they expire, and routing reads the lowest.
            self.state = ServerState.OFFLINE
            await self.announce()
            logger.info("moving to other blocks to balance the swarm")
            del backend

    def _cache_bytes(self, backend: BlockBackend) -> int:
        tokens = self.defaults.attn_cache_tokens
        return tokens * backend.cache_bytes_per_token * (backend.end - backend.start)

    async def _choose_blocks(self) -> range:
        total = self.num_blocks_total
        if self.config.block_indices is not None:
            return range(*self.config.block_indices)  # within the model: checked by the defaults
        wanted = self.defaults.num_blocks
        await self.topic.wait_snapshot(lambda _: self.topic.refreshes >= 1)
        spans = spans_from_snapshot(self.topic.snapshot(), total)
        spans.pop(str(self.dht.peer_id), None)
        return choose_best_blocks(wanted, spans.values(), total)

    def _load(self, blocks: range) -> BlockBackend:
        config = self.model_config
        cfg = self.config
        states = load_blocks(
            self.model,
            blocks,
            config=config,
            revision=cfg.revision,
            token=cfg.token,
            cache_dir=cfg.cache_dir,
            local_files_only=cfg.local_files_only,
            dtype=self.dtype,
            max_disk_space=cfg.max_disk_space,
        )
        built: list[Block] = []
        for index in blocks:
            # Built without memory, then given the checkpoint's tensors: no random weights are
            # drawn for a block (seconds and gigabytes for a Mixtral or Falcon-180B block).
            with torch.device("meta"):
                block = new_block(config, index)
            block.load_state_dict(states.pop(index), assign=True)
            block = block.to(self.device, self.dtype)
            quantize_block(block, self.quant_type)
            built.append(block)
        for name in cfg.adapters:
            adapter = load_lora_adapter(
                name,
                config=config,
                block_indices=blocks,
                revision=None,
                token=cfg.token,
                cache_dir=cfg.cache_dir,
                local_files_only=cfg.local_files_only,
            )
            for index, block in zip(blocks, built, strict=True):
                if index in adapter.weights:
                    add_adapter(block, adapter, index)
        return BlockBackend(
            built,
            start=blocks.start,
            hidden_size=int(config.hidden_size),
            dtype=self.dtype,
            device=self.device,
            adapters=cfg.adapters,
            decode_graphs=(
                DecodeGraphsConfig(ahead_max_length=cfg.limits.session_length)
                if cfg.cuda_graphs
                else None
            ),
            cpu_decode=cfg.cpu_decode,
        )

    def _throughput(self) -> ThroughputInfo | float:
        cfg = self.config
        if isinstance(cfg.throughput, float | int):
            return float(cfg.throughput)
        assert self.blocks is not None and self.bandwidth is not None
        return server_throughput(
            cfg,
            self.model_config,
            self.defaults,
            num_blocks=len(self.blocks),
            network_bandwidth_bits_per_s=self.bandwidth.bits_per_s,
        )

    async def _announce_forever(self) -> None:
        while True:
            await trio.sleep(self.config.update_period_s)
            await self._measure_next_pings()
            await self.announce(timeout_s=self.config.update_period_s / 2)

    async def _measure_next_pings(self) -> None:
        """Round-trip times to (up to 5 of) the servers holding our next block."""
        assert self.blocks is not None
        snapshot = self.topic.snapshot()
        candidates = list(snapshot.servers_for(self.blocks.stop))[:5]
        pings: dict[str, float] = {}

        async def ping(peer_id: str) -> None:
            addresses = self.topic.addresses_of(peer_id)
            if not addresses:
                return
            with trio.move_on_after(5.0):
                try:
                    began = trio.current_time()
                    connection = await self.dht.node.connect_any(addresses)
                    await call_unary(connection, "dht.ping", {"client": True})
                    pings[peer_id] = trio.current_time() - began
                except TransportError:
                    pass

        async with trio.open_nursery() as nursery:
            for peer_id in candidates:
                nursery.start_soon(ping, peer_id)
        self.next_pings = pings

    async def _watch_balance(self) -> str:
        """Return (the reason) once moving to other blocks would help the swarm enough."""
        cfg = self.config
        if cfg.block_indices is not None or cfg.balance_quality == 0.0:
            await trio.sleep_forever()
        while True:
            await trio.sleep(cfg.mean_balance_check_period_s * self._rng.uniform(0.5, 1.5))
            spans = spans_from_snapshot(self.topic.snapshot(), self.num_blocks_total)
            own = str(self.dht.peer_id)
            if own not in spans:
                continue
            try:
                move = should_choose_other_blocks(
                    own, spans, self.num_blocks_total, cfg.balance_quality
                )
            except (ConfigError, ArithmeticError) as exc:
                logger.debug("cannot judge the balance: %s", exc)
                continue
            if move:
                return "the server is moving to other blocks"


@asynccontextmanager
async def open_server(
    config: ServerConfig, *, identity: Identity | None = None, seed: int | None = None
) -> AsyncIterator[Server]:
    """Start a server; the block is entered once it serves (blocks loaded, announced ONLINE).

    On exit it announces OFFLINE, ends open sessions with "the server is shutting down", and
    closes the node.
    """
    if config.throughput == "dry_run":
        raise ConfigError(
            "throughput 'dry_run' measures and exits (the command line does it); a running "
            "server takes 'auto', 'eval' or a number"
        )
    model = resolve_model(config)
    model_config = await trio.to_thread.run_sync(load_model_config, model, config)
    defaults = await trio.to_thread.run_sync(choose_defaults, config, model_config)
    # From here on the model's default session length is resolved.
    limits = attrs.evolve(config.limits, inference_max_length=defaults.inference_max_length)
    config = attrs.evolve(config, limits=limits)
    if identity is None:
        identity = load_or_create_identity(config.identity_path) if config.identity_path else None
    block_server = BlockServer(config.limits, version=__version__)
    rng = random.Random(seed)
    async with (
        open_node(identity, host=config.host, port=config.port, config=config.transport) as node,
        open_dht_node(
            node=node,
            handlers=block_server.handlers(),
            initial_peers=config.initial_peers,
            request_timeout_s=min(config.limits.request_timeout_s, 10.0),
            rng=rng,
            announce=_dht_announce(node.listen_multiaddr, config),
            relay=RelayLimits() if config.relay else None,
            # Until peers say they can dial us, we stay out of their routing tables.
            dialable=not (config.check_reachability and config.initial_peers),
        ) as dht,
    ):
        if dht.relay is not None:
            # Until peers say they can dial us, we relay for nobody.
            dht.relay.accepting = False
        topic = dht.follow(
            model_config.dht_prefix or model,
            int(model_config.num_hidden_layers),
            update_period_s=config.update_period_s,
        )

        async def connect_peer(peer_id: str) -> Connection:
            addresses = topic.addresses_of(peer_id)
            if not addresses:
                # Announced since our last read (gossip brings it within seconds, a client may
                # be quicker): read the DHT, at most once per few seconds whoever asks.
                await topic.refresh(min_interval_s=_PEER_LOOKUP_MIN_INTERVAL_S)
                addresses = topic.addresses_of(peer_id)
            if not addresses:
                raise PeerUnreachable(f"server {peer_id} announced no address")
            return await node.connect_any(addresses)

        block_server.connect_peer = connect_peer
        server = Server(config, model_config, model, dht, topic, block_server, defaults, rng)
        block_server.sign_as(
            node.identity,
            model_config.dht_prefix or model,
            torch_dtype=server.dtype_name,
            quant_type=server.quant_type,
        )
        if config.check_reachability and config.initial_peers:
            server.reach = Reach(
                dht=dht,
                listen=server.listen_multiaddrs,
                peers=server.reachability_peers,
                relay_candidates=server.relay_candidates,
                on_change=server.reach_changed,
                trusted=config.initial_peers,
                auto_relay=config.auto_relay,
                relay=config.relay,
                timeout_s=_REACHABILITY_TIMEOUT_S,
            )
        async with trio.open_nursery() as nursery:
            if server.reach is not None:
                nursery.start_soon(server.reach.run)
            nursery.start_soon(server._announce_changes)
            await nursery.start(server._run)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True):
                    block_server.detach("the server is shutting down")
                    if server.blocks is not None:
                        # Gossip pushes it at once; the DHT store gets a short while (peers
                        # leaving at the same time would make it wait for each of them).
                        server.state = ServerState.OFFLINE
                        await server.announce(timeout_s=2.0)


def _dht_announce(listen: Multiaddr, config: ServerConfig) -> Multiaddr | None:
    """The address the DHT tells other nodes to dial, when it is not where we listen."""
    if config.announce_host is not None:
        return dialable_multiaddrs(
            listen, announce_host=config.announce_host, announce_port=config.announce_port
        )[0]
    if config.announce_port is not None:
        # A wildcard host stays one: the other side puts in the host our request came from.
        return attrs.evolve(listen, port=config.announce_port)
    return None
