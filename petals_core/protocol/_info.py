"""The messages of ``petals.info`` (unary): what a server holds and expects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

import attrs

from .._errors import LocalProtocolError
from ._wire import WireMessage, as_tuple, check_integer, is_integer, untrusted, wire_fields

__all__ = ["INFO", "InfoReply", "InfoRequest"]

INFO: Final = "petals.info"


@attrs.frozen(kw_only=True)
class InfoRequest(WireMessage):
    """Asks a server what it holds (the request has no fields)."""

    what: ClassVar[str] = "info request"

    def to_wire(self) -> dict[str, Any]:
        return {}


_COUNTS: Final = (
    "start_block",
    "end_block",
    "hidden_size",
    "cache_tokens_left",
    "inference_max_length",
    "max_batch_tokens",
    "open_sessions",
)
_TEXTS: Final = ("version", "torch_dtype", "device")


@attrs.frozen(kw_only=True)
class InfoReply(WireMessage):
    """What a server holds (blocks ``[start_block, end_block)``, in ``torch_dtype`` on
    ``device``, with ``adapters``) and expects (activations in one of ``accepted_dtypes``,
    sessions of at most ``inference_max_length`` positions, ``max_batch_tokens`` tokens per
    job); ``cache_tokens_left`` is its free attention cache in positions of one row of one
    block.  ``device_memory_reserved_bytes`` and ``decode_graphs`` (the CUDA-graph decode
    path's counters) are None where they do not apply."""

    what: ClassVar[str] = "server info"

    version: str
    start_block: int
    end_block: int
    hidden_size: int
    torch_dtype: str
    accepted_dtypes: tuple[str, ...] = attrs.field(converter=as_tuple)
    adapters: tuple[str, ...] = attrs.field(converter=as_tuple)
    cache_tokens_left: int
    inference_max_length: int
    max_batch_tokens: int
    open_sessions: int
    device: str
    device_memory_reserved_bytes: int | None = None
    decode_graphs: Mapping[str, int | str | None] | None = attrs.field(default=None, hash=False)

    def __attrs_post_init__(self) -> None:
        for name in _TEXTS:
            if not isinstance(getattr(self, name), str):
                raise LocalProtocolError(f"{name} must be a string")
        for name in _COUNTS:
            check_integer(name, getattr(self, name), 0)
        for name in ("accepted_dtypes", "adapters"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
                raise LocalProtocolError(f"{name} must be a list of strings")
        if self.device_memory_reserved_bytes is not None:
            check_integer("device_memory_reserved_bytes", self.device_memory_reserved_bytes, 0)
        graphs = self.decode_graphs
        if graphs is not None and (
            not isinstance(graphs, Mapping)
            or not all(
                isinstance(k, str) and (v is None or isinstance(v, str) or is_integer(v))
                for k, v in graphs.items()
            )
        ):
            raise LocalProtocolError("decode_graphs must map names to integers, strings or null")

    def to_wire(self) -> dict[str, Any]:
        message = attrs.asdict(self, recurse=False)
        message["accepted_dtypes"] = list(self.accepted_dtypes)
        message["adapters"] = list(self.adapters)
        if self.decode_graphs is not None:
            message["decode_graphs"] = dict(self.decode_graphs)
        return message

    @classmethod
    def from_wire_untrusted(cls, message: Mapping[str, Any]) -> InfoReply:
        """Raises :class:`CodecError` only; fields it does not know are ignored (newer servers
        may add some)."""

        def build() -> InfoReply:
            fields = wire_fields(cls, message)
            missing = [name for name in _REQUIRED if fields[name] is None]
            if missing:
                raise LocalProtocolError(f"server info lacks {', '.join(missing)}")
            return cls(**fields)

        return untrusted(cls.what, build, message)


_REQUIRED: Final = tuple(
    field.name for field in attrs.fields(InfoReply) if field.default is attrs.NOTHING
)
