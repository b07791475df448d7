"""Loading LoRA adapters in PEFT's format, for the blocks a server holds.

The format is what ``peft`` saves: ``adapter_config.json`` (``peft_type`` ``"LORA"``, ``r``,
``lora_alpha``, ``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with
names like ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. Only the tensors of
the requested blocks are read. Pickled ``adapter_model.bin`` files are refused, never unpickled.
Tensors outside the blocks (``modules_to_save`` copies of embeddings or the LM head) concern the
client and are not read here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import attrs
import torch
from huggingface_hub.errors import LocalEntryNotFoundError, RemoteEntryNotFoundError
from safetensors import safe_open
from transformers import PreTrainedConfig

from .._errors import AdapterError, CheckpointError
from ._hub import HubAccess, HubRepo, unreadable
from ._lora import LoraAdapter, check_lora_pair

__all__ = ["load_lora_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLED_FILES = ("adapter_model.bin",)
_ALL_LINEAR = "all-linear"  # PEFT's shorthand for every linear layer but the output head


@attrs.frozen(kw_only=True)
class _Family:
    """Where a model family keeps its blocks, and which of their modules are LoRA-able Linears."""

    label: str  # for messages
    module_prefix: str  # PEFT's module name of block N is f"{module_prefix}{N}.{path}"
    stored_prefix: str  # regex of the block part of stored tensor names (before the index)
    linears: tuple[str, ...]  # module paths within a block
    #: Module paths within each expert, under f"{experts}{E}." for each of the config's experts.
    expert_linears: tuple[str, ...] = ()
    experts: str = ""

    def for_config(self, config: PreTrainedConfig) -> _Family:
        """This family with its experts' linears spelled out for ``config``'s expert count."""
        if not self.expert_linears:
            return self
        expanded = tuple(
            f"{self.experts}{index}.{path}"
            for index in range(int(config.num_local_experts))
            for path in self.expert_linears
        )
        return attrs.evolve(self, linears=self.linears + expanded, expert_linears=())


#: BLOOM's and Falcon's block linears: one fused query/key/value projection, its output, the MLP.
_FUSED_QKV_LINEARS = (
    "self_attention.query_key_value",
    "self_attention.dense",
    "mlp.dense_h_to_4h",
    "mlp.dense_4h_to_h",
)

_ATTENTION_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
)

_FAMILIES: dict[str, _Family] = {
    "llama": _Family(
        label="LLaMA",
        module_prefix="model.layers.",
        stored_prefix=r"(?:model\.)?layers\.",
        linears=(*_ATTENTION_LINEARS, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    ),
    "mixtral": _Family(
        label="Mixtral",
        module_prefix="model.layers.",
        stored_prefix=r"(?:model\.)?layers\.",
        linears=(*_ATTENTION_LINEARS, "block_sparse_moe.gate"),
        experts="block_sparse_moe.experts.",
        expert_linears=("w1", "w2", "w3"),
    ),
    "bloom": _Family(
        label="BLOOM",
        module_prefix="transformer.h.",
        # bigscience checkpoints name blocks h.N without "transformer.": accept adapters of both.
        stored_prefix=r"(?:transformer\.)?h\.",
        linears=_FUSED_QKV_LINEARS,
    ),
    "falcon": _Family(
        label="Falcon",
        module_prefix="transformer.h.",
        stored_prefix=r"(?:transformer\.)?h\.",
        linears=_FUSED_QKV_LINEARS,
    ),
}


@attrs.frozen(kw_only=True)
class _LoraConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: str | tuple[str, ...]  # a regex (PEFT: re.fullmatch) or names
    exclude_modules: str | tuple[str, ...]
    layers_to_transform: frozenset[int] | None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def load_lora_adapter(
    name_or_path: str | os.PathLike[str],
    *,
    config: PreTrainedConfig,
    block_indices: Iterable[int],
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    dtype: torch.dtype | None = None,
) -> LoraAdapter:
    """Load a PEFT LoRA adapter's weights for blocks ``block_indices`` of the model of ``config``.

    ``name_or_path`` is a Hub repo id or a local folder, and (as given) becomes the adapter's name;
    ``revision``, ``token``, ``cache_dir`` and ``local_files_only`` mean what they mean to
    ``hf_hub_download``. Only the requested blocks' tensors are read, cast to ``dtype`` if given.

    Raises :class:`AdapterError` when the adapter is not LoRA, uses what a server cannot apply
    (biases, DoRA, per-module ranks, ``fan_in_fan_out``), targets modules the family lacks, lacks
    or has extra tensors for a requested block, has ill-shaped tensors, is pickled
    (``adapter_model.bin``), or cannot be fetched (Hub and cache failures chained).
    """
    name = os.fspath(name_or_path)
    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise AdapterError(
            f"cannot load adapters for model_type {config.model_type!r}; "
            f"supported model types: {', '.join(sorted(_FAMILIES))}"
        )
    family = family.for_config(config)
    num_blocks: int = config.num_hidden_layers
    indices = sorted(set(block_indices))
    for index in indices:
        if not 0 <= index < num_blocks:
            raise AdapterError(
                f"block index {index} is out of range: the model has {num_blocks} blocks "
                f"(0..{num_blocks - 1})"
            )
    with _as_adapter_error():
        access = HubAccess(
            revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only
        )
        source, config_path, weights_path = _fetch(name_or_path, access)
        lora = _parse_config_untrusted(config_path.read_bytes(), source)
        expected = _targets(lora, family, num_blocks, source)
        weights = _read_weights(weights_path, family, lora, expected, indices, source, dtype)
    return LoraAdapter(
        name=name,
        rank=lora.rank,
        scaling=lora.scaling,
        target_modules=frozenset().union(*expected.values()),
        weights=weights,
    )


def adapter_nbytes_per_block(
    name_or_path: str | os.PathLike[str],
    *,
    config: PreTrainedConfig,
    dtype: torch.dtype,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
) -> int:
    """The most memory the adapter's weights take in one block of the model, in ``dtype``: its
    rank times the inputs and outputs of each layer it adapts there.  Reads the adapter's config
    only (the weights are fetched, not read); raises what :func:`load_lora_adapter` raises."""
    from ._families import new_block

    family = _FAMILIES.get(config.model_type)
    if family is None:
        raise AdapterError(f"cannot load adapters for model_type {config.model_type!r}")
    family = family.for_config(config)
    with _as_adapter_error():
        access = HubAccess(
            revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only
        )
        source, config_path, _ = _fetch(name_or_path, access)
        lora = _parse_config_untrusted(config_path.read_bytes(), source)
        targets = _targets(lora, family, config.num_hidden_layers, source)
    with torch.device("meta"):
        block = new_block(config, 0, purpose="size adapters")
    most = 0
    for paths in targets.values():
        elements = 0
        for path in paths:
            linear = block.get_submodule(path)
            assert isinstance(linear, torch.nn.Linear)
            elements += lora.rank * (linear.in_features + linear.out_features)
        most = max(most, elements)
    return most * dtype.itemsize


@contextlib.contextmanager
def _as_adapter_error() -> Iterator[None]:
    try:
        yield
    except CheckpointError as error:  # from _hub: Hub, cache and file failures
        raise AdapterError(str(error)) from error
    except OSError as error:
        raise AdapterError(f"cannot read the adapter: {error}") from error


def _fetch(name_or_path: str | os.PathLike[str], access: HubAccess) -> tuple[str, Path, Path]:
    """Where to read from (for messages), and the local paths of the config and the weights."""
    if os.path.isdir(name_or_path):
        folder = Path(name_or_path)
        source = f"adapter folder {os.fspath(folder)!r}"
        if not (folder / CONFIG_FILE).is_file():
            raise AdapterError(f"{source} has no {CONFIG_FILE}: not a PEFT adapter")
        if not (folder / WEIGHTS_FILE).is_file():
            pickled = [name for name in _PICKLED_FILES if (folder / name).is_file()]
            raise _no_safetensors(source, pickled)
        return source, folder / CONFIG_FILE, folder / WEIGHTS_FILE

    repo_id = os.fspath(name_or_path)
    repo = HubRepo.resolve(repo_id, access, what="adapter repo")
    source, fetch = repo.source, repo.fetch
    config_path = _fetch_or(
        fetch, CONFIG_FILE, f"{source} has no {CONFIG_FILE}: not a PEFT adapter"
    )
    try:
        weights_path = fetch(WEIGHTS_FILE)
    except CheckpointError as error:
        if isinstance(error.__cause__, RemoteEntryNotFoundError):
            raise _no_safetensors(source, repo.present(_PICKLED_FILES)) from None
        raise
    return source, config_path, weights_path


def _fetch_or(fetch: Callable[[str], Path], filename: str, missing: str) -> Path:
    try:
        return fetch(filename)
    except CheckpointError as error:
        if isinstance(error.__cause__, RemoteEntryNotFoundError):
            raise AdapterError(missing) from error
        if isinstance(error.__cause__, LocalEntryNotFoundError):
            raise AdapterError(str(error)) from error
        raise


def _no_safetensors(source: str, pickled: list[str]) -> AdapterError:
    if pickled:
        return AdapterError(
            f"{source} holds only pickled adapter weights ({', '.join(pickled)}); petals_core "
            f"loads {WEIGHTS_FILE} only, because unpickling runs arbitrary code. Convert it, e.g. "
            "with peft: PeftModel.from_pretrained(...).save_pretrained(folder, "
            "safe_serialization=True)"
        )
    return AdapterError(f"{source} has no {WEIGHTS_FILE}")


def _parse_config_untrusted(data: bytes, source: str) -> _LoraConfig:
    """Validate ``adapter_config.json``; anything a server cannot apply raises AdapterError."""
    where = f"{source}, {CONFIG_FILE}"
    try:
        raw = json.loads(data)
    except ValueError as error:
        raise AdapterError(f"{where} is not valid JSON: {error}") from error
    if not isinstance(raw, dict):
        raise AdapterError(f"{where} is not a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise AdapterError(f"{where}: peft_type is {peft_type!r}; only 'LORA' adapters load")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterError(f"{where}: r must be a positive integer, got {rank!r}")
    alpha = raw.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{where}: lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise AdapterError(f"{where}: use_rslora must be true or false, got {use_rslora!r}")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterError(
            f"{where}: bias is {bias!r}; only 'none' is supported (trained biases would replace "
            "the base model's, which other requests share)"
        )
    refused = {
        "fan_in_fan_out": "every family's layers are nn.Linear, so PEFT never sets it for them",
        "use_dora": "DoRA adapters are not supported",
        "lora_bias": "LoRA biases are not supported",
    }
    for key, why in refused.items():
        if raw.get(key):
            raise AdapterError(f"{where}: {key} is {raw[key]!r}; must be false ({why})")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise AdapterError(
                f"{where}: {key} is set; per-module ranks and alphas are not supported"
            )
    if raw.get("layer_replication"):
        raise AdapterError(f"{where}: layer_replication is not supported")
    if raw.get("target_parameters"):
        raise AdapterError(f"{where}: target_parameters is not supported")
    target_modules = _module_selector(raw.get("target_modules"), "target_modules", where)
    if not target_modules:
        raise AdapterError(f"{where}: target_modules names no module")
    exclude = raw.get("exclude_modules")
    exclude_modules = () if exclude is None else _module_selector(exclude, "exclude_modules", where)
    layers = raw.get("layers_to_transform")
    if layers is None:
        layers_to_transform = None
    elif isinstance(layers, int) and not isinstance(layers, bool):
        layers_to_transform = frozenset({layers})
    elif isinstance(layers, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in layers
    ):
        layers_to_transform = frozenset(layers)
    else:
        raise AdapterError(f"{where}: layers_to_transform must be an integer or a list of them")
    return _LoraConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=use_rslora,
        target_modules=target_modules,
        exclude_modules=exclude_modules,
        layers_to_transform=layers_to_transform,
    )


def _module_selector(value: object, key: str, where: str) -> str | tuple[str, ...]:
    if isinstance(value, str):
        try:
            re.compile(value)
        except re.error as error:
            raise AdapterError(f"{where}: {key} is not a valid regex: {error}") from error
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise AdapterError(f"{where}: {key} must be a list of module names or a regex string")


def _selects(selector: str | tuple[str, ...], key: str) -> bool:
    """PEFT's rule: a regex must match the whole module name; a name, it or its dotted suffix."""
    if isinstance(selector, str):
        return re.fullmatch(selector, key) is not None
    return any(key == name or key.endswith("." + name) for name in selector)


