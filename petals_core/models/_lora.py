"""LoRA adapters in PEFT's format for the blocks a server holds, chosen per request.

A server loads the adapters named on its command line (a Hub repo id or a local folder each, with
:func:`load_lora_adapter`), keeps their weights for its own blocks only, and wraps every targeted
``Linear`` of a block in a :class:`LoraLinear` holding all adapters that target it. A request runs
its blocks inside ``using_adapter(name)`` (a :class:`contextvars.ContextVar`, so set it in the
thread that computes); each wrapped layer then returns ``base(x) + (x @ A.T @ B.T) * scaling`` for
that adapter, or plain ``base(x)`` outside any adapter.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from .._errors import AdapterError

__all__ = [
    "AdapterError",
    "LoraAdapter",
    "LoraLinear",
    "active_adapter",
    "adapter_names",
    "add_adapter",
    "using_adapter",
]


def check_lora_pair(a: torch.Tensor, b: torch.Tensor, rank: int, where: str) -> None:
    """Refuse an A and a B that are not (r, in) and (out, r)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(
            f"{where}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, not (r, in) and "
            f"(out, r) with r={rank}"
        )


def _check_weights(
    instance: LoraAdapter,
    attribute: attrs.Attribute[Mapping[int, Mapping[str, tuple[torch.Tensor, torch.Tensor]]]],
    value: Mapping[int, Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
) -> None:
    for index, modules in value.items():
        for path, (a, b) in modules.items():
            where = f"adapter {instance.name!r}, block {index}, module {path!r}"
            check_lora_pair(a, b, instance.rank, where)


@attrs.frozen(kw_only=True)
class LoraAdapter:
    """One adapter's weights for the blocks a server holds."""

    name: str = attrs.field(validator=attrs.validators.min_len(1))  # as requests name it
    rank: int = attrs.field(validator=[attrs.validators.instance_of(int), attrs.validators.gt(0)])
    scaling: float = attrs.field()  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    # Module paths within a block that the config targets, e.g. "self_attn.q_proj".
    target_modules: frozenset[str]
    # block index -> module path -> (A (r, in), B (out, r))
    weights: Mapping[int, Mapping[str, tuple[torch.Tensor, torch.Tensor]]] = attrs.field(
        validator=_check_weights
    )

    @scaling.validator
    def _check_scaling(self, attribute: attrs.Attribute[float], value: float) -> None:
        if not math.isfinite(value):
            raise AdapterError(f"adapter {self.name!r}: scaling must be finite, got {value}")


_ACTIVE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "petals_core_active_adapter", default=None
)


@contextlib.contextmanager
def using_adapter(name: str | None) -> Iterator[None]:
    """Run blocks inside this with adapter ``name`` applied (``None``: the base model).

    The choice lives in a :class:`contextvars.ContextVar`: it holds for the current thread or task,
    so enter it where the blocks compute (e.g. inside the function given to
    ``trio.to_thread.run_sync``), and it nests.
    """
    token = _ACTIVE.set(name)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_adapter() -> str | None:
    """The adapter that :func:`using_adapter` made active here, if any."""
    return _ACTIVE.get()


_REGISTRY_ATTR = "_petals_lora_adapters"


class _BlockAdapters:
    """The adapters one block holds, shared by the block's hook and its :class:`LoraLinear` s."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def check(self, name: str) -> None:
        if name not in self.names:
            known = ", ".join(repr(n) for n in sorted(self.names)) or "none"
            raise AdapterError(f"unknown adapter {name!r}; this block holds: {known}")

    def pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook: refuse an unknown adapter before any computation."""
        name = _ACTIVE.get()
        if name is not None:
            self.check(name)


@attrs.frozen
class _Slot:
    index: int  # buffers lora_A_{index}, lora_B_{index}
    scaling: float


