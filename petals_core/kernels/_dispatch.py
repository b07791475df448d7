"""Choose each kernel's implementation by device: Triton on CUDA, the torch reference elsewhere.

Decode attention on CUDA in 16 bits (without ALiBi, which only the Triton kernels compute exactly
in 16 bits) has two candidates, the flash-decoding kernel and torch's SDPA, and which is faster
depends on the card, the shape and how costly a launch is on the host.  So the first call of each
shape bucket times both (:class:`DispatchTable`) and later calls in the bucket take the faster;
``dispatch_table()`` tells what was measured and chosen.  During a CUDA graph capture nothing can
be timed: Triton runs.

Kernels launch on the tensors' device: Triton launches on the current device, which for a block
on ``cuda:1`` need not be the tensors' own.

The Triton kernels are imported only when a CUDA tensor first needs them, so CPU-only programs never
import triton.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import torch
import torch.nn.functional as F

from ._limits import attention_kernel
from ._reference import (
    attention_reference,
    rms_norm_reference,
    rotary_append_reference,
    rotary_reference,
)

__all__ = [
    "DispatchChoice",
    "DispatchTable",
    "attention",
    "dispatch_table",
    "rms_norm",
    "rotary",
    "rotary_append",
    "triton_attention_path",
    "triton_usable",
]


@attrs.frozen(kw_only=True)
class DispatchChoice:
    """What one shape bucket runs: ``choice`` (a candidate's name), after timing each candidate
    (``seconds``: mean seconds per call, launch included)."""

    key: tuple[object, ...]
    choice: str
    seconds: dict[str, float]


class DispatchTable:
    """The faster of several implementations per key, timed on the key's first call.

    ``timer`` runs a candidate ``repeats`` times and returns the seconds per call (on CUDA:
    synchronised wall-clock time, so the host's launch cost counts, as it does for a real call).
    Candidates must have no side effects: each runs ``1 + repeats`` times.
    """

    def __init__(self, *, repeats: int = 5) -> None:
        self._repeats = repeats
        self._choices: dict[tuple[object, ...], DispatchChoice] = {}
        self._lock = threading.Lock()

    def choose(
        self,
        key: tuple[object, ...],
        candidates: dict[str, Callable[[], object]],
        *,
        synchronize: Callable[[], None] = lambda: None,
    ) -> str:
        known = self._choices.get(key)
        if known is not None:
            return known.choice
        with self._lock:
            known = self._choices.get(key)
            if known is not None:
                return known.choice
            seconds = {}
            for name, candidate in candidates.items():
                candidate()  # compiles, allocates, warms caches
                synchronize()
                started = time.perf_counter()
                for _ in range(self._repeats):
                    candidate()
                synchronize()
                seconds[name] = (time.perf_counter() - started) / self._repeats
            choice = min(seconds, key=seconds.__getitem__)
            self._choices[key] = DispatchChoice(key=key, choice=choice, seconds=seconds)
            return choice

    def snapshot(self) -> list[DispatchChoice]:
        return list(self._choices.values())


#: The process's attention choices on CUDA.
_ATTENTION_CHOICES = DispatchTable()


def dispatch_table() -> list[DispatchChoice]:
    """Every attention choice made so far in this process (CUDA shape buckets), with the timings
    it was made from."""
    return _ATTENTION_CHOICES.snapshot()


def _bucket(value: int) -> int:
    return 1 << (max(value, 1) - 1).bit_length()


def _attention_key(q: torch.Tensor, k: torch.Tensor, query_offset: int) -> tuple[object, ...]:
    """Calls in one bucket cost about the same: same device, dtype and heads, and batch, new
    tokens and keys within a factor of two; whether the queries end the cache decides SDPA's
    mask (none, causal or explicit)."""
    batch, n_head, new, head_dim = q.shape
    length = k.shape[2]
    return (
        q.device.index,
        q.dtype,
        n_head,
        k.shape[1],
        head_dim,
        _bucket(batch),
        _bucket(new),
        _bucket(length),
        query_offset + new == length,
        query_offset == 0,
    )


@contextlib.contextmanager
def _on(device: torch.device) -> Iterator[None]:
    """Make ``device`` current while launching (a no-op when it already is, and for CPU devices,
    which have no index)."""
    if device.index is None or device.index == torch.cuda.current_device():
        yield
        return
    with torch.cuda.device(device):
        yield


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    query_offset: int,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`attention_reference` for shapes and semantics.

    On CUDA, in fp16 and bf16 (:func:`triton_attention_path` says which path a call takes):
    with ALiBi, the Triton kernels, which alone compute it exactly in 16 bits (flash-decoding
    for up to 16 new tokens, flash-attention tiles beyond); without, for up to 16 new tokens
    the faster of the flash-decoding kernel and torch's SDPA, as the shape's bucket measured it
    (Triton during a CUDA graph capture, where nothing can be timed), and torch's SDPA beyond.
    Elsewhere, in fp32 and whenever autograd needs a backward: without ALiBi, torch's fused SDPA
    with the same semantics (called as transformers' SDPA attention calls it, so LLaMA blocks
    match transformers' default attention); with ALiBi, the reference (as transformers' BLOOM),
    except for an fp32 decode step (one query at the end of the cache), which gives the ALiBi
    term to SDPA as an additive mask: half the ops of the reference, the same scores.  With a
    ``key_bias`` (Falcon's ALiBi) or ``key_padding``, the reference everywhere.
    """
    if key_padding is not None or key_bias is not None:
        # Left-padded sessions (batched generation) take the reference path everywhere.
        return attention_reference(
            q,
            k,
            v,
            query_offset=query_offset,
            scale=scale,
            alibi_slopes=alibi_slopes,
            key_padding=key_padding,
            key_bias=key_bias,
        )
    path = triton_attention_path(q, k, v, alibi=alibi_slopes is not None)
    if path is not None:
        from . import _triton_attention

        def triton_attention() -> torch.Tensor:
            with _on(q.device):
                if path == "decode":
                    return _triton_attention.decode_attention(
                        q, k, v, query_offset=query_offset, scale=scale, alibi_slopes=alibi_slopes
                    )
                return _triton_attention.prefill_attention(
                    q, k, v, query_offset=query_offset, scale=scale, alibi_slopes=alibi_slopes
                )

        if alibi_slopes is not None or torch.cuda.is_current_stream_capturing():
            return triton_attention()
        choice = _ATTENTION_CHOICES.choose(
            _attention_key(q, k, query_offset),
            {
                "triton": triton_attention,
                "sdpa": lambda: _sdpa_attention(q, k, v, query_offset=query_offset, scale=scale),
            },
            synchronize=functools.partial(torch.cuda.synchronize, q.device),
        )
        if choice == "triton":
            return triton_attention()
    if alibi_slopes is None:
        return _sdpa_attention(q, k, v, query_offset=query_offset, scale=scale)
    if (
        q.shape[2] == 1
        and query_offset == k.shape[2] - 1
        and q.dtype == k.dtype == v.dtype == torch.float32
    ):
        return _sdpa_alibi_decode(q, k, v, scale=scale, alibi_slopes=alibi_slopes)
    return attention_reference(
        q, k, v, query_offset=query_offset, scale=scale, alibi_slopes=alibi_slopes
    )


def triton_attention_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, alibi: bool
) -> str | None:
    """Which Triton attention kernel :func:`attention` may launch for these tensors (with ALiBi
    or not, no padding or bias): ``"decode"``, ``"prefill"`` or None (see
    :func:`~petals_core.kernels._limits.attention_kernel`), on GPUs Triton supports and when no
    backward is to be recorded."""
    if not (q.is_cuda and _use_triton(q, k, v)):
        return None
    return attention_kernel(
        dtype=q.dtype, new_tokens=q.shape[2], group=q.shape[1] // k.shape[1], alibi=alibi
    )


def _sdpa_alibi_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None,
    alibi_slopes: torch.Tensor,
) -> torch.Tensor:
    """fp32 decode (one query, at the end of the cache) with ALiBi: the reference's scores, the
    ALiBi term given to torch's fused attention as an additive mask (one query sees every key,
    so there is nothing else to mask)."""
    n_head, length = q.shape[1], k.shape[2]
    key_pos = torch.arange(length, device=q.device, dtype=torch.float32)
    bias = alibi_slopes.to(q.device, torch.float32).view(1, n_head, 1, 1) * key_pos.view(
        1, 1, 1, -1
    )  # (1, n_head, 1, S)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, scale=scale, enable_gqa=n_head != k.shape[1]
    )


