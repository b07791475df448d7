"""Configs of distributed models: transformers' config plus the name of the swarm that serves it.

``dht_prefix`` names the swarm: servers announce block ``i`` under the key ``f"{dht_prefix}.{i}"``
and clients look blocks up under the same keys, so every peer serving or using one model must agree
on it. :func:`default_dht_prefix` derives it from where the model came from; an explicit value
always wins, and a value stored in ``config.json`` (one saved from a distributed config) comes next.

Only ``model_type`` chooses the family: SmolLM2, Vicuna and other LLaMA-architecture checkpoints
whose ``config.json`` says ``"llama"`` load as :class:`DistributedLlamaConfig`.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Self, cast, overload

from transformers import BloomConfig, FalconConfig, LlamaConfig, MixtralConfig, PreTrainedConfig

from .._errors import CheckpointError, ConfigError

__all__ = [
    "AutoDistributedConfig",
    "DistributedBloomConfig",
    "DistributedConfig",
    "DistributedFalconConfig",
    "DistributedLlamaConfig",
    "DistributedMixtralConfig",
    "default_dht_prefix",
    "original_repo",
]

logger = logging.getLogger(__name__)

# A Hub repo id: "name" or "owner/name". Anything else (absolute or dotted paths, several slashes)
# can only be a local folder.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?")
# Petals' converted BLOOM repos, named after their originals.
_CONVERTED_REPO = re.compile(r"(bigscience/[A-Za-z0-9][A-Za-z0-9_.-]*)-petals")
# Dots are left out as well: block keys are f"{dht_prefix}.{index}", split at the last dot.
_NOT_IN_PREFIX = re.compile(r"[^A-Za-z0-9_-]")


def default_dht_prefix(model_name_or_path: str | os.PathLike[str], model_type: str) -> str:
    """The swarm name of a model, derived from its Hub repo id or local folder.

    Hub repos follow Petals' rules, so that Petals' swarm names and petals_core's agree:

    - BLOOM: the repo id with ``-petals`` appended: ``bigscience/bloom`` ->
      ``bigscience/bloom-petals``, ``bigscience/bloom-560m`` -> ``bigscience/bloom-560m-petals``.
    - LLaMA-family: the repo name without its owner (copies of one model uploaded by different
      people form one swarm), ending in ``-hf``: ``meta-llama/Llama-2-70b-chat-hf`` ->
      ``Llama-2-70b-chat-hf``, ``HuggingFaceTB/SmolLM2-135M-Instruct`` ->
      ``SmolLM2-135M-Instruct-hf``.
    - Falcon: the repo name without its owner, as it is: ``tiiuae/falcon-40b`` -> ``falcon-40b``.
    - Mixtral: the repo id, owner included: ``mistralai/Mixtral-8x7B-Instruct-v0.1`` ->
      ``mistralai/Mixtral-8x7B-Instruct-v0-1``.

    Dots become ``-`` in every derived prefix (``Llama-3.1-8B`` -> ``Llama-3-1-8B-hf``), because
    block keys are ``f"{dht_prefix}.{block_index}"``. A local folder (an ``os.PathLike``, or a
    string that cannot be a repo id) uses its folder name with every character outside
    ``[A-Za-z0-9_-]`` replaced by ``-``. This function is pure: it looks at no file, so a relative
    folder spelled like a repo id (``models/llama``) counts as a repo here; pass a ``Path`` to mean
    a folder (as :meth:`DistributedConfig.from_pretrained` does for existing folders).
    """
    if isinstance(model_name_or_path, os.PathLike) or not _REPO_ID.fullmatch(model_name_or_path):
        folder_name = Path(model_name_or_path).name
        return _NOT_IN_PREFIX.sub("-", folder_name) or "model"
    repo_id = model_name_or_path.replace(".", "-")
    if model_type == "bloom":
        return f"{repo_id}-petals"
    if model_type == "mixtral":
        return repo_id
    name = repo_id.rsplit("/", 1)[-1]
    if model_type == "falcon" or name.endswith("-hf"):
        return name
    return f"{name}-hf"


@overload
def original_repo(model_name_or_path: str) -> str: ...
@overload
def original_repo(model_name_or_path: os.PathLike[str]) -> os.PathLike[str]: ...
def original_repo(model_name_or_path: str | os.PathLike[str]) -> str | os.PathLike[str]:
    """The repo to load for ``model_name_or_path``: Petals' converted BLOOM repos
    (``bigscience/NAME-petals``) name their original (``bigscience/NAME``), which holds the
    weights; anything else is itself.  The swarm name stays ``bigscience/NAME-petals``."""
    if isinstance(model_name_or_path, str) and not os.path.isdir(model_name_or_path):
        match = _CONVERTED_REPO.fullmatch(model_name_or_path)
        if match is not None:
            logger.info(
                "loading %s from %s, the original repo of Petals' converted one",
                model_name_or_path,
                match.group(1),
            )
            return match.group(1)
    return model_name_or_path


class DistributedConfig(PreTrainedConfig):
    """Common base of the distributed configs: a transformers config with a swarm name.

    Subclasses pair this with one transformers config class (``model_type`` comes from there).
    """

    dht_prefix: str | None = None

    @classmethod
    def from_pretrained(  # type: ignore[override]  # keyword-only options, and dht_prefix
        cls,
        model_name_or_path: str | os.PathLike[str],
        *,
        revision: str | None = None,
        token: str | bool | None = None,
        dht_prefix: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool = False,
        **kwargs: Any,
    ) -> Self:
        """Load ``config.json`` from a Hub repo or a local folder and settle ``dht_prefix``.

        ``dht_prefix`` given here wins; else the one stored in ``config.json``; else
        :func:`default_dht_prefix`. Other keyword arguments override config attributes, as in
        transformers. Raises :class:`~petals_core.ConfigError` if the checkpoint is of another
        family than this class (on :class:`DistributedConfig` itself, of no supported family).
        """
        return cast(
            Self,
            _load_config(
                cls,
                model_name_or_path,
                revision=revision,
                token=token,
                dht_prefix=dht_prefix,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                kwargs=kwargs,
            ),
        )


class DistributedLlamaConfig(DistributedConfig, LlamaConfig):
    """A LLaMA-family config (``model_type == "llama"``) with ``dht_prefix``."""


class DistributedBloomConfig(DistributedConfig, BloomConfig):
    """A BLOOM config (``model_type == "bloom"``) with ``dht_prefix``."""


class DistributedFalconConfig(DistributedConfig, FalconConfig):
    """A Falcon config (``model_type == "falcon"``) with ``dht_prefix``.  Without a
    ``pad_token_id`` (Falcon's checkpoints have none) it is 0, as in Petals."""


class DistributedMixtralConfig(DistributedConfig, MixtralConfig):
    """A Mixtral config (``model_type == "mixtral"``) with ``dht_prefix``.  Without a
    ``pad_token_id`` (Mixtral's checkpoints have none) it is 0, as in Petals, so that batches can
    be padded."""


_CONFIG_CLASSES: dict[str, type[DistributedConfig]] = {
    "bloom": DistributedBloomConfig,
    "falcon": DistributedFalconConfig,
    "llama": DistributedLlamaConfig,
    "mixtral": DistributedMixtralConfig,
}


class AutoDistributedConfig:
    """Chooses the distributed config class from the checkpoint's ``model_type``.

    ``AutoDistributedConfig.from_pretrained`` is :meth:`DistributedConfig.from_pretrained` of
    the common base, which loads any supported family.  It raises
    :class:`~petals_core.ConfigError` (a ``ValueError``) naming the model type when it is not one
    of ``"bloom"``, ``"falcon"``, ``"llama"``, ``"mixtral"``.
    """

    def __init__(self) -> None:
        raise TypeError("use AutoDistributedConfig.from_pretrained(...)")

    from_pretrained = DistributedConfig.from_pretrained


def _load_config(
    expected: type[DistributedConfig],
    model_name_or_path: str | os.PathLike[str],
    *,
    revision: str | None,
    token: str | bool | None,
    dht_prefix: str | None,
    cache_dir: str | os.PathLike[str] | None,
    local_files_only: bool,
    kwargs: dict[str, Any],
) -> DistributedConfig:
    model_name_or_path = original_repo(model_name_or_path)
    # One read of config.json (one revision lookup on the Hub), whichever class it turns out to be.
    try:
        config_dict, unused_kwargs = PreTrainedConfig.get_config_dict(
            model_name_or_path,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            **kwargs,
        )
    except OSError as exc:  # transformers' way of saying "no such model" (and Hub failures)
        raise CheckpointError(
            f"cannot read the config of {os.fspath(model_name_or_path)!r}: {exc}"
        ) from exc
    model_type = config_dict.get("model_type")
    config_class = _CONFIG_CLASSES.get(model_type) if isinstance(model_type, str) else None
    if config_class is None or not isinstance(model_type, str):
        raise ConfigError(
            f"{os.fspath(model_name_or_path)!r} has model_type {model_type!r}, which petals_core "
            f"does not serve; supported model types: {', '.join(sorted(_CONFIG_CLASSES))}"
        )
    if not issubclass(config_class, expected):  # never for the common base
        raise ConfigError(
            f"{os.fspath(model_name_or_path)!r} has model_type {model_type!r}, not "
            f"{expected.model_type!r}: load it with {config_class.__name__} "
            "or AutoDistributedConfig"
        )
    config = config_class.from_dict(
        config_dict, name_or_path=os.fspath(model_name_or_path), **unused_kwargs
    )
    if (
        isinstance(config, DistributedFalconConfig | DistributedMixtralConfig)
        and config.pad_token_id is None
    ):
        config.pad_token_id = 0
    if dht_prefix is not None:
        config.dht_prefix = dht_prefix
    elif config.dht_prefix is None:
        source = model_name_or_path
        if os.path.isdir(source):
            source = Path(source).resolve()
        config.dht_prefix = default_dht_prefix(source, model_type)
    return config
