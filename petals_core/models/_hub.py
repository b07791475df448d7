"""Files of Hub repos for checkpoints and adapters, and their failures as :class:`CheckpointError`.

A :class:`HubRepo` resolves its revision to a commit once (``HfApi.resolve_revision``); every file
then comes from that commit through ``hf_hub_download``, with its cache, its offline mode
(``HF_HUB_OFFLINE``, ``local_files_only``) and its endpoint (``HF_ENDPOINT``).  With a disk budget
(``max_disk_space``), a load makes room for the files it lacks first (:mod:`._disk`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

import attrs
from huggingface_hub import (
    _CACHED_NO_EXIST,
    HfApi,
    ResolvedRevision,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    is_offline_mode,
    try_to_load_from_cache,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    RevisionResolutionError,
)
from safetensors import SafetensorError

from .._errors import CheckpointError
from ._disk import make_room, repo_lock

__all__ = ["HubAccess", "HubRepo", "hub_errors", "unreadable"]


@attrs.frozen(kw_only=True)
class HubAccess:
    """How to get a repo's files, as ``hf_hub_download`` takes it: the revision (None: the main
    branch), the token, the cache folder, and whether to use the local cache only; and the most
    bytes the repo's files may take in the cache (None: no limit, nothing deleted)."""

    revision: str | None = None
    token: str | bool | None = None
    cache_dir: str | os.PathLike[str] | None = None
    local_files_only: bool = False
    max_disk_space: int | None = None


@attrs.frozen(kw_only=True)
class HubRepo:
    """A Hub repo's files at one commit; build it with :meth:`resolve`."""

    repo_id: str
    source: str  # for messages: "repo 'a/b' at revision 'main'"
    revision: ResolvedRevision
    cache_dir: Path | None
    token: str | bool | None
    #: Files come from the local cache only.
    offline: bool
    max_disk_space: int | None = None

    @classmethod
    def resolve(cls, repo_id: str, access: HubAccess, *, what: str) -> HubRepo:
        """``what`` names the repo in messages (e.g. "adapter repo")."""
        revision, token, cache_dir = access.revision, access.token, access.cache_dir
        source = f"{what} {repo_id!r} at revision {revision or 'main'!r}"
        cache = None if cache_dir is None else Path(cache_dir)
        offline = access.local_files_only or is_offline_mode()
        with hub_errors(source):
            # Pins every file of this repo to one commit, and lets cached files skip the Hub.
            resolved = HfApi().resolve_revision(
                repo_id, revision=revision, cache_dir=cache, local_files_only=offline, token=token
            )
        return cls(
            repo_id=repo_id,
            source=source,
            revision=resolved,
            cache_dir=cache,
            token=token,
            offline=offline,
            max_disk_space=access.max_disk_space,
        )

    def fetch(self, filename: str) -> Path:
        """The local path of ``filename``, downloaded if it is not cached yet."""
        with hub_errors(f"{self.source}, file {filename!r}"):
            path = hf_hub_download(
                self.repo_id,
                filename,
                revision=self.revision,
                cache_dir=self.cache_dir,
                token=self.token,
                local_files_only=self.offline,
            )
        return Path(str(path))

    @contextlib.contextmanager
    def loading(self, filenames: Collection[str]) -> Iterator[None]:
        """While ``filenames`` are fetched and read, hold the repo's lock in the cache, shared:
        no load deletes them meanwhile.  With a disk budget, first (holding the lock
        exclusively) make room for those not cached yet, their sizes asked of the Hub, by
        deleting the repo's least recently used weight files, never these."""
        folder = self.cache_dir or Path(constants.HF_HUB_CACHE)
        if self.max_disk_space is not None and not self.offline:
            with repo_lock(folder, self.repo_id, exclusive=True):
                missing = [name for name in filenames if not self._cached(name)]
                if missing:
                    with hub_errors(self.source):
                        nbytes = sum(
                            get_hf_file_metadata(
                                hf_hub_url(self.repo_id, name, revision=self.revision.resolved),
                                token=self.token,
                            ).size
                            or 0
                            for name in missing
                        )
                    make_room(
                        self.repo_id,
                        folder,
                        nbytes,
                        budget=self.max_disk_space,
                        keep=frozenset(filenames),
                    )
        with repo_lock(folder, self.repo_id, exclusive=False):
            yield

    def _cached(self, filename: str) -> bool:
        cached = try_to_load_from_cache(
            self.repo_id, filename, cache_dir=self.cache_dir, revision=self.revision.resolved
        )
        return isinstance(cached, str)

    def cached_as_absent(self, filename: str) -> bool:
        """Whether the cache remembers that the commit lacks ``filename``."""
        cached = try_to_load_from_cache(
            self.repo_id, filename, cache_dir=self.cache_dir, revision=self.revision.resolved
        )
        return cached is _CACHED_NO_EXIST

    def present(self, filenames: Iterable[str]) -> list[str]:
        """Which of ``filenames`` the commit holds, asking the Hub (none when offline)."""
        if self.offline:
            return []
        api = HfApi()
        with hub_errors(self.source):
            return [
                name
                for name in filenames
                if api.file_exists(
                    self.repo_id, name, revision=self.revision.resolved, token=self.token
                )
            ]


@contextlib.contextmanager
def unreadable(what: str) -> Iterator[None]:
    """A file that is not safetensors (or is cut short) raises :class:`CheckpointError`."""
    try:
        yield
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{what} cannot be read: {error}") from error


@contextlib.contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Translate huggingface_hub's failures into :class:`CheckpointError`, chained."""
    try:
        yield
    except (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RevisionResolutionError,
    ) as error:
        raise CheckpointError(f"{what}: {_hub_failure(error)}") from error


def _hub_failure(error: Exception) -> str:
    unreachable = "the Hub cannot be reached (offline mode, local_files_only, or a network failure)"
    if isinstance(error, RepositoryNotFoundError):  # also gated repos without a token
        return "no such repo on the Hub, or it is private or gated and needs a token"
    if isinstance(error, RevisionNotFoundError):
        return "no such revision in the repo"
    if isinstance(error, RemoteEntryNotFoundError):
        return "no such file in the repo"
    if isinstance(error, LocalEntryNotFoundError):
        return f"not in the local cache, and {unreachable}"
    if isinstance(error, RevisionResolutionError | OfflineModeIsEnabled):
        return f"the revision is not in the local cache, and {unreachable}"
    if isinstance(error, HFValidationError):
        return f"neither a local folder nor a valid repo id ({error})"
    lines = [line for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:2]) or type(error).__name__
