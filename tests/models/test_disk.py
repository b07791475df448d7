"""A disk budget for a model's files in the Hugging Face cache (``--max_disk_space``): real
downloads from the local hub into a real cache, the least recently used shards deleted before a
download would pass the budget."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

import pytest

from petals_core import CheckpointError
from petals_core.models._config import AutoDistributedConfig, DistributedConfig
from petals_core.models._disk import (
    KEEP_FREE,
    LOCK_FILE,
    CachedWeights,
    make_room,
    plan_eviction,
    repo_lock,
)
from petals_core.models._loading import INDEX_FILE, load_blocks

from .conftest import Hub, TinyCheckpoint

REPO = "petals-test/llama-disk"
OTHER_REPO = "petals-test/llama-other"


def _shards_of(checkpoint: TinyCheckpoint, blocks: range) -> set[str]:
    return {
        filename
        for name, filename in checkpoint.weight_map().items()
        if any(name.startswith(f"model.layers.{index}.") for index in blocks)
    }


def _cached_weights(cache: Path, repo_id: str) -> set[str]:
    """The weight files of ``repo_id`` in its snapshot folders whose blobs exist."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    return {
        path.name
        for path in storage.glob("snapshots/*/*.safetensors")
        if path.exists()  # a snapshot link to a deleted blob does not
    }


def _blobs_nbytes(cache: Path, repo_id: str) -> int:
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    return sum(path.stat().st_size for path in (storage / "blobs").iterdir())


