"""What a server is told (:class:`ServerConfig`, the command line's flags one to one), the checks
of its fields, and the model config it loads for it."""

from __future__ import annotations

from typing import Literal, get_args

import attrs
import torch

from .._errors import ConfigError
from ..dht import MAX_ANNOUNCEMENT_S, MAX_RATE
from ..models import (
    AutoDistributedConfig,
    CpuDecodeChoice,
    DistributedConfig,
    QuantType,
    original_repo,
)
from ..transport import TransportConfig
from ._handler import ServingLimits

__all__ = ["ServerConfig", "Throughput", "load_model_config", "resolve_model"]

Throughput = Literal["auto", "eval", "dry_run"] | float


def _dtype_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value != "auto" and not isinstance(getattr(torch, value, None), torch.dtype):
        raise ConfigError(f"torch_dtype {value!r} is not a torch dtype (or 'auto')")


def _quant_type(
    instance: object, attribute: attrs.Attribute[QuantType | None], value: object
) -> None:
    if value is not None and value not in get_args(QuantType):
        raise ConfigError(
            f"quant_type {value!r} is not one of {', '.join(get_args(QuantType))} "
            "(or None: nf4 on CUDA, none elsewhere)"
        )


def _cpu_decode(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if value not in get_args(CpuDecodeChoice):
        raise ConfigError(
            f"cpu_decode {value!r} is not one of {', '.join(get_args(CpuDecodeChoice))}"
        )


@attrs.frozen(kw_only=True)
class ServerConfig:
    """Everything a server is told; the command-line flags map onto these fields one to one."""

    model: str
    num_blocks: int | None = None
    block_indices: tuple[int, int] | None = None
    torch_dtype: str = attrs.field(default="auto", validator=_dtype_name)
    device: str | None = None
    #: None: nf4 on CUDA (when bitsandbytes runs there), none elsewhere.
    quant_type: QuantType | None = attrs.field(default=None, validator=_quant_type)
    #: On CUDA, replay decode steps from CUDA graphs (see ``DecodeGraphs``).
    cuda_graphs: bool = True
    #: On the CPU, compute fp32 decode steps of a row or two with numpy ("numpy", see
    #: ``CpuDecode``) or on the blocks' torch path ("torch").
    cpu_decode: CpuDecodeChoice = attrs.field(default="numpy", validator=_cpu_decode)
    identity_path: str | None = None
    host: str = "0.0.0.0"
    port: int = 0
    announce_host: str | None = None
    #: The port others dial, when it is not the one the server listens on (a router forwards
    #: it); None: the listening port.
    announce_port: int | None = None
    initial_peers: tuple[str, ...] = ()
    new_swarm: bool = False
    dht_prefix: str | None = None
    throughput: Throughput = "auto"
    network_bandwidth_bits_per_s: float | None = None
    attn_cache_tokens: int | None = None
    limits: ServingLimits = attrs.field(factory=ServingLimits)
    adapters: tuple[str, ...] = ()
    public_name: str | None = None
    update_period_s: float = 60.0
    expiration_s: float | None = None
    balance_quality: float = 0.75
    mean_balance_check_period_s: float = 120.0
    cache_dir: str | None = None
    #: The most bytes the model's files may take in the cache (``--max_disk_space``): least
    #: recently used shards are deleted before a download would pass it; None: no limit.
    max_disk_space: int | None = None
    token: str | None = None
    revision: str | None = None
    local_files_only: bool = False
    transport: TransportConfig | None = None
    #: Ask peers whether they can dial us, at start and every 10 minutes (see ``Reach``;
    #: ``--skip_reachability_check`` turns it off, and with it relays either way).
    check_reachability: bool = True
    #: Relay for servers that cannot be dialled, when peers can dial us (``--no_relay``: not).
    relay: bool = True
    #: Behind a NAT, serve through relays (``--no_auto_relay``: not).
    auto_relay: bool = True

    def __attrs_post_init__(self) -> None:
        if self.announce_port is not None and not 0 < self.announce_port <= 65535:
            raise ConfigError(f"announce_port must be 1..65535, not {self.announce_port}")
        if self.block_indices is not None:
            start, end = self.block_indices
            if not 0 <= start < end:
                raise ConfigError("block_indices must be start:end with 0 <= start < end")
            if self.num_blocks is not None and self.num_blocks != end - start:
                raise ConfigError("give --num_blocks or --block_indices, not both")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not self.initial_peers and not self.new_swarm:
            raise ConfigError(
                "give --initial_peers (multiaddrs of the swarm to join) or --new_swarm"
            )
        if self.initial_peers and self.new_swarm:
            raise ConfigError("--new_swarm starts a swarm of its own: give no --initial_peers")
        if not 0.0 <= self.balance_quality <= 1.0:
            raise ConfigError(f"balance_quality must be in [0, 1], got {self.balance_quality}")
        for name in ("update_period_s", "mean_balance_check_period_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if isinstance(self.throughput, float | int) and not (0 <= self.throughput <= MAX_RATE):
            raise ConfigError(
                f"throughput must be a number from 0 to {MAX_RATE:g}, got {self.throughput}"
            )
        if not 0 < self.effective_expiration_s <= MAX_ANNOUNCEMENT_S:
            raise ConfigError(
                f"announcements must last from 0 to {MAX_ANNOUNCEMENT_S:g} s (peers keep them "
                f"no longer): expiration_s is {self.expiration_s}, update_period_s "
                f"{self.update_period_s}"
            )

    @property
    def effective_expiration_s(self) -> float:
        """How long an announcement stays valid: ``expiration_s``, else ``max(2 *
        update_period_s, 300)``."""
        return (
            self.expiration_s
            if self.expiration_s is not None
            else max(2 * self.update_period_s, 300.0)
        )


def load_model_config(model: str, config: ServerConfig) -> DistributedConfig:
    """The config of ``model`` (as :func:`resolve_model` names it), loaded with ``config``'s
    revision, token, swarm prefix, cache folder and offline choice."""
    return AutoDistributedConfig.from_pretrained(
        model,
        revision=config.revision,
        token=config.token,
        dht_prefix=config.dht_prefix,
        cache_dir=config.cache_dir,
        local_files_only=config.local_files_only,
    )


def resolve_model(config: ServerConfig) -> str:
    """The model reference to load for ``config.model``: Petals' converted repos name their
    originals (see :func:`~petals_core.models.original_repo`)."""
    return original_repo(config.model)
