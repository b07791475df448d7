"""A model's files in the Hugging Face cache under a disk budget (a server's ``--max_disk_space``).

Before a load downloads the weight files it lacks, :func:`make_room` counts what the model's
files in the cache take (every cached revision of the repo, as huggingface_hub's cache scan
reports them) and, if the download would take them past the budget or leave the disk with less
than ``keep_free`` bytes, deletes the model's least recently used weight files (safetensors and
``.bin`` shards, by last access) until it fits.  It never deletes a file the load needs, another
repo's file, or a file that is not weights (configs, indexes, tokenizers).

:func:`repo_lock` (``flock`` on a file per repo) is shared while a load reads the repo's files,
whether or not it has a budget, and exclusive while one deletes: a server never deletes a shard
another is reading.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
from collections.abc import Collection, Iterator
from pathlib import Path

import attrs
from huggingface_hub import scan_cache_dir
from huggingface_hub.errors import CacheNotFound

from .._errors import CheckpointError

__all__ = ["KEEP_FREE", "CachedWeights", "Eviction", "make_room", "plan_eviction", "repo_lock"]

log = logging.getLogger(__name__)

#: What the disk keeps free whatever the budget, for the system and other programs.
KEEP_FREE = 2**30
#: The files a load reads: only these are ever deleted.
WEIGHT_SUFFIXES = (".safetensors", ".bin")
#: The lock file of a repo's files, in huggingface_hub's folder of per-repo locks.
LOCK_FILE = "petals_core.lock"


@attrs.frozen(kw_only=True)
class Eviction:
    """What :func:`make_room` found and did: the model's bytes in the cache before, the room it
    needed beyond what was free, and the files it deleted (names, bytes freed)."""

    occupied: int
    short: int
    deleted: tuple[str, ...]
    freed: int


@contextlib.contextmanager
def repo_lock(folder: Path, repo_id: str, *, exclusive: bool) -> Iterator[None]:
    """Hold the lock of ``repo_id``'s files in the cache ``folder``, across processes: shared
    while a load reads them, exclusive while :func:`make_room` may delete some.  A cache this
    process cannot write to (a read-only one) is read without a lock."""
    path = folder / ".locks" / f"models--{repo_id.replace('/', '--')}" / LOCK_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = path.open("a")
    except OSError as error:
        log.debug("reading %s without a lock: %s", folder, error)
        yield
        return
    with lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


@attrs.frozen(kw_only=True)
class CachedWeights:
    """A weight file of the model in the cache: its blob, the snapshot links to it, its size and
    when it was last read."""

    name: str
    blob: Path
    links: tuple[Path, ...]
    nbytes: int
    last_access: float


def plan_eviction(
    weights: Collection[CachedWeights],
    *,
    occupied: int,
    free: int,
    nbytes: int,
    budget: int,
    keep_free: int,
) -> tuple[list[CachedWeights], int]:
    """Which of ``weights`` (the deletable ones) to delete, least recently read first and as
    few as make room, so that ``nbytes`` more fit within ``budget`` (the model's files take
    ``occupied`` now) and leave ``keep_free`` of the disk's ``free`` bytes; and how many bytes
    were short (0: nothing to delete)."""
    short = nbytes - min(free - keep_free, budget - occupied)
    if short <= 0:
        return [], 0
    chosen = []
    freed = 0
    for file in sorted(weights, key=lambda file: file.last_access):
        if freed >= short:
            break
        chosen.append(file)
        freed += file.nbytes
    return chosen, short


def make_room(
    repo_id: str,
    folder: Path,
    nbytes: int,
    *,
    budget: int,
    keep: Collection[str] = (),
    keep_free: int = KEEP_FREE,
) -> Eviction:
    """Delete the least recently used weight files of ``repo_id`` cached in ``folder`` until
    ``nbytes`` more fit: within ``budget`` bytes for the model's files, and leaving ``keep_free``
    bytes free on the disk (:func:`plan_eviction`).  Files named in ``keep`` (a load's own)
    stay.  Call it holding the repo's lock, exclusive (:func:`repo_lock`).

    Raises :class:`CheckpointError`, deleting nothing, when deleting every file it may would not
    make enough room.
    """
    try:
        repos = [
            repo
            for repo in scan_cache_dir(folder).repos
            if repo.repo_type == "model" and repo.repo_id == repo_id
        ]
    except CacheNotFound:
        repos = []
    occupied = sum(repo.size_on_disk for repo in repos)
    free = shutil.disk_usage(folder if folder.exists() else Path.home()).free
    # One entry per blob: revisions share the blobs of the files they have in common.
    blobs: dict[Path, CachedWeights] = {}
    kept: set[Path] = set()
    for repo in repos:
        for revision in repo.revisions:
            for file in revision.files:
                if file.file_name in keep:
                    kept.add(file.blob_path)
                if not file.file_name.endswith(WEIGHT_SUFFIXES):
                    continue
                known = blobs.get(file.blob_path)
                blobs[file.blob_path] = CachedWeights(
                    name=file.file_name,
                    blob=file.blob_path,
                    links=(*(known.links if known else ()), file.file_path),
                    nbytes=file.size_on_disk,
                    last_access=file.blob_last_accessed,
                )
    deletable = [file for blob, file in blobs.items() if blob not in kept]
    chosen, short = plan_eviction(
        deletable, occupied=occupied, free=free, nbytes=nbytes, budget=budget, keep_free=keep_free
    )
    freed = sum(file.nbytes for file in chosen)
    if freed < short:  # nothing is deleted for a load that would not fit anyway
        disk = free - keep_free < budget - occupied
        raise CheckpointError(
            f"{repo_id}: the {nbytes} bytes of weights this load downloads do not fit "
            f"{'the disk' if disk else 'the budget'}, even if every other cached weight file "
            f"of the model ({freed} bytes) were deleted: its files take {occupied} bytes of the "
            f"{budget} of --max_disk_space, and the disk has {free} bytes free, {keep_free} of "
            "which it keeps free; raise --max_disk_space, free space on the disk, or serve "
            "fewer blocks"
        )
    for weights in chosen:
        for link in weights.links:
            if link != weights.blob:
                link.unlink(missing_ok=True)
        weights.blob.unlink(missing_ok=True)
    if chosen:
        log.info(
            "made room for %d bytes of %s: deleted %d least recently used weight files (%d "
            "bytes: %s)",
            nbytes,
            repo_id,
            len(chosen),
            freed,
            ", ".join(file.name for file in chosen),
        )
    return Eviction(
        occupied=occupied, short=max(short, 0), deleted=tuple(f.name for f in chosen), freed=freed
    )