def _sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, query_offset: int, scale: float | None
) -> torch.Tensor:
    """The reference's semantics through torch's fused attention (fp32 accumulation inside)."""
    new, length = q.shape[2], k.shape[2]
    if length < query_offset + new:
        raise ValueError(f"{length} keys cannot cover queries up to {query_offset + new}")
    mask = None
    causal = False
    if query_offset == 0 and new == length:
        causal = True
    elif not (new == 1 and query_offset == length - 1):
        # Query t sees keys 0 .. query_offset + t.
        key_pos = torch.arange(length, device=q.device)
        query_pos = query_offset + torch.arange(new, device=q.device)
        mask = key_pos.view(1, -1) <= query_pos.view(-1, 1)  # (T, S)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda and _use_triton(x, weight):
        from . import _triton_norm

        with _on(x.device):
            return _triton_norm.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and cos.shape[0] == 1 and _use_triton(x, cos, sin):
        from . import _triton_rotary

        with _on(x.device):
            return _triton_rotary.rotary(x, cos, sin)
    return rotary_reference(x, cos, sin)


def rotary_append(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """See :func:`rotary_append_reference`: returns the rotated q; the cache gets k and v.

    On CUDA one kernel launch does all three.
    """
    if q.is_cuda and cos.shape[0] == 1 and _use_triton(q, k, v, cos, sin):
        from . import _triton_rotary

        with _on(q.device):
            return _triton_rotary.rotary_append(
                q, k, v, cos, sin, keys=keys, values=values, start=start
            )
    return rotary_append_reference(q, k, v, cos, sin, keys=keys, values=values, start=start)


def _use_triton(*tensors: torch.Tensor) -> bool:
    """Triton for CUDA tensors, unless autograd will need a backward (the kernels have none;
    training takes the torch path, which has one).  Callers test ``is_cuda`` of the first tensor
    before calling (CPU steps skip the call)."""
    first = tensors[0]
    if not first.is_cuda or not _triton_installed() or not _kernels_fit(first.device.index):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device``: a CUDA device of compute capability 8.0 or
    newer, with triton installed."""
    return device.type == "cuda" and _triton_installed() and _kernels_fit(device.index)


@functools.cache
def _kernels_fit(device_index: int | None) -> bool:
    """The kernels' tiles assume Ampere or newer (shared memory, bf16); older GPUs use torch."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