class LoraLinear(nn.Module):
    """A ``Linear`` (plain or bitsandbytes ``Linear8bitLt``/``Linear4bit``) with named adapters.

    The adapters' A (r, in) and B (out, r) are non-persistent buffers, so ``block.to(...)`` moves
    and casts them with the block, and the block's ``state_dict`` gains no keys (the base weights
    move under ``base.``). The output is ``base(x) + (x @ A.T @ B.T) * scaling`` for the active
    adapter, computed in ``x``'s dtype; ``base(x)`` when none is active, or when the active adapter
    belongs to the block but does not target this layer.
    """

    def __init__(self, base: nn.Linear, registry: _BlockAdapters) -> None:
        super().__init__()
        self.base = base
        self.in_features = base.in_features
        self.out_features = base.out_features
        self._registry = registry
        self._slots: dict[str, _Slot] = {}

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        """Hold adapter ``name``: A (r, in), B (out, r)."""
        if name in self._slots:
            raise AdapterError(f"this layer already holds adapter {name!r}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not chain")
        if a.shape[1] != self.in_features or b.shape[0] != self.out_features:
            raise AdapterError(
                f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a Linear of "
                f"{self.in_features} in, {self.out_features} out features"
            )
        index = max((slot.index for slot in self._slots.values()), default=-1) + 1
        self.register_buffer(f"lora_A_{index}", a.detach(), persistent=False)
        self.register_buffer(f"lora_B_{index}", b.detach(), persistent=False)
        self._slots[name] = _Slot(index, scaling)

    def adapter_names(self) -> frozenset[str]:
        return frozenset(self._slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)  # (..., out)
        name = _ACTIVE.get()
        if name is None:
            return out
        slot = self._slots.get(name)
        if slot is None:
            self._registry.check(name)  # known to the block, but this layer is not targeted
            return out
        a = self.get_buffer(f"lora_A_{slot.index}").to(x.dtype)  # (r, in)
        b = self.get_buffer(f"lora_B_{slot.index}").to(x.dtype)  # (out, r)
        delta = F.linear(F.linear(x, a), b) * slot.scaling  # (..., out)
        return out + delta.to(out.dtype)

    def extra_repr(self) -> str:
        return f"adapters={sorted(self._slots)}"


def adapter_names(block: nn.Module) -> frozenset[str]:
    """The names of the adapters added to ``block``."""
    registry = getattr(block, _REGISTRY_ATTR, None)
    return frozenset(registry.names) if isinstance(registry, _BlockAdapters) else frozenset()


def add_adapter(block: nn.Module, adapter: LoraAdapter, block_index: int) -> None:
    """Give ``block`` (block ``block_index`` of the model) the adapter's weights for it.

    Each targeted Linear is wrapped in a :class:`LoraLinear` once, and later adapters join it. A/B
    are stored on the layer's device in the block's compute dtype (that of its first floating-point
    parameter). Every shape is checked before the block changes, so a refused adapter leaves it as
    it was. Not safe while the block runs in another thread: add adapters before serving.

    Raises :class:`AdapterError` if the block already holds an adapter of this name, the adapter
    has no weights for ``block_index``, or a module is missing, not a Linear, or of another shape.
    """
    weights = adapter.weights.get(block_index)
    if weights is None:
        raise AdapterError(
            f"adapter {adapter.name!r} was loaded for blocks {sorted(adapter.weights)}, "
            f"not block {block_index}"
        )
    registry = getattr(block, _REGISTRY_ATTR, None)
    if isinstance(registry, _BlockAdapters) and adapter.name in registry.names:
        raise AdapterError(f"block {block_index} already holds adapter {adapter.name!r}")
    planned: list[tuple[str, nn.Module, nn.Linear, torch.Tensor, torch.Tensor]] = []
    for path, (a, b) in sorted(weights.items()):
        where = f"adapter {adapter.name!r}, block {block_index}, module {path!r}"
        try:
            module = block.get_submodule(path)
        except AttributeError as error:
            raise AdapterError(
                f"{where}: the block ({type(block).__name__}) has no such module"
            ) from error
        base = module.base if isinstance(module, LoraLinear) else module
        if not isinstance(base, nn.Linear):  # bitsandbytes' layers subclass nn.Linear
            raise AdapterError(f"{where}: a {type(base).__name__}, not a Linear")
        expected_a = (adapter.rank, base.in_features)
        expected_b = (base.out_features, adapter.rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise AdapterError(
                f"{where}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the layer "
                f"({base.in_features} in, {base.out_features} out) needs {expected_a} and "
                f"{expected_b}"
            )
        planned.append((path, module, base, a, b))

    if not isinstance(registry, _BlockAdapters):
        registry = _BlockAdapters()
        setattr(block, _REGISTRY_ATTR, registry)
        block.register_forward_pre_hook(registry.pre_forward)
    dtype = _compute_dtype(block)
    for path, module, base, a, b in planned:
        if isinstance(module, LoraLinear):
            wrapper = module
        else:
            wrapper = LoraLinear(base, registry)
            parent_path, _, leaf = path.rpartition(".")
            setattr(block.get_submodule(parent_path), leaf, wrapper)
        device = base.weight.device
        wrapper.add(adapter.name, a.to(device, dtype), b.to(device, dtype), adapter.scaling)
    registry.names.add(adapter.name)


def _compute_dtype(block: nn.Module) -> torch.dtype:
    """The dtype of the block's first floating-point parameter (quantised weights are not)."""
    for parameter in block.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.get_default_dtype()
