"""Tensors in parts: how ``petals.forward`` and ``petals.backward`` move their messages.

A transfer is ``{"meta": {...}}``, then for each tensor one or more ``{"name", "shape",
"part"}`` messages whose ``part`` is a flat slice of at most ``chunk_bytes``, in order, then
``{"done": true}``.  The receiver checks every declared shape and dtype against its limits
before it allocates anything, and refuses parts that overrun.

The functions take the call's ``send`` and ``receive``; nothing here knows the event loop.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import torch

from .._errors import CodecError

__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_TENSORS", "receive_tensors", "send_tensors"]

#: Parts of large tensors are at most this big (frames above 1 MiB are assembled one at a time
#: per connection by the transport, so parts of a few MiB keep both memory and latency low).
DEFAULT_CHUNK_BYTES: Final = 4 << 20
#: Tensors in one transfer.
MAX_TENSORS: Final = 8

Send = Callable[[Mapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]


async def send_tensors(
    send: Send,
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor | None],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    last: Send | None = None,
    encode_part: Callable[[torch.Tensor], Any] | None = None,
) -> None:
    """Send ``meta`` and ``tensors`` (None values are left out) in parts; the closing
    ``{"done": True}`` goes through ``last`` when given (a caller's send that also ends its
    side: the callee may answer and stop reading as soon as it has it).  ``encode_part``
    turns each part into what the message carries (e.g. marks it to travel compressed).

    A tensor on another device is copied to the CPU once, whole, before its parts are encoded
    (the codec would otherwise copy each part on its own)."""
    await send({"meta": dict(meta)})
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        per_part = max(1, chunk_bytes // max(1, flat.element_size()))
        shape = list(tensor.shape)
        if flat.numel() == 0:
            await send({"name": name, "shape": shape, "part": flat})
            continue
        for offset in range(0, flat.numel(), per_part):
            part = flat[offset : offset + per_part]
            encoded = part if encode_part is None else encode_part(part)
            await send({"name": name, "shape": shape, "part": encoded})
    await (last or send)({"done": True})


async def receive_tensors(
    receive: Receive, *, max_elements: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Receive what :func:`send_tensors` sent; at most ``max_elements`` elements in all.

    Raises :class:`CodecError` for anything malformed: a missing ``meta``, parts whose shape or
    dtype changes, overruns, too many tensors or elements, a tensor left incomplete.
    """
    first = await receive()
    meta = first.get("meta")
    if not isinstance(meta, dict):
        raise CodecError("a tensor transfer starts with {'meta': {...}}")
    incoming: dict[str, _Incoming] = {}
    total = 0
    while True:
        message = await receive()
        if message.get("done") is True:
            break
        name, shape, part = message.get("name"), message.get("shape"), message.get("part")
        if not isinstance(name, str) or not isinstance(part, torch.Tensor) or part.dim() != 1:
            raise CodecError("a tensor part is {'name': str, 'shape': [...], 'part': 1-d tensor}")
        tensor = incoming.get(name)
        if tensor is None:
            if len(incoming) >= MAX_TENSORS:
                raise CodecError(f"more than {MAX_TENSORS} tensors in one transfer")
            if (
                not isinstance(shape, list)
                or len(shape) > 8
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)
            ):
                raise CodecError(f"tensor {name!r}: shape must be a list of at most 8 sizes >= 0")
            numel = math.prod(shape)
            total += numel
            if total > max_elements:
                raise CodecError(f"the tensors exceed {max_elements} elements in all")
            tensor = incoming[name] = _Incoming(shape, part.dtype)
        elif shape != tensor.shape:
            raise CodecError(f"tensor {name!r}: parts declare different shapes")
        tensor.add(name, part)
    result = {}
    for name, tensor in incoming.items():
        if tensor.filled != tensor.numel:
            raise CodecError(f"tensor {name!r} is incomplete: {tensor.filled} of {tensor.numel}")
        result[name] = tensor.tensor()
    return meta, result


class _Incoming:
    """A tensor being received: its parts are kept as they come (memory follows the bytes
    that really arrived, not the size a peer declared) and joined at the end."""

    def __init__(self, shape: list[int], dtype: torch.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.numel = math.prod(shape)
        self.parts: list[torch.Tensor] = []
        self.filled = 0

    def add(self, name: str, part: torch.Tensor) -> None:
        if part.dtype != self.dtype:
            raise CodecError(f"tensor {name!r}: parts of different dtypes")
        end = self.filled + part.numel()
        if end > self.numel:
            raise CodecError(f"tensor {name!r}: parts overrun its declared shape")
        self.parts.append(part)
        self.filled = end

    def tensor(self) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0].reshape(self.shape)
        if not self.parts:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.cat(self.parts).reshape(self.shape)