def _targets(
    lora: _LoraConfig, family: _Family, num_blocks: int, source: str
) -> dict[int, frozenset[str]]:
    """For every block of the model, the module paths the adapter has weights for."""
    selector = lora.target_modules
    if selector == _ALL_LINEAR:
        selector = family.linears
    elif isinstance(selector, str) and not any(
        re.fullmatch(selector, f"{family.module_prefix}{i}.{path}")
        for i in range(num_blocks)
        for path in family.linears
    ):
        raise AdapterError(
            f"{source}: target_modules regex {selector!r} matches no module of {family.label} "
            f"blocks (named {family.module_prefix}N.{{{', '.join(family.linears)}}})"
        )
    if isinstance(selector, tuple):
        every_key = [
            f"{family.module_prefix}{i}.{path}"
            for i in range(num_blocks)
            for path in family.linears
        ]
        unknown = [
            name for name in selector if not any(_selects((name,), key) for key in every_key)
        ]
        if unknown:
            raise AdapterError(
                f"{source}: unknown target modules {unknown} for {family.label} blocks; "
                f"known: {', '.join(family.linears)}"
            )
    targets: dict[int, frozenset[str]] = {}
    for i in range(num_blocks):
        if lora.layers_to_transform is not None and i not in lora.layers_to_transform:
            targets[i] = frozenset()
            continue
        keys = {path: f"{family.module_prefix}{i}.{path}" for path in family.linears}
        targets[i] = frozenset(
            path
            for path, key in keys.items()
            if _selects(selector, key) and not _selects(lora.exclude_modules, key)
        )
    if not any(targets.values()):
        raise AdapterError(f"{source}: the config targets no module of any block")
    return targets


