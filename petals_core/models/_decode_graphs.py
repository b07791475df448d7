"""Decode steps of a span of blocks for many sessions at once, replayed from CUDA graphs.

On a GPU a decode step is a few hundred small kernels, and launching them from Python costs far
more than running them.  :class:`DecodeGraphs` captures a span's whole step once per shape bucket
and replays it with one launch:

- **Rows.**  Every session contributes its batch rows; the rows of all sessions in a step run
  together (each weight read once for all of them), padded up to a *rows bucket* (1, 2, 4, ...,
  ``max_rows``).  Padding rows compute on zeros and write into a scratch cache.
- **Row tables.**  The step reads each row's position and the addresses of its caches from
  device tables (:mod:`petals_core.kernels._triton_rows`), refilled before every replay.  So a
  graph holds no session's cache: it serves any sessions at any positions, and nothing about a
  graph changes when a session ends.
- **Length buckets.**  Attention splits each row's keys across parallel programs; how many is
  fixed per graph by a *length bucket* (a power of two, at least ``min_length_bucket``) above
  every row's length.
- **Graphs.**  One per (sub-span, active adapter, rows bucket, length bucket), made on first use
  (a warm-up run on scratch rows compiles the kernels, then the capture), kept in LRU order up to
  ``max_graphs``, all sharing one memory pool: only one replays at a time, and each copies its
  output out before the next.

- **One forward.**  A step is the blocks' own ``forward``, attending through
  :class:`RowCaches` (the row tables as an :class:`~petals_core.models.AttentionCache`) instead of
  a session's :class:`KVCache`: there is no second copy of any family's block.  Mixtral's experts
  then run on every row, weighted by zero where a row did not choose them (nothing may wait for
  the device in a graph), so its steps take this path only from as many rows as make the experts
  chosen number the experts there are (4 rows for 2 of 8): below, the eager path reads fewer
  weights.

What does not fit (several new tokens, left padding, deep prompts, rows beyond ``max_rows`` in
one session, length-dependent "dynamic" rotary scaling, Falcon's ALiBi, positions past a
sliding window, int8 layers whose outlier handling synchronises with the host) is left to the
caller's eager path: :meth:`step` returns None for it before touching anything.  So does a step
that fails (a kernel that does not compile or launch, a capture that fails): it changes no cache,
and the graphs go off for good, saying why (``disabled_reason``, logged once).  A server keeps
serving without its fast path rather than dying of it.

Without ``capture`` (how the CPU tests run it, through Triton's interpreter) the same step runs
eagerly on the same static buffers, so everything but the capture itself is exercised anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, cast

import attrs
import torch
from torch import nn

from .. import kernels
from .._errors import ConfigError
from ._cache import KVCache
from ._families import Block
from ._lora import active_adapter
from ._row_caches import (
    FIRST_POINTER,
    HEAD_STRIDES,
    POSITIONS,
    RotaryTables,
    RowCaches,
    bucket,
    row_tables,
)
from .bloom import BloomBlock
from .falcon import FalconBlock
from .llama import LlamaBlock
from .mixtral import MixtralBlock

__all__ = ["DecodeGraphs", "DecodeGraphsConfig", "DecodeGraphsStatistics"]

log = logging.getLogger(__name__)

#: The blocks whose decode steps are captured.
GraphBlock = LlamaBlock | BloomBlock | FalconBlock | MixtralBlock

#: Smallest rotary table (positions); it grows by doubling.
_MIN_ROTARYPOSITIONS = 4096


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name} must be an int >= 1, not {value!r}")


@attrs.frozen(kw_only=True)
class DecodeGraphsConfig:
    """``max_rows``: most rows (sum of the sessions' batches) one replay computes; larger steps
    run as several replays.  ``max_graphs``: graphs kept (least recently used dropped first).
    ``min_length_bucket``: the smallest length bucket, in positions.

    ``ahead_max_length``: when set, :meth:`DecodeGraphs.capture_ahead` (which a server calls at
    load) makes the whole span's graph for every rows bucket and every length bucket up to this
    many positions (a server's longest session), within ``max_graphs`` and as long as the graphs'
    memory pool has grown by less than ``ahead_pool_bytes``."""

    max_rows: int = attrs.field(default=64, validator=_positive)
    max_graphs: int = attrs.field(default=64, validator=_positive)
    min_length_bucket: int = attrs.field(default=256, validator=_positive)
    ahead_max_length: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    ahead_pool_bytes: int = attrs.field(default=512 * 2**20, validator=_positive)


@attrs.frozen(kw_only=True)
class DecodeGraphsStatistics:
    """``graphs``: held now; ``captured`` / ``evicted``: since creation; ``replays``: steps run
    (a step of more than ``max_rows`` rows counts once per replay); ``declined``: steps left to
    the eager path; ``failures``: steps that raised (a kernel that would not compile or launch,
    a capture that failed: the step went to the eager path, and so do all later ones);
    ``pool_bytes``: what the captures added to the device's reserved memory."""

    graphs: int
    captured: int
    evicted: int
    replays: int
    declined: int
    failures: int
    pool_bytes: int


def _unsupported_reason(blocks: Sequence[nn.Module]) -> str | None:
    """Why these blocks cannot take the row-table decode step (None if they can)."""
    if not blocks:
        return "no blocks"
    kinds = {type(block) for block in blocks}
    if kinds not in ({LlamaBlock}, {BloomBlock}, {FalconBlock}, {MixtralBlock}):
        return (
            "only spans of one of LlamaBlock, BloomBlock, FalconBlock and MixtralBlock, not "
            f"{sorted(k.__name__ for k in kinds)}"
        )
    first = blocks[0]
    assert isinstance(first, GraphBlock)
    weight = first.norm_weight
    if weight.device.type == "cuda" and weight.dtype not in kernels.CUDA_ATTENTION_DTYPES:
        return f"the row kernels take fp16 and bf16 on GPUs, not {weight.dtype}"
    if isinstance(first, FalconBlock | LlamaBlock):
        reason = _rotary_reason(blocks)
        if reason is not None:
            return reason
    for block in blocks:
        for module in block.modules():
            if type(module).__name__ == "Linear8bitLt":
                return "int8 layers synchronise with the host (outlier detection)"
    return None


def _rotary_reason(blocks: Sequence[nn.Module]) -> str | None:
    """Why a span of rotary blocks (one kind) cannot take the rotary row step."""
    rotaries = [getattr(block, "rotary", None) for block in blocks]
    first = rotaries[0]
    if first is None:
        return "Falcon's ALiBi (rounded in bfloat16) has no row-table kernel"
    if first.rope_type == "dynamic":
        return "dynamic NTK rotary scaling depends on the length"
    if not all(rotary is not None and rotary.same_angles(first) for rotary in rotaries):
        return "the blocks' rotary frequencies differ"
    block = blocks[0]
    assert isinstance(block, FalconBlock | LlamaBlock)
    attn = block.self_attention if isinstance(block, FalconBlock) else block.self_attn
    if attn.head_dim % 2:
        return "rotary needs an even head_dim"
    if attn.n_head // attn.n_kv_head > 128:
        return "more than 128 query heads per key/value head"
    return None


class _Session:
    """What a session contributes to the tables, computed once: its caches' row pointers."""

    __slots__ = ("batch", "cache_ids", "head_stride", "pointers")

    def __init__(self, caches: Sequence[KVCache], batch: int, pointers: torch.Tensor) -> None:
        self.cache_ids = tuple(id(cache) for cache in caches)
        self.batch = batch
        self.head_stride = caches[0].keys.stride(1)
        self.pointers = pointers  # (2 * len(caches), batch) int64: keys, values per block


class _Graph:
    """A captured step (``graph`` None: run eagerly) and its output buffer."""

    __slots__ = ("graph", "output", "run")

    def __init__(
        self,
        run: Callable[[], torch.Tensor],
        graph: torch.cuda.CUDAGraph | None,
        output: torch.Tensor | None,
    ) -> None:
        self.run = run
        self.graph = graph
        self.output = output

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            return self.run()
        self.graph.replay()
        assert self.output is not None
        return self.output


class DecodeGraphs:
    """Row-table decode steps over ``blocks`` (a server's span), captured as CUDA graphs when
    ``capture`` (default: on CUDA devices).

    Not thread-safe: one step at a time (a server runs its inference steps one batch at a time).
    """

    @staticmethod
    def unsupported_reason(blocks: Sequence[nn.Module]) -> str | None:
        """Why these blocks cannot take the row-table decode step (None if they can)."""
        return _unsupported_reason(blocks)

    def __init__(
        self,
        blocks: Sequence[Block],
        *,
        config: DecodeGraphsConfig | None = None,
        capture: bool | None = None,
    ) -> None:
        reason = _unsupported_reason(blocks)
        if reason is not None:
            raise ValueError(f"these blocks cannot run decode graphs: {reason}")
        # _unsupported_reason admitted only spans of one of these kinds.
        self.blocks = cast(list[GraphBlock], list(blocks))
        self.config = config or DecodeGraphsConfig()
        first = self.blocks[0]
        weight = first.norm_weight
        self.device = weight.device
        self.dtype = weight.dtype
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need blocks on a CUDA device")
        self.hidden_size = first.hidden_size
        #: Fewest rows (as a rows bucket) a step must have to take this path, and the last
        #: position a step may reach (Mixtral's sliding window).
        self._least_rows = 1
        self._window: int | None = None
        if isinstance(first, MixtralBlock):
            moe = first.block_sparse_moe
            self._least_rows = -(-moe.num_experts // moe.top_k)
            self._window = first.sliding_window
        rows = bucket(self.config.max_rows)  # the largest rows bucket
        # Per rows bucket: the tables as the kernels read them, and their staging on the host.
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._staged: torch.cuda.Event | None = None
        with torch.inference_mode(False):  # written in place from any mode
            self._x = torch.zeros((rows, 1, self.hidden_size), dtype=self.dtype, device=self.device)
        # Padding rows append at position 0 of this one-position cache and attend to it alone.
        self._scratch = first.allocate_cache(1, 1)
        self._angles = RotaryTables()  # rotary blocks only
        self._graphs: OrderedDict[tuple[Any, ...], _Graph] = OrderedDict()
        self._sessions: weakref.WeakKeyDictionary[KVCache, _Session] = weakref.WeakKeyDictionary()
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._disabled: str | None = None
        self._counts = {
            "captured": 0,
            "evicted": 0,
            "replays": 0,
            "declined": 0,
            "failures": 0,
            "pool_bytes": 0,
        }

    def statistics(self) -> DecodeGraphsStatistics:
        return DecodeGraphsStatistics(graphs=len(self._graphs), **self._counts)

    @property
    def disabled_reason(self) -> str | None:
        """Why steps no longer take this path (a warm-up or a step failed), or None."""
        return self._disabled

    def warm_up(self) -> bool:
        """Compile the step's kernels now (on scratch rows, eagerly; nothing is captured), so
        that the first sessions' first steps do not wait for it: a short and a long length
        bucket, whose attention runs in one pass and in splits.

        Returns whether it worked.  If it failed, the graphs are off (:attr:`disabled_reason`
        says why, logged once) and every step is left to the eager path: a server keeps
        serving without its fast path rather than dying of it."""
        try:
            with self._on_device():
                for length in (self.config.min_length_bucket, 16 * self.config.min_length_bucket):
                    self._ensure_rotary(length)
                    if self._staged is not None:
                        self._staged.synchronize()
                    self._fill_scratch(0, len(self.blocks), 0, 1)
                    staging, tables = self._tables_for(1)
                    tables.copy_(staging)
                    self._step_fn(0, len(self.blocks), 1, length)()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
        except Exception as error:
            self.disable(f"warming up the decode step failed: {error!r}")
            return False
        return True

    def capture_ahead(self) -> int:
        """Make, now, the graphs of the steps a server meets in steady state (see
        :class:`DecodeGraphsConfig`'s ``ahead_max_length``): the whole span, no adapter, every
        rows bucket (Mixtral's from the fewest rows it takes), every length bucket, the shortest
        lengths first.  Stops at ``max_graphs`` graphs or once the pool has grown by
        ``ahead_pool_bytes``.  Returns how many graphs it made; a failure turns the graphs off,
        as in :meth:`step`."""
        longest = self.config.ahead_max_length
        if longest is None or self._disabled is not None:
            return 0
        lengths = []
        length = self.config.min_length_bucket
        while length <= bucket(longest, self.config.min_length_bucket):
            lengths.append(length)
            length *= 2
        largest = bucket(self.config.max_rows)
        rows = [1 << n for n in range(largest.bit_length()) if 1 << n >= self._least_rows]
        made = 0
        try:
            with self._on_device():
                self._ensure_rotary(lengths[-1])  # no later growth drops what is made here
                for bucket_length in lengths:
                    for bucket_rows in rows:
                        if (
                            len(self._graphs) >= self.config.max_graphs
                            or self._counts["pool_bytes"] >= self.config.ahead_pool_bytes
                        ):
                            return made
                        key = (0, len(self.blocks), None, bucket_rows, bucket_length)
                        if key not in self._graphs:
                            self._graph(key)
                            made += 1
        except Exception as error:
            self._counts["failures"] += 1
            self.disable(f"capturing the decode steps at load failed: {error!r}")
            return made
        return made

    def disable(self, reason: str) -> None:
        """Leave every later step to the eager path, saying why (logged once)."""
        if self._disabled is None:
            self._disabled = reason
            log.warning("decode graphs off for this span: %s", reason)
            self._graphs.clear()

    # -- the step --------------------------------------------------------------------------------

    def step(
        self,
        start: int,
        end: int,
        hidden_states: Sequence[torch.Tensor],
        caches: Sequence[Sequence[KVCache]],
    ) -> list[torch.Tensor] | None:
        """One new token per row through blocks ``start .. end - 1`` (indices into ``blocks``).

        ``hidden_states[i]`` is ``(B_i, 1, hidden)`` in the blocks' dtype on their device, and
        ``caches[i]`` that session's caches of those blocks.  Returns each item's output (as the
        eager ``forward_many`` would) and advances every cache by one position; or None, having
        changed nothing, when the step must take the eager path.
        """
        sessions = self._eligible(start, end, hidden_states, caches)
        groups = None if sessions is None else self._groups(sessions)
        if sessions is None or groups is None:
            self._counts["declined"] += 1
            return None
        outputs: list[torch.Tensor] = []
        try:
            with self._on_device():
                for group in groups:
                    outputs += self._run(start, end, group, hidden_states, caches, sessions)
        except Exception as error:
            # A replay writes each row's new key and value at its cache's length, and no length
            # has moved yet: every cache is as it was.
            self._counts["failures"] += 1
            self.disable(f"a decode step failed: {error!r}")
            return None
        for items in caches:
            for cache in items:
                cache.length += 1
        return outputs

    def _groups(self, sessions: Sequence[_Session]) -> list[list[int]] | None:
        """The sessions (indices) of each replay: in order, at most ``max_rows`` rows each; None
        when a replay would have fewer rows than the blocks take (Mixtral's)."""
        groups: list[list[int]] = [[]]
        rows = 0
        for index, session in enumerate(sessions):
            if rows + session.batch > self.config.max_rows:
                groups.append([])
                rows = 0
            groups[-1].append(index)
            rows += session.batch
        for group in groups:
            if bucket(sum(sessions[index].batch for index in group)) < self._least_rows:
                return None
        return groups

    def _on_device(self) -> contextlib.AbstractContextManager[None]:
        """The blocks' device made current (streams, events and replays are the current
        device's), a no-op off CUDA."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def _eligible(
        self,
        start: int,
        end: int,
        hidden_states: Sequence[torch.Tensor],
        caches: Sequence[Sequence[KVCache]],
    ) -> list[_Session] | None:
        if self._disabled is not None or not hidden_states:
            return None
        if not 0 <= start < end <= len(self.blocks) or len(hidden_states) != len(caches):
            return None
        sessions = []
        seen: set[int] = set()
        for states, items in zip(hidden_states, caches, strict=True):
            if (
                states.dim() != 3
                or states.shape[1] != 1
                or states.shape[2] != self.hidden_size
                or states.dtype != self.dtype
                or states.device != self.device
                or len(items) != end - start
            ):
                return None
            first = items[0]
            if not isinstance(first, KVCache) or first.padding is not None:
                return None
            length = first.length
            if any(cache.length != length for cache in items) or length >= first.max_length:
                return None
            if states.shape[0] != first.batch or first.batch > self.config.max_rows:
                return None
            if self._window is not None and length + 1 > self._window:
                return None  # the eager path refuses it, saying why
            if id(first) in seen:
                return None
            seen.add(id(first))
            session = self._session(start, items)
            if session is None:
                return None
            sessions.append(session)
        return sessions

    def _session(self, start: int, caches: Sequence[KVCache]) -> _Session | None:
        """The session's row pointers, checked and computed on its first step."""
        first = caches[0]
        known = self._sessions.get(first)
        if known is not None and known.cache_ids == tuple(id(cache) for cache in caches):
            return known
        shape = first.keys.shape
        for cache in caches:
            keys, values = cache.keys, cache.values
            if not (
                isinstance(cache, KVCache)
                and keys.shape == values.shape == shape
                and keys.is_contiguous()
                and values.is_contiguous()
                and keys.dtype == values.dtype == self.dtype
                and keys.device == values.device == self.device
                and shape[1] == self._scratch.keys.shape[1]
                and shape[3] == self._scratch.keys.shape[3]
                # The row-table kernels' alignment contract (kernels._rows).
                and keys.data_ptr() % 16 == 0
                and values.data_ptr() % 16 == 0
                and shape[3] * keys.element_size() % 16 == 0
            ):
                return None
        batch = shape[0]
        row_bytes = first.keys.stride(0) * first.keys.element_size()
        bases = [(cache.keys.data_ptr(), cache.values.data_ptr()) for cache in caches]
        pointers = torch.tensor(
            [[base + row * row_bytes for row in range(batch)] for pair in bases for base in pair],
            dtype=torch.int64,
        )  # (2 * blocks, batch)
        session = _Session(caches, batch, pointers)
        self._sessions[first] = session
        return session

    def _run(
        self,
        start: int,
        end: int,
        group: Sequence[int],
        hidden_states: Sequence[torch.Tensor],
        caches: Sequence[Sequence[KVCache]],
        sessions: Sequence[_Session],
    ) -> list[torch.Tensor]:
        rows = sum(sessions[index].batch for index in group)
        bucket_rows = bucket(rows)
        longest = max(caches[index][0].length for index in group) + 1
        bucket_length = bucket(longest, self.config.min_length_bucket)
        self._ensure_rotary(longest)
        key = (start, end, active_adapter(), bucket_rows, bucket_length)
        graph = self._graph(key)
        self._fill(start, end, group, caches, sessions, bucket_rows)
        joined = (
            torch.cat([hidden_states[index] for index in group])
            if len(group) > 1
            else (hidden_states[group[0]])
        )
        self._x[:rows].copy_(joined)
        output = graph.replay()[:rows].clone()  # (rows, 1, hidden): the buffer is reused
        self._counts["replays"] += 1
        return list(output.split([sessions[index].batch for index in group]))

    # -- tables ----------------------------------------------------------------------------------

    def _fill(
        self,
        start: int,
        end: int,
        group: Sequence[int],
        caches: Sequence[Sequence[KVCache]],
        sessions: Sequence[_Session],
        bucket_rows: int,
    ) -> None:
        """Stage the group's tables (padding columns on the scratch cache) and copy them over."""
        staging, tables = self._tables_for(bucket_rows)
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of a staging buffer is done
        first, last = FIRST_POINTER + 2 * start, FIRST_POINTER + 2 * end
        column = 0
        for index in group:
            session = sessions[index]
            span = slice(column, column + session.batch)
            staging[POSITIONS, span] = caches[index][0].length
            staging[HEAD_STRIDES, span] = session.head_stride
            staging[first:last, span] = session.pointers
            column += session.batch
        if column < bucket_rows:
            self._fill_scratch(start, end, column, bucket_rows)
        tables.copy_(staging, non_blocking=True)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()

    def _tables_for(self, bucket_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (staging, device) tables of a rows bucket, ``(2 + 2 * blocks, columns)``: a
        column per row, and one more for a bucket of one row, so that every table (a line)
        starts 16 bytes from the last, as the kernels compiled for one bucket expect of all."""
        known = self._tables.get(bucket_rows)
        if known is None:
            shape = (FIRST_POINTER + 2 * len(self.blocks), bucket_rows + bucket_rows % 2)
            pin = self.device.type == "cuda"
            with torch.inference_mode(False):  # written in place from any mode
                known = (
                    torch.zeros(shape, dtype=torch.int64, pin_memory=pin),
                    torch.zeros(shape, dtype=torch.int64, device=self.device),
                )
            self._tables[bucket_rows] = known
        return known

    def _fill_scratch(self, start: int, end: int, first_column: int, last_column: int) -> None:
        scratch = self._scratch
        span = slice(first_column, last_column)
        staging, _ = self._tables_for(last_column)
        staging[POSITIONS, span] = 0
        staging[HEAD_STRIDES, span] = scratch.keys.stride(1)
        for block in range(start, end):
            row = FIRST_POINTER + 2 * block
            staging[row, span] = scratch.keys.data_ptr()
            staging[row + 1, span] = scratch.values.data_ptr()
        self._x[first_column:last_column].zero_()

    def _ensure_rotary(self, positions: int) -> None:
        """Grow the rotary tables (LLaMA, Falcon) to cover ``positions``; graphs captured on the
        old tables are dropped."""
        first = self.blocks[0]
        rotary = None if isinstance(first, BloomBlock) else first.rotary
        if rotary is None:
            return
        if self._angles.cos is not None and self._angles.cos.shape[0] >= positions:
            return
        size = max(_MIN_ROTARYPOSITIONS, 1 << (positions - 1).bit_length())
        with torch.inference_mode():
            cos, sin = rotary(0, size, device=self.device, dtype=self.dtype)
        self._angles.cos, self._angles.sin = cos[0].contiguous(), sin[0].contiguous()
        self._counts["evicted"] += len(self._graphs)
        self._graphs.clear()

    # -- graphs ----------------------------------------------------------------------------------

    def _graph(self, key: tuple[Any, ...]) -> _Graph:
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        start, end, _, bucket_rows, bucket_length = key
        run = self._step_fn(start, end, bucket_rows, bucket_length)
        if self.capture:
            graph = self._capture(start, end, bucket_rows, run)
        else:
            graph = _Graph(run, None, None)
        self._graphs[key] = graph
        self._counts["captured"] += 1
        while len(self._graphs) > self.config.max_graphs:
            self._graphs.popitem(last=False)
            self._counts["evicted"] += 1
        return graph

    def _capture(
        self, start: int, end: int, bucket_rows: int, run: Callable[[], torch.Tensor]
    ) -> _Graph:
        """Warm up on scratch rows (compiles the kernels; writes only the scratch cache), then
        capture on a side stream into the shared pool."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        assert stream is not None
        if self._staged is not None:
            self._staged.synchronize()
        self._fill_scratch(start, end, 0, bucket_rows)
        staging, tables = self._tables_for(bucket_rows)
        tables.copy_(staging)
        # The capture empties the allocator's cache when it starts: so does this, first, so
        # that what the capture adds is not hidden by what that frees.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"
        ):
            output = run()
        self._counts["pool_bytes"] += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        return _Graph(run, graph, output)

    def _step_fn(
        self, start: int, end: int, bucket_rows: int, bucket_length: int
    ) -> Callable[[], torch.Tensor]:
        """The step of blocks ``start .. end - 1`` on ``bucket_rows`` rows: the blocks' own
        forward, attending through each block's rows of the tables."""
        x = self._x[:bucket_rows]
        _, device_tables = self._tables_for(bucket_rows)
        views = [
            RowCaches(
                row_tables(device_tables[:, :bucket_rows], block), bucket_length, self._angles
            )
            for block in range(start, end)
        ]
        blocks = self.blocks[start:end]

        def run() -> torch.Tensor:
            with torch.inference_mode():
                y = x
                for block, view in zip(blocks, views, strict=True):
                    y = block(y, cache=view)
                return y

        return run
