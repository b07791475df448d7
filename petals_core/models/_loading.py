"""Checkpoint loading that reads only what one peer needs.

A server hosting blocks ``[2, 4)`` of a model downloads and reads the safetensors shards that hold
those blocks, and a client the shards that hold the embeddings, the final norm and the LM head;
neither ever sees the rest. The shard index (``model.safetensors.index.json``) says which shard
holds which tensor, and ``safetensors.safe_open`` reads single tensors out of a shard.

Hub repos go through huggingface_hub (see :class:`HubRepo`): the revision is resolved to a commit
once per call, then every file comes from that commit. Once cached, a load makes one request (the
revision lookup), or none offline.
A local folder is read in place.

Only safetensors checkpoints load: pickled ``.bin`` checkpoints run code when unpickled, so they are
refused with an error saying so.

Tensor names follow transformers: LLaMA and Mixtral keep layer ``N`` under ``model.layers.N.``,
BLOOM and Falcon under ``transformer.h.N.``. Checkpoints of the ``bigscience`` BLOOM repos were
saved from ``BloomModel`` and lack the ``transformer.`` part (``h.N.``, ``word_embeddings.``,
``ln_f.``); the layout is detected from the names in the index, and both load (Falcon's too).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path

import attrs
import torch
from huggingface_hub.errors import (
    EntryNotFoundError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
)
from safetensors import safe_open
from transformers import PreTrainedConfig

from .._errors import CheckpointError
from ._hub import HubAccess, HubRepo, unreadable

__all__ = ["CheckpointError", "block_state_dict", "client_state_dict", "load_blocks"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PICKLED_FILES = ("pytorch_model.bin.index.json", "pytorch_model.bin")


@attrs.frozen(kw_only=True)
class _Layout:
    """Where a model family keeps its tensors, relative to a base prefix found per checkpoint."""

    base_prefixes: tuple[str, ...]  # tried in order; the first under which blocks exist wins
    blocks: str  # block N lives under f"{base}{blocks}{N}."
    client_modules: tuple[str, ...]  # what a client holds, besides "lm_head."
    canonical_base: str  # base prefix of the names client_state_dict returns

    def base_of(self, names: Iterable[str], source: str) -> str:
        names = list(names)
        for base in self.base_prefixes:
            if any(name.startswith(base + self.blocks) for name in names):
                return base
        expected = " or ".join(f"{base}{self.blocks}0.*" for base in self.base_prefixes)
        raise CheckpointError(f"{source} holds no transformer blocks (no tensor named {expected})")


#: LLaMA's and Mixtral's: ``model.layers.N.``, ``model.embed_tokens.``, ``model.norm.``.
_LLAMA_LAYOUT = _Layout(
    base_prefixes=("model.", ""),
    blocks="layers.",
    client_modules=("embed_tokens.", "norm."),
    canonical_base="model.",
)

_LAYOUTS: dict[str, _Layout] = {
    "llama": _LLAMA_LAYOUT,
    "mixtral": _LLAMA_LAYOUT,
    "bloom": _Layout(
        base_prefixes=("transformer.", ""),
        blocks="h.",
        client_modules=("word_embeddings.", "word_embeddings_layernorm.", "ln_f."),
        canonical_base="transformer.",
    ),
    "falcon": _Layout(
        base_prefixes=("transformer.", ""),
        blocks="h.",
        client_modules=("word_embeddings.", "ln_f."),
        canonical_base="transformer.",
    ),
}
_LM_HEAD = "lm_head."


def block_state_dict(
    model_name_or_path: str | os.PathLike[str],
    block_index: int,
    *,
    config: PreTrainedConfig,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The parameters of one transformer block, named as in its transformers layer.

    Keys lose the per-layer prefix: ``self_attn.q_proj.weight`` for LLaMA,
    ``self_attention.query_key_value.weight`` for BLOOM, ready for ``block.load_state_dict``.
    Floating-point tensors are cast to ``dtype`` when it is given. See :func:`load_blocks`.
    """
    return load_blocks(
        model_name_or_path,
        range(block_index, block_index + 1),
        config=config,
        revision=revision,
        token=token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        dtype=dtype,
    )[block_index]


_STALE_BUFFERS = ("rotary_emb.inv_freq",)