def _read_weights(
    path: Path,
    family: _Family,
    lora: _LoraConfig,
    expected: Mapping[int, frozenset[str]],
    indices: list[int],
    source: str,
    dtype: torch.dtype | None,
) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The (A, B) pairs of the requested blocks; other blocks' tensors are never read."""
    block_re = re.compile(
        rf"(?:base_model\.model\.)?{family.stored_prefix}(?P<index>\d+)\.(?P<rest>.+)"
    )
    lora_re = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight")
    wanted = set(indices)
    where = f"{source}, file {WEIGHTS_FILE!r}"
    with unreadable(where), safe_open(path, framework="pt") as file:
        names: dict[tuple[int, str, str], str] = {}  # (block, module, "A"|"B") -> stored name
        stored_names = file.keys()
        for stored in stored_names:
            block = block_re.fullmatch(stored)
            if block is None or int(block["index"]) not in wanted:
                continue  # another block's, or outside the blocks (modules_to_save: the client's)
            index = int(block["index"])
            tensor = lora_re.fullmatch(block["rest"])
            if tensor is None:
                raise AdapterError(
                    f"{where}: tensor {stored!r} is not a LoRA weight (lora_A or lora_B) that a "
                    "server can apply"
                )
            key = (index, tensor["module"], tensor["which"])
            if key in names:
                raise AdapterError(
                    f"{where}: both {names[key]!r} and {stored!r} hold the same weight"
                )
            names[key] = stored
        weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for index in indices:
            found = {module for (i, module, _) in names if i == index}
            unknown = sorted(found.difference(family.linears))
            if unknown:
                raise AdapterError(
                    f"{where}: block {index} has weights for unknown modules {unknown}; "
                    f"{family.label} blocks have {', '.join(family.linears)}"
                )
            untargeted = sorted(found - expected[index])
            if untargeted:
                raise AdapterError(
                    f"{where}: block {index} has weights for {untargeted}, which the config does "
                    "not target"
                )
            weights[index] = {}
            for module in sorted(expected[index]):
                pair = []
                for which in ("A", "B"):
                    stored_name = names.get((index, module, which))
                    if stored_name is None:
                        raise AdapterError(
                            f"{where}: block {index}, module {module!r} lacks lora_{which}"
                        )
                    pair.append(_tensor(file.get_tensor(stored_name), stored_name, where, dtype))
                a, b = pair
                check_lora_pair(a, b, lora.rank, f"{where}: block {index}, module {module!r}")
                weights[index][module] = (a, b)
    return weights


def _tensor(tensor: torch.Tensor, name: str, where: str, dtype: torch.dtype | None) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise AdapterError(f"{where}: {name!r} is {tensor.dtype}, not floating point")
    return tensor if dtype is None else tensor.to(dtype)