def _age(cache: Path, repo_id: str, filenames: set[str], seconds: float) -> None:
    """Make these files look last read ``seconds`` ago (their blobs' access times)."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    for path in storage.glob("snapshots/*/*"):
        if path.name in filenames:
            blob = path.resolve()
            os.utime(blob, (blob.stat().st_atime - seconds, blob.stat().st_mtime))


def _first_blocks_cached(
    hub: Hub, tiny_llama: TinyCheckpoint
) -> tuple[DistributedConfig, set[str]]:
    """Serve ``tiny_llama`` as REPO and load its first two blocks: its config, and the weight
    files that are cached then."""
    hub.server.serve(REPO, tiny_llama.folder)
    config = AutoDistributedConfig.from_pretrained(REPO, cache_dir=hub.cache_dir)
    load_blocks(REPO, range(0, 2), config=config, cache_dir=hub.cache_dir)
    return config, _cached_weights(hub.cache_dir, REPO)


def test_a_load_deletes_the_least_recently_used_shards_it_does_not_need(
    hub: Hub, tiny_llama: TinyCheckpoint, caplog: pytest.LogCaptureFixture
) -> None:
    hub.server.serve(REPO, tiny_llama.folder)
    hub.server.serve(OTHER_REPO, tiny_llama.folder)
    config = AutoDistributedConfig.from_pretrained(REPO, cache_dir=hub.cache_dir)
    first, second, third = range(0, 2), range(2, 4), range(4, 6)
    assert not _shards_of(tiny_llama, first) & _shards_of(tiny_llama, third)
    # Another repo's shards, older than any: never touched.
    load_blocks(OTHER_REPO, range(0, 6), config=config, cache_dir=hub.cache_dir)
    other = _cached_weights(hub.cache_dir, OTHER_REPO)
    _age(hub.cache_dir, OTHER_REPO, other, 10_000)

    load_blocks(REPO, first, config=config, cache_dir=hub.cache_dir, max_disk_space=10**9)
    load_blocks(REPO, second, config=config, cache_dir=hub.cache_dir, max_disk_space=10**9)
    _age(hub.cache_dir, REPO, _shards_of(tiny_llama, first), 2000)
    _age(hub.cache_dir, REPO, _shards_of(tiny_llama, second), 1000)
    held = _blobs_nbytes(hub.cache_dir, REPO)
    both = _shards_of(tiny_llama, first) | _shards_of(tiny_llama, second)
    assert _cached_weights(hub.cache_dir, REPO) == both

    # Room for the third span's shards within what the cache holds now: the first span's go
    # (read longest ago), as few as make room; the second's stay, and so do the index and
    # config.
    caplog.set_level(logging.INFO, logger="petals_core.models._disk")
    load_blocks(REPO, third, config=config, cache_dir=hub.cache_dir, max_disk_space=held)
    cached = _cached_weights(hub.cache_dir, REPO)
    assert _shards_of(tiny_llama, third) <= cached
    deleted = both - cached
    assert deleted and deleted <= _shards_of(tiny_llama, first) - _shards_of(tiny_llama, second)
    assert _shards_of(tiny_llama, second) <= cached
    assert _blobs_nbytes(hub.cache_dir, REPO) <= held
    assert "deleted" in caplog.text and "least recently used" in caplog.text
    storage = hub.cache_dir / f"models--{REPO.replace('/', '--')}"
    assert {path.name for path in storage.glob("snapshots/*/*")} >= {INDEX_FILE, "config.json"}
    assert _cached_weights(hub.cache_dir, OTHER_REPO) == other

    # Cached already: nothing to make room for, whatever the budget.
    hub.server.clear_log()
    load_blocks(REPO, third, config=config, cache_dir=hub.cache_dir, max_disk_space=1)
    assert not hub.server.count("GET", REPO)


def test_a_budget_the_load_cannot_fit_fails_clearly_and_keeps_its_shards(
    hub: Hub, tiny_llama: TinyCheckpoint
) -> None:
    config, before = _first_blocks_cached(hub, tiny_llama)
    with pytest.raises(CheckpointError, match="--max_disk_space") as caught:
        load_blocks(REPO, range(0, 6), config=config, cache_dir=hub.cache_dir, max_disk_space=1)
    assert "do not fit the budget, even if every other cached weight file" in str(caught.value)
    # Every cached shard was one this load needs: none was deleted.
    assert _cached_weights(hub.cache_dir, REPO) == before


def test_the_disk_keeps_its_share_free_whatever_the_budget() -> None:
    """The least recently read first, as few as make room: for the budget, or for the disk's
    free space when that is the tighter."""
    weights = [
        CachedWeights(
            name=f"{index}.safetensors",
            blob=Path(f"/blobs/{index}"),
            links=(),
            nbytes=100,
            last_access=float(access),
        )
        for index, access in enumerate([30, 10, 20, 40])
    ]

    def deleted(**figures: int) -> tuple[list[str], int]:
        chosen, short = plan_eviction(weights, **figures)
        return [file.name for file in chosen], short

    roomy = {"occupied": 400, "free": 10_000, "keep_free": 1_000}
    assert deleted(nbytes=100, budget=500, **roomy) == ([], 0)
    assert deleted(nbytes=150, budget=500, **roomy) == (["1.safetensors"], 50)
    assert deleted(nbytes=250, budget=500, **roomy) == (["1.safetensors", "2.safetensors"], 150)
    # The budget is generous, but the disk would keep less than its 1,000 bytes free.
    tight = {"occupied": 400, "free": 1_200, "keep_free": 1_000, "budget": 10**9}
    assert deleted(nbytes=250, **tight) == (["1.safetensors"], 50)
    assert deleted(nbytes=900, **tight)[0] == [f"{i}.safetensors" for i in (1, 2, 0, 3)]


def test_a_disk_too_full_for_the_load_fails_clearly_and_deletes_nothing(
    hub: Hub, tiny_llama: TinyCheckpoint
) -> None:
    _, before = _first_blocks_cached(hub, tiny_llama)
    free = shutil.disk_usage(hub.cache_dir).free
    assert KEEP_FREE == 2**30
    with (
        repo_lock(hub.cache_dir, REPO, exclusive=True),
        pytest.raises(CheckpointError, match="do not fit the disk"),
    ):
        make_room(REPO, hub.cache_dir, 1, budget=10**15, keep_free=free + 10**12)
    assert _cached_weights(hub.cache_dir, REPO) == before


def test_a_single_file_checkpoint_is_held_to_the_budget(
    hub: Hub, tiny_llama_single_file: TinyCheckpoint
) -> None:
    hub.server.serve(REPO, tiny_llama_single_file.folder)
    config = AutoDistributedConfig.from_pretrained(REPO, cache_dir=hub.cache_dir)
    with pytest.raises(CheckpointError, match="--max_disk_space"):
        load_blocks(REPO, range(0, 2), config=config, cache_dir=hub.cache_dir, max_disk_space=1)
    assert _cached_weights(hub.cache_dir, REPO) == set()  # not downloaded


def test_reading_shares_the_repo_lock_and_deleting_takes_it_alone(tmp_path: Path) -> None:
    """Loads reading a repo's files hold its lock shared, with or without a budget; making room
    holds it exclusively, so it waits for them (and they for it)."""
    lock = tmp_path / ".locks" / f"models--{REPO.replace('/', '--')}" / LOCK_FILE

    def try_lock(mode: int) -> bool:
        with lock.open("a") as other:  # another open file: as another process would
            try:
                fcntl.flock(other.fileno(), mode | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other.fileno(), fcntl.LOCK_UN)
            return True

    with repo_lock(tmp_path, REPO, exclusive=False):
        assert try_lock(fcntl.LOCK_SH) and not try_lock(fcntl.LOCK_EX)
    with repo_lock(tmp_path, REPO, exclusive=True):
        assert not try_lock(fcntl.LOCK_SH)
    assert try_lock(fcntl.LOCK_EX)
    # Another repo's lock is another file.
    with repo_lock(tmp_path, OTHER_REPO, exclusive=True):
        assert try_lock(fcntl.LOCK_EX)
