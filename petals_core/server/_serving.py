"""What the block RPC families (``_inference``, ``_training``) share: the parts they compute with
while the server serves, the counters behind :class:`BlockServerStatistics`, and the checks of
a request against the blocks this server holds."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import torch
import trio

from .._errors import CodecError, ServerError
from ..protocol import Receipt, ReceiptKind, Signature, digest_tensors
from ..transport import Identity, as_received
from ._backend import BlockBackend
from ._memory_cache import MemoryCache
from ._task_pool import TaskPool

if TYPE_CHECKING:
    from ._handler import ServingLimits

__all__ = ["COUNTERS", "Serving", "check_blocks_held"]

#: What :class:`BlockServerStatistics` counts (besides what is open now).
COUNTERS: Final = (
    "steps",
    "batched_steps",
    "pushed_steps",
    "stale_pushes",
    "refused_pushes",
    "push_streams",
    "push_dial_failures",
    "push_failures",
    "forwards",
    "backwards",
    "kept_backwards",
    "failures",
)
#: Tensors of more bytes than this are hashed for a receipt in a worker thread.
_HASH_INLINE_BYTES: Final = 1 << 20


class Serving:
    """The server's limits, its backend, task pool and cache once attached (until then every
    call is refused, see :meth:`parts`), and its counters."""

    def __init__(self, limits: ServingLimits) -> None:
        self.limits = limits
        self.backend: BlockBackend | None = None
        self.pool: TaskPool | None = None
        self.cache: MemoryCache | None = None
        self.refusing: str | None = "the server is still loading its blocks"
        #: Who signs the receipts of answers, and the model they name (see :meth:`sign_as`).
        self.signer: Identity | None = None
        self.model = ""
        self.torch_dtype = self.quant_type = ""
        self.counts = dict.fromkeys(COUNTERS, 0)
        #: Set (and dropped) at the next change; made by a waiter.
        self._changed: trio.Event | None = None

    def attach(self, backend: BlockBackend, pool: TaskPool, cache: MemoryCache) -> None:
        self.backend, self.pool, self.cache = backend, pool, cache
        self.refusing = None

    def detach(self, reason: str) -> None:
        self.refusing = reason
        self.backend = self.pool = self.cache = None

    def parts(self) -> tuple[BlockBackend, TaskPool, MemoryCache]:
        """What a call computes with; raises :class:`ServerError` while the server does not
        serve."""
        if self.refusing is not None or self.backend is None:
            raise ServerError(self.refusing or "the server is not serving")
        assert self.pool is not None and self.cache is not None
        return self.backend, self.pool, self.cache

    def sign_as(self, identity: Identity, model: str, *, torch_dtype: str, quant_type: str) -> None:
        self.signer, self.model = identity, model
        self.torch_dtype, self.quant_type = torch_dtype, quant_type

    async def signed(
        self,
        kind: ReceiptKind,
        blocks: tuple[int, int],
        adapter: str | None,
        asked: Mapping[str, torch.Tensor | None],
        answered: Mapping[str, torch.Tensor | None],
        *,
        session: str | None = None,
        padding: tuple[int, ...] | None = None,
        step: int | None = None,
        previous: bytes | None = None,
        with_asked: bool = False,
    ) -> tuple[Receipt, Signature] | None:
        """This answer's receipt and its signature (None until :meth:`sign_as`).  ``answered`` as
        the client will decode it (after this server's compression); large tensors are hashed
        off the event loop."""
        if self.signer is None:
            return None
        scheme = self.limits.compression
        sent = {name: None if t is None else as_received(t, scheme) for name, t in answered.items()}

        def digests() -> tuple[bytes, bytes]:
            return digest_tensors(asked), digest_tensors(sent)

        nbytes = sum(
            t.numel() * t.element_size() for t in (*asked.values(), *sent.values()) if t is not None
        )
        if nbytes > _HASH_INLINE_BYTES:
            asked_digest, answered_digest = await trio.to_thread.run_sync(digests)
        else:
            asked_digest, answered_digest = digests()
        receipt = Receipt(
            kind=kind,
            model=self.model,
            blocks=blocks,
            adapter=adapter,
            session=session,
            padding=padding,
            step=step,
            previous=previous,
            compression=scheme,
            torch_dtype=self.torch_dtype,
            quant_type=self.quant_type,
            issued=int(time.time()),
            asked=asked_digest,
            answered=answered_digest,
        )
        return receipt, receipt.sign(self.signer, with_asked=with_asked)

    def count(self, name: str) -> None:
        self.counts[name] += 1
        self.changed()

    def changed(self) -> None:
        """A count, or what else the statistics show, changed: wake :meth:`wait_changed`."""
        # An event only while someone waits: counting sits on every step's path.
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def wait_changed(self) -> None:
        """Until the next :meth:`changed`."""
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()


def check_blocks_held(blocks: tuple[int, int], backend: BlockBackend) -> tuple[int, int]:
    """``blocks`` as ``(start, end)`` if this server holds all of them; else :class:`CodecError`."""
    start, end = blocks
    if not backend.start <= start < end <= backend.end:
        raise CodecError(
            f"blocks [{start}, {end}) are not inside the blocks this server holds, "
            f"[{backend.start}, {backend.end})"
        )
    return start, end
