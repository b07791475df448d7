"""``from_pretrained`` of the distributed models: config, sequence manager, client weights only.

Keyword arguments are sorted into four groups:

- Hub access (``cache_dir``, ``revision``, ``token``, ``local_files_only``): for the config and
  the weights alike;
- :class:`~petals_core.client.SequenceManagerConfig` fields (``initial_peers``,
  ``request_timeout_s``, ...; the times also under Petals' names without the unit,
  ``request_timeout``, ``ban_timeout``, ...: see :data:`PETALS_MANAGER_NAMES`), ``dht_prefix``
  (settled by :class:`~petals_core.models.AutoDistributedConfig`: given, stored, or derived from
  the name);
- ``torch_dtype`` / ``dtype`` (``"auto"`` by default: the config's dtype, else float32),
  ``tuning_mode`` (None, ``"ptune"``, ``"deep_ptune"``) and ``pre_seq_len``;
- everything else overrides config attributes, as in transformers (``num_labels=3``).

Only the client's tensors are read (:func:`petals_core.models.client_state_dict`): embeddings,
final norm, and the LM head for causal LMs; never a block.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import torch
from transformers.initialization import no_init_weights

from .._errors import CheckpointError, ConfigError
from ..client import PETALS_MANAGER_NAMES, SequenceManagerConfig, with_our_names
from ..models import AutoDistributedConfig, DistributedConfig, client_state_dict, original_repo

__all__ = [
    "PETALS_MANAGER_NAMES",
    "FromPretrainedMixin",
    "LoadOptions",
    "TuningMode",
    "load_pretrained",
    "split_options",
    "tuning_settings",
]

TuningMode = Literal["ptune", "deep_ptune"]
_TUNING_MODES = (None, "ptune", "deep_ptune")

_HUB_KEYS = ("cache_dir", "revision", "token", "local_files_only")
_MANAGER_KEYS = frozenset(
    field.name for field in attrs.fields(SequenceManagerConfig) if field.name != "dht_prefix"
)
# transformers' from_pretrained options that mean nothing here and are dropped, so that scripts
# written for Petals or transformers keep working.
_IGNORED_KEYS = ("low_cpu_mem_usage", "_from_auto", "trust_remote_code")


@attrs.frozen(kw_only=True)
class LoadOptions:
    """``from_pretrained``'s keyword arguments, sorted (see the module docstring)."""

    hub: dict[str, Any]
    manager: dict[str, Any]
    dht_prefix: str | None
    dtype: Any
    tuning_mode: str | None
    pre_seq_len: int
    config_overrides: dict[str, Any]


def split_options(kwargs: dict[str, Any]) -> LoadOptions:
    kwargs = dict(kwargs)
    for key in _IGNORED_KEYS:
        kwargs.pop(key, None)
    kwargs = with_our_names(kwargs)
    dtype = kwargs.pop("torch_dtype", None)
    dtype = kwargs.pop("dtype", None) if dtype is None else dtype
    return LoadOptions(
        hub={key: kwargs.pop(key) for key in _HUB_KEYS if key in kwargs},
        manager={key: kwargs.pop(key) for key in list(kwargs) if key in _MANAGER_KEYS},
        dht_prefix=kwargs.pop("dht_prefix", None),
        dtype=dtype,
        tuning_mode=kwargs.pop("tuning_mode", None),
        pre_seq_len=kwargs.pop("pre_seq_len", 0),
        config_overrides=kwargs,
    )


def tuning_settings(config: Any) -> tuple[TuningMode | None, int]:
    """``(tuning_mode, pre_seq_len)`` of a config, validated."""
    mode = getattr(config, "tuning_mode", None)
    prompt_len = getattr(config, "pre_seq_len", 0) or 0
    if mode not in _TUNING_MODES:
        raise ConfigError(f"tuning_mode must be one of {_TUNING_MODES}, got {mode!r}")
    if mode is not None and (not isinstance(prompt_len, int) or prompt_len < 1):
        raise ConfigError(f"tuning_mode={mode!r} needs pre_seq_len >= 1, got {prompt_len!r}")
    return mode, prompt_len if mode is not None else 0


def load_config(
    model_name_or_path: str | os.PathLike[str], options: LoadOptions
) -> DistributedConfig:
    config = AutoDistributedConfig.from_pretrained(
        model_name_or_path,
        dht_prefix=options.dht_prefix,
        **options.hub,
        **options.config_overrides,
    )
    config.tuning_mode = options.tuning_mode
    config.pre_seq_len = options.pre_seq_len
    tuning_settings(config)  # validates
    return config


