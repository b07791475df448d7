"""Tiny checkpoints and a local stand-in for the Hugging Face Hub, shared by the model tests.

The checkpoints are real: transformers models with random (seeded) weights, saved with
``save_pretrained`` into several safetensors shards. The hub is a stdlib HTTP server on 127.0.0.1
that serves folders as model repos through the routes huggingface_hub calls, and logs every request
so that tests can prove which files were downloaded.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import re
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import attrs
import pytest
import torch
from huggingface_hub import constants, split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from transformers import (
    BloomForCausalLM,
    FalconForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from petals_core.testing import (
    tiny_bloom_config,
    tiny_falcon_config,
    tiny_llama_config,
    tiny_mixtral_config,
)

# The tiny LLaMA's sizes, for tests that build inputs for it.
LAYERS = tiny_llama_config().num_hidden_layers
HIDDEN = tiny_llama_config().hidden_size
# About one block per shard: every block, and the embeddings, can be told apart by shard.
SHARD_SIZE = "100KB"


@attrs.frozen(kw_only=True)
class TinyCheckpoint:
    """A saved checkpoint and the tensors it was saved from (transformers' names)."""

    folder: Path
    state_dict: dict[str, torch.Tensor]

    def weight_map(self) -> dict[str, str]:
        index = json.loads((self.folder / "model.safetensors.index.json").read_text())
        weight_map: dict[str, str] = index["weight_map"]
        return weight_map

    def shards_holding(self, prefixes: tuple[str, ...]) -> set[str]:
        """The shard files holding tensors whose stored names start with one of ``prefixes``."""
        return {
            filename for name, filename in self.weight_map().items() if name.startswith(prefixes)
        }


def _save(model: PreTrainedModel, folder: Path, *, max_shard_size: str) -> TinyCheckpoint:
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    state_dict = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return TinyCheckpoint(folder=folder, state_dict=state_dict)


def _sharded(
    model_class: type[PreTrainedModel], config: PretrainedConfig, folder: Path, *, seed: int
) -> TinyCheckpoint:
    """A model of ``config`` with weights drawn after ``manual_seed(seed)``, in several shards."""
    torch.manual_seed(seed)
    checkpoint = _save(model_class(config), folder, max_shard_size=SHARD_SIZE)
    assert len(set(checkpoint.weight_map().values())) >= 3
    return checkpoint


@pytest.fixture
def llama_config() -> LlamaConfig:
    config = tiny_llama_config()
    assert config.num_key_value_heads == 2 < config.num_attention_heads  # GQA
    return config


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A 6-block LLaMA with an untied LM head, in several shards."""
    folder = tmp_path_factory.mktemp("llama-tiny")
    return _sharded(LlamaForCausalLM, tiny_llama_config(), folder, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_single_file(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A 6-block LLaMA with tied embeddings, in one ``model.safetensors``."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=True))
    checkpoint = _save(model, tmp_path_factory.mktemp("llama-single"), max_shard_size="1GB")
    assert (checkpoint.folder / "model.safetensors").is_file()
    return checkpoint


@pytest.fixture(scope="session")
def tiny_bloom(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A 6-block BLOOM as ``save_pretrained`` writes it (``transformer.h.N.*``), in shards."""
    folder = tmp_path_factory.mktemp("bloom-tiny")
    checkpoint = _sharded(BloomForCausalLM, tiny_bloom_config(), folder, seed=2)
    assert all(name.startswith("transformer.") for name in checkpoint.weight_map())
    return checkpoint


@pytest.fixture(scope="session")
def tiny_falcon(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A 6-block Falcon (new decoder architecture) with an untied LM head, in shards."""
    folder = tmp_path_factory.mktemp("falcon-tiny")
    config = tiny_falcon_config(tie_word_embeddings=False)
    return _sharded(FalconForCausalLM, config, folder, seed=3)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoint:
    """A 6-block Mixtral (8 experts) as transformers saves it (the original checkpoints' names:
    ``block_sparse_moe.experts.E.w1``), in shards."""
    folder = tmp_path_factory.mktemp("mixtral-tiny")
    checkpoint = _sharded(MixtralForCausalLM, tiny_mixtral_config(), folder, seed=4)
    # transformers holds the experts fused in memory: the stored tensors are the reference.
    stored: dict[str, torch.Tensor] = {}
    for shard in sorted(set(checkpoint.weight_map().values())):
        stored.update(load_file(folder / shard))
    return TinyCheckpoint(folder=folder, state_dict=stored)


@pytest.fixture(scope="session")
def tiny_bloom_bigscience(
    tiny_bloom: TinyCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> TinyCheckpoint:
    """The same BLOOM stored as the bigscience repos store it: ``h.N.*``, no ``transformer.``."""
    folder = tmp_path_factory.mktemp("bloom-bigscience")
    stored = {
        name.removeprefix("transformer."): tensor.contiguous()
        for name, tensor in tiny_bloom.state_dict.items()
        if name != "lm_head.weight"  # tied to the embeddings, as in bigscience/bloom
    }
    split = split_torch_state_dict_into_shards(
        stored, filename_pattern="model{suffix}.safetensors", max_shard_size=SHARD_SIZE
    )
    for filename, names in split.filename_to_tensors.items():
        save_file({name: stored[name] for name in names}, folder / filename, {"format": "pt"})
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy(tiny_bloom.folder / "config.json", folder / "config.json")
    checkpoint = TinyCheckpoint(folder=folder, state_dict=tiny_bloom.state_dict)
    assert len(set(checkpoint.weight_map().values())) >= 3
    assert not any(name.startswith("transformer.") for name in checkpoint.weight_map())
    return checkpoint


# --- the local hub ---------------------------------------------------------------------------


@attrs.frozen
class HubRequest:
    method: str
    path: str  # unquoted, without the query


@attrs.frozen(kw_only=True)
class _Repo:
    commit: str
    files: dict[str, Path]
    etags: dict[str, str]


_API_ROUTE = re.compile(r"/api/models/(?P<repo>.+?)(?:/revision/(?P<revision>[^/]+))?")
_RESOLVE_ROUTE = re.compile(r"/(?P<repo>.+?)/resolve/(?P<revision>[^/]+)/(?P<filename>.+)")


class LocalHub:
    """Serves folders as model repos on 127.0.0.1, as the Hub's API and ``resolve`` routes do.

    Routes (what huggingface_hub 1.x/2.x calls for ``hf_hub_download`` and revision lookups):

    - ``GET /api/models/{repo}[/revision/{rev}]``: ``{"id", "sha", "siblings"}``;
    - ``HEAD|GET /{repo}/resolve/{rev}/{filename}``: the file, with ``X-Repo-Commit``, ``ETag``
      (its sha256), ``X-Linked-Etag``, ``X-Linked-Size`` and ``Content-Length``.

    Errors carry the ``X-Error-Code`` the Hub sends (``RepoNotFound``, ``RevisionNotFound``,
    ``EntryNotFound``), so huggingface_hub raises its usual exceptions. A revision is ``main`` or
    the repo's commit, a hash of its files. Range requests are answered with the whole file (200),
    which huggingface_hub accepts.
    """

    def __init__(self) -> None:
        self._repos: dict[str, _Repo] = {}
        self._lock = threading.Lock()
        self._log: list[HubRequest] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def serve(self, repo_id: str, folder: Path) -> str:
        """Serve ``folder`` as model repo ``repo_id``; returns the repo's commit hash."""
        files = {
            path.relative_to(folder).as_posix(): path
            for path in sorted(folder.rglob("*"))
            if path.is_file()
        }
        etags = {
            name: hashlib.sha256(path.read_bytes()).hexdigest() for name, path in files.items()
        }
        commit = hashlib.sha1(json.dumps(etags, sort_keys=True).encode()).hexdigest()
        with self._lock:
            self._repos[repo_id] = _Repo(commit=commit, files=files, etags=etags)
        return commit

    @property
    def requests(self) -> list[HubRequest]:
        with self._lock:
            return list(self._log)

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    def count(self, method: str, repo_id: str) -> Counter[str]:
        """How many ``method`` requests each file of ``repo_id`` got on the resolve route."""
        counts: Counter[str] = Counter()
        for request in self.requests:
            match = _RESOLVE_ROUTE.fullmatch(request.path)
            if request.method == method and match and match["repo"] == repo_id:
                counts[match["filename"]] += 1
        return counts

    def api_calls(self) -> list[str]:
        return [request.path for request in self.requests if request.path.startswith("/api/")]

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 10  # seconds a connection may idle: nothing outlives a stuck client long

            def do_GET(self) -> None:
                hub._answer(self, head=False)

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler

    def _answer(self, handler: http.server.BaseHTTPRequestHandler, *, head: bool) -> None:
        raw_path = urlsplit(handler.path).path
        with self._lock:
            self._log.append(HubRequest(handler.command, unquote(raw_path)))
            repos = dict(self._repos)
        if api := _API_ROUTE.fullmatch(raw_path):
            repo = repos.get(unquote(api["repo"]))
            revision = unquote(api["revision"] or "main")
            if repo is None:
                return _error(handler, 404, "RepoNotFound")
            if revision not in ("main", repo.commit):
                return _error(handler, 404, "RevisionNotFound")
            body = json.dumps(
                {
                    "id": unquote(api["repo"]),
                    "sha": repo.commit,
                    "siblings": [{"rfilename": name} for name in repo.files],
                }
            ).encode()
            handler.send_response(200)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            if not head:
                handler.wfile.write(body)
            return None
        if resolve := _RESOLVE_ROUTE.fullmatch(raw_path):
            repo = repos.get(unquote(resolve["repo"]))
            revision = unquote(resolve["revision"])
            filename = unquote(resolve["filename"])
            if repo is None:
                return _error(handler, 404, "RepoNotFound")
            if revision not in ("main", repo.commit):
                return _error(handler, 404, "RevisionNotFound")
            if filename not in repo.files:
                return _error(handler, 404, "EntryNotFound", commit=repo.commit)
            path = repo.files[filename]
            size = path.stat().st_size
            handler.send_response(200)
            handler.send_header("Content-Type", "application/octet-stream")
            handler.send_header("Content-Length", str(size))
            handler.send_header("ETag", f'"{repo.etags[filename]}"')
            handler.send_header("X-Linked-Etag", f'"{repo.etags[filename]}"')
            handler.send_header("X-Linked-Size", str(size))
            handler.send_header("X-Repo-Commit", repo.commit)
            handler.end_headers()
            if not head:
                with path.open("rb") as file:
                    shutil.copyfileobj(file, handler.wfile)
            return None
        return _error(handler, 404, "NotFound")


def _error(
    handler: http.server.BaseHTTPRequestHandler, status: int, code: str, *, commit: str = ""
) -> None:
    body = json.dumps({"error": code}).encode()
    handler.send_response(status)
    handler.send_header("X-Error-Code", code)
    if commit:
        handler.send_header("X-Repo-Commit", commit)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


@pytest.fixture(scope="session")
def local_hub() -> Iterator[LocalHub]:
    hub = LocalHub()
    hub.start()
    try:
        yield hub
    finally:
        hub.close()


@attrs.frozen(kw_only=True)
class Hub:
    """The local hub as one test sees it: huggingface_hub points at it, with an empty cache."""

    server: LocalHub
    cache_dir: Path
    monkeypatch: pytest.MonkeyPatch

    def go_offline(self) -> None:
        """What ``HF_HUB_OFFLINE=1`` does, for a library that read its environment at import."""
        self.monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        self.monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def hub(local_hub: LocalHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Hub:
    """Point huggingface_hub (and transformers) at the local hub, with a fresh cache.

    huggingface_hub reads ``HF_ENDPOINT``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` into
    ``huggingface_hub.constants`` when imported, so the environment variables are set for
    subprocesses and the constants patched for this process. Newer transformers releases keep one
    ``HfApi`` (``transformers.utils.hub.hf_api()``, with the endpoint of its creation time): it is
    pointed at the local hub too.
    """
    import transformers.utils.hub

    cache_dir = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", local_hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", local_hub.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        local_hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(cache_dir))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache_dir))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    shared_api = getattr(transformers.utils.hub, "hf_api", None)
    if shared_api is not None:
        monkeypatch.setattr(shared_api(), "endpoint", local_hub.url)
    local_hub.clear_log()
    return Hub(server=local_hub, cache_dir=cache_dir, monkeypatch=monkeypatch)