def load_blocks(
    model_name_or_path: str | os.PathLike[str],
    block_indices: Iterable[int],
    *,
    config: PreTrainedConfig,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    dtype: torch.dtype | None = None,
    max_disk_space: int | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """The state dicts of several blocks (e.g. ``range(2, 4)``), keyed by block index.

    Only the shards holding these blocks are downloaded and opened, each once.
    ``model_name_or_path`` is a Hub repo id or a local folder; ``revision``, ``token``,
    ``cache_dir`` and ``local_files_only`` mean what they mean to ``hf_hub_download``. ``config``
    gives the family (``model_type``) and the number of blocks.  With ``max_disk_space``, the
    repo's files in the cache take at most that many bytes: the repo's least recently used
    weight files (not these blocks') are deleted before a download would pass it.

    Raises :class:`CheckpointError` for an index out of range, a block missing from the checkpoint,
    a checkpoint without safetensors, or a Hub or cache failure.
    """
    layout = _layout_of(config)
    indices = sorted(set(block_indices))
    num_blocks = config.num_hidden_layers
    for index in indices:
        if not 0 <= index < num_blocks:
            raise CheckpointError(
                f"block index {index} is out of range: the model has {num_blocks} blocks "
                f"(0..{num_blocks - 1})"
            )
    access = HubAccess(
        revision=revision,
        token=token,
        cache_dir=cache_dir,
        local_files_only=local_files_only,
        max_disk_space=max_disk_space,
    )
    checkpoint, base = _open(model_name_or_path, layout, access)
    names_of = {
        index: [
            name
            for name in checkpoint.weight_map
            if name.startswith(f"{base}{layout.blocks}{index}.")
            # Checkpoints saved by transformers 4.28-4.30 (e.g. Llama-2) still hold the rotary
            # frequencies as a buffer; they follow from the config and are not weights.
            and not name.endswith(_STALE_BUFFERS)
        ]
        for index in indices
    }
    missing = [index for index, names in names_of.items() if not names]
    if missing:
        raise CheckpointError(
            f"{checkpoint.source} has no tensors for block(s) {missing} "
            f"(named {base}{layout.blocks}N.*)"
        )
    tensors = checkpoint.read([name for names in names_of.values() for name in names], dtype=dtype)
    return {
        index: {
            name.removeprefix(f"{base}{layout.blocks}{index}."): tensors[name] for name in names
        }
        for index, names in names_of.items()
    }


def _open(
    model_name_or_path: str | os.PathLike[str], layout: _Layout, access: HubAccess
) -> tuple[_Checkpoint, str]:
    """The checkpoint and the prefix its tensor names carry (e.g. ``transformer.`` or none)."""
    checkpoint = _Checkpoint.open(model_name_or_path, access)
    return checkpoint, layout.base_of(checkpoint.weight_map, checkpoint.source)


def client_state_dict(
    model_name_or_path: str | os.PathLike[str],
    *,
    config: PreTrainedConfig,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    local_files_only: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """What a client holds: the embeddings, the final norm and the LM head, nothing of the blocks.

    Names are those of transformers' ``*ForCausalLM``: ``model.embed_tokens.weight``,
    ``model.norm.weight``, ``lm_head.weight`` for LLaMA; ``transformer.word_embeddings.weight``,
    ``transformer.word_embeddings_layernorm.*``, ``transformer.ln_f.*`` for BLOOM (also when the
    checkpoint stores them without ``transformer.``); ``transformer.word_embeddings.weight``,
    ``transformer.ln_f.*`` for Falcon. With ``config.tie_word_embeddings`` there is
    no ``lm_head.weight``: the head is the embedding matrix. Arguments and errors as in
    :func:`load_blocks`; only the shards holding these tensors are downloaded.
    """
    layout = _layout_of(config)
    access = HubAccess(
        revision=revision, token=token, cache_dir=cache_dir, local_files_only=local_files_only
    )
    checkpoint, base = _open(model_name_or_path, layout, access)
    wanted = [base + module for module in layout.client_modules]
    if not config.tie_word_embeddings:
        wanted.append(_LM_HEAD)
    renamed: dict[str, str] = {}  # stored name -> returned name
    for prefix in wanted:
        names = [name for name in checkpoint.weight_map if name.startswith(prefix)]
        if not names:
            raise CheckpointError(f"{checkpoint.source} has no tensors named {prefix}*")
        for name in names:
            renamed[name] = (
                name if prefix == _LM_HEAD else layout.canonical_base + name.removeprefix(base)
            )
    tensors = checkpoint.read(renamed, dtype=dtype)
    return {renamed[name]: tensor for name, tensor in tensors.items()}


def _layout_of(config: PreTrainedConfig) -> _Layout:
    layout = _LAYOUTS.get(config.model_type)
    if layout is None:
        raise CheckpointError(
            f"cannot load blocks of model_type {config.model_type!r}; "
            f"supported model types: {', '.join(sorted(_LAYOUTS))}"
        )
    return layout


@attrs.frozen(kw_only=True)
class _Checkpoint:
    """The safetensors files of a checkpoint: which file holds each tensor, and how to get it."""

    source: str  # for messages: "folder '/x'" or "repo 'a/b' at revision 'main'"
    weight_map: Mapping[str, str]  # tensor name -> file name
    fetch: Callable[[str], Path]  # file name -> local path (downloading it if needed)
    #: Around fetching and reading files: a repo's disk budget (HubRepo.loading).
    loading: Callable[[Collection[str]], AbstractContextManager[None]] = attrs.field(
        default=lambda files: contextlib.nullcontext()
    )

    @classmethod
    def open(cls, model_name_or_path: str | os.PathLike[str], access: HubAccess) -> _Checkpoint:
        if os.path.isdir(model_name_or_path):
            return cls._open_folder(Path(model_name_or_path))
        return cls._open_repo(os.fspath(model_name_or_path), access)

    @classmethod
    def _open_folder(cls, folder: Path) -> _Checkpoint:
        source = f"folder {os.fspath(folder)!r}"

        def fetch(filename: str) -> Path:
            if Path(filename).is_absolute() or ".." in Path(filename).parts:
                raise CheckpointError(f"{source}: the index names a file outside it: {filename!r}")
            return folder / filename

        if (folder / INDEX_FILE).is_file():
            weight_map = _weight_map_untrusted((folder / INDEX_FILE).read_bytes(), source)
        elif (folder / SINGLE_FILE).is_file():
            weight_map = _single_file_weight_map(folder / SINGLE_FILE, source)
        else:
            pickled = [name for name in _PICKLED_FILES if (folder / name).is_file()]
            raise _no_safetensors(source, pickled)
        return cls(source=source, weight_map=weight_map, fetch=fetch)

    @classmethod
    def _open_repo(cls, repo_id: str, access: HubAccess) -> _Checkpoint:
        repo = HubRepo.resolve(repo_id, access, what="repo")
        source, fetch = repo.source, repo.fetch
        # A sharded checkpoint has an index; a small one may be a single file. The cache remembers
        # that a file does not exist at a commit, which spares asking again.
        index_path = None
        if not repo.cached_as_absent(INDEX_FILE):
            index_path = _unless_absent(fetch, INDEX_FILE)
        if index_path is not None:
            return cls(
                source=source,
                weight_map=_weight_map_untrusted(index_path.read_bytes(), source),
                fetch=fetch,
                loading=repo.loading,
            )
        try:
            with repo.loading([SINGLE_FILE]):  # the disk budget applies to it too
                single_path = fetch(SINGLE_FILE)
        except CheckpointError as error:
            if isinstance(error.__cause__, LocalEntryNotFoundError):
                raise CheckpointError(
                    f"{source}: neither {INDEX_FILE} nor {SINGLE_FILE} is in the local cache, "
                    "and the Hub cannot be reached (offline mode, local_files_only, or a network "
                    "failure)"
                ) from error
            if isinstance(error.__cause__, RemoteEntryNotFoundError):
                raise _no_safetensors(source, repo.present(_PICKLED_FILES)) from None
            raise
        weight_map = _single_file_weight_map(single_path, source)
        return cls(source=source, weight_map=weight_map, fetch=fetch, loading=repo.loading)

    def read(self, names: Iterable[str], *, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Read these tensors, opening each file that holds some of them once."""
        names_in: dict[str, list[str]] = defaultdict(list)
        for name in names:
            names_in[self.weight_map[name]].append(name)
        tensors: dict[str, torch.Tensor] = {}
        with self.loading(names_in.keys()):
            for filename, file_names in sorted(names_in.items()):
                path = self.fetch(filename)
                with (
                    unreadable(f"{self.source}, file {filename!r}"),
                    safe_open(path, framework="pt") as file,
                ):
                    missing = set(file_names).difference(file.keys())
                    if missing:
                        raise CheckpointError(
                            f"{self.source}: the index places {sorted(missing)} in "
                            f"{filename!r}, which does not hold them"
                        )
                    for name in file_names:
                        tensor = file.get_tensor(name)
                        if dtype is not None and tensor.is_floating_point():
                            tensor = tensor.to(dtype)
                        tensors[name] = tensor
        return tensors


def _unless_absent(fetch: Callable[[str], Path], filename: str) -> Path | None:
    """``fetch(filename)``, or None if the repo lacks the file or (offline) the cache does."""
    try:
        return fetch(filename)
    except CheckpointError as error:
        if isinstance(error.__cause__, EntryNotFoundError):
            return None
        raise


def _weight_map_untrusted(index_bytes: bytes, source: str) -> dict[str, str]:
    """The ``weight_map`` of a shard index; anything malformed raises :class:`CheckpointError`."""
    try:
        index = json.loads(index_bytes)
    except ValueError as error:
        raise CheckpointError(f"{source}: {INDEX_FILE} is not valid JSON: {error}") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(filename, str) for name, filename in weight_map.items()
    ):
        raise CheckpointError(f"{source}: {INDEX_FILE} has no weight_map of names to files")
    return weight_map


def _single_file_weight_map(path: Path, source: str) -> dict[str, str]:
    with unreadable(f"{source}, file {SINGLE_FILE!r}"), safe_open(path, framework="pt") as file:
        return dict.fromkeys(file.keys(), SINGLE_FILE)


def _no_safetensors(source: str, pickled: list[str]) -> CheckpointError:
    if pickled:
        return CheckpointError(
            f"{source} holds only pickled PyTorch weights ({', '.join(pickled)}); petals_core "
            "loads safetensors checkpoints only, because unpickling runs arbitrary code. Convert "
            "it, e.g. with transformers: from_pretrained(...) then save_pretrained(folder)"
        )
    return CheckpointError(f"{source} has no safetensors weights ({INDEX_FILE} or {SINGLE_FILE})")