def resolve_dtype(value: Any, config: Any) -> torch.dtype:
    """``torch_dtype`` as transformers reads it; ``"auto"``/None: the config's, else float32."""
    if value is None or value == "auto":
        value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if value is None:
            return torch.float32
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"torch_dtype must be a floating-point torch dtype, got {value!r}")
    return value


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_pretrained(
    cls: type[Any],
    model_name_or_path: str | os.PathLike[str],
    *,
    config: DistributedConfig | None,
    options: LoadOptions,
) -> Any:
    """Build ``cls`` and load its client tensors (:meth:`FromPretrainedMixin.client_tensors`)."""
    model_name_or_path = original_repo(model_name_or_path)
    if config is None:
        config = load_config(model_name_or_path, options)
    expected = getattr(cls, "config_class", None)
    if isinstance(expected, type) and not isinstance(config, expected):
        raise ConfigError(
            f"{cls.__name__} serves model_type {getattr(expected, 'model_type', '?')!r}, but "
            f"{os.fspath(model_name_or_path)!r} has model_type {config.model_type!r}: "
            "use the AutoDistributed* classes"
        )
    dtype = resolve_dtype(options.dtype, config)
    manager_config = SequenceManagerConfig(dht_prefix=config.dht_prefix, **options.manager)
    # The weights are loaded right after; drawing them first would be wasted work. (Prompts and
    # the score head are drawn with Tensor.normal_, which no_init_weights leaves alone.)
    with no_init_weights(), _default_dtype(dtype):
        model = cls(config, sequence_manager_config=manager_config)

    keep, strip = cls.client_tensors()
    wants_head = any(prefix.startswith("lm_head") for prefix in keep)
    load_config_ = config
    if not wants_head and not config.tie_word_embeddings:
        # With tied embeddings client_state_dict reads no LM head: the head is not needed here.
        load_config_ = copy.copy(config)
        load_config_.tie_word_embeddings = True
    tensors = client_state_dict(model_name_or_path, config=load_config_, dtype=dtype, **options.hub)
    state = {
        name.removeprefix(strip): tensor
        for name, tensor in tensors.items()
        if name.startswith(keep)
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = ("prompt_embeddings", "intermediate_prompt_embeddings", "score.")
    missing = [
        name
        for name in missing
        if not any(part in name for part in allowed_missing)
        and not (name == "lm_head.weight" and config.tie_word_embeddings)
    ]
    if missing or unexpected:
        raise CheckpointError(
            f"{os.fspath(model_name_or_path)!r} does not fit {cls.__name__}: "
            f"missing {missing}, unexpected {list(unexpected)}"
        )
    tie = getattr(model, "tie_client_weights", None)
    if tie is not None:
        tie()
    model.eval()
    return model


class FromPretrainedMixin:
    """``from_pretrained`` for the distributed model classes.

    What a class loads follows from transformers' ``base_model_prefix`` (``"model"``,
    ``"transformer"``): the base model's tensors, plus ``_local_heads`` (``("lm_head.",)`` for a
    causal LM); a base model itself (``_is_base_model``) holds them without the prefix.
    """

    base_model_prefix: str
    _local_heads: ClassVar[tuple[str, ...]] = ()
    _is_base_model: ClassVar[bool] = False

    if TYPE_CHECKING:  # the family's *PreTrainedModel defines it

        def post_init(self) -> None: ...

    @classmethod
    def client_tensors(cls) -> tuple[tuple[str, ...], str]:
        """The prefixes of the tensors (as :func:`client_state_dict` names them) this class
        loads, and the prefix removed from their names first."""
        base = f"{cls.base_model_prefix}."
        return (base, *cls._local_heads), base if cls._is_base_model else ""

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | os.PathLike[str],
        *args: Any,
        config: DistributedConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        """Load the client part of a model from a Hub repo or a local folder.

        ``initial_peers=...``, ``torch_dtype=...``, ``tuning_mode=None | "ptune" |
        "deep_ptune"``, ``pre_seq_len=...``, ``dht_prefix=...``, any
        :class:`~petals_core.client.SequenceManagerConfig` field (its times also under Petals'
        names: ``request_timeout`` for ``request_timeout_s``, ...), ``cache_dir``, ``revision``,
        ``token``, ``local_files_only``; other keyword arguments override config attributes.
        Raises :class:`~petals_core.ConfigError` for a checkpoint of another family or a bad
        option, :class:`~petals_core.CheckpointError` for missing or unreadable weights.
        """
        if args:
            raise TypeError("from_pretrained takes the model name, then keyword arguments only")
        return load_pretrained(
            cls,
            model_name_or_path,
            config=config,
            options=split_options(kwargs),
        )
