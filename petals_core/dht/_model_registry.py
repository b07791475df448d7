"""The swarm's registry of models: which models are served, as Petals keeps it.

Servers announce their blocks under ``f"{dht_prefix}.{i}"`` (:class:`ServerInfo`), which a reader
finds only if it knows the prefix.  So each server also stores a :class:`ModelInfo` under the
well-known key :data:`MODELS_KEY`, with its model's ``dht_prefix`` as subkey, as often and for as
long as its announcements: whoever reads that key (a monitor) learns every model served and how
many blocks it has, then follows each model's prefix.

The entries are unsigned (a subkey is a model, not a peer), so any peer may file one: readers
treat them as hints, bounded in size and block count, never as proof that a model is served.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

import attrs

from .._errors import CodecError
from ..transport import CodecLimits, encode_message
from ._records import _check_count, _check_name, decode_value_untrusted

if TYPE_CHECKING:
    from ._node import DHTNode

__all__ = ["MAX_MODEL_BLOCKS", "MODELS_KEY", "ModelInfo", "get_models", "register_model"]

logger = logging.getLogger(__name__)

#: The key every server files its model under (subkey: the model's ``dht_prefix``).
MODELS_KEY: Final = "_petals_core.models"

#: The most blocks a registered model may have: readers follow every block of every model, so a
#: bogus entry must not make them read millions of keys.  The largest models have a few hundred.
MAX_MODEL_BLOCKS: Final = 1024

# A registry entry is tiny: these bound the work of decoding one whatever a peer sends.
_MODEL_INFO_LIMITS: Final = CodecLimits(
    max_frame_bytes=4096,
    max_depth=4,
    max_container_items=64,
    max_string_bytes=1024,
).without_tensors()


def _check_model_info(info: ModelInfo) -> None:
    _check_count("num_blocks", info.num_blocks, 1, MAX_MODEL_BLOCKS + 1)
    _check_name("repository", info.repository, optional=True)
    _check_name("model_type", info.model_type, optional=True)


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What the registry says of one model: it has ``num_blocks`` blocks; ``repository`` is the
    Hub repo its servers load (None for a local checkpoint, whose path means nothing to others);
    ``model_type`` its family as transformers names it (``"llama"``, ``"bloom"``, ``"falcon"``,
    ``"mixtral"``).

    Readers ignore fields they do not know, so newer servers may add some.  Invalid fields raise
    :class:`LocalProtocolError`.
    """

    num_blocks: int
    repository: str | None = None
    model_type: str | None = None

    def __attrs_post_init__(self) -> None:
        _check_model_info(self)

    def to_bytes(self) -> bytes:
        """The entry as a CBOR map (fields that are None are left out)."""
        message = {name: value for name, value in attrs.asdict(self).items() if value is not None}
        return encode_message(message)

    @classmethod
    def from_bytes_untrusted(cls, data: bytes | bytearray | memoryview) -> ModelInfo:
        """Read an entry a peer stored; unknown fields are ignored, and a null field counts as
        absent.  Raises only :class:`CodecError`."""
        return decode_value_untrusted(cls, "model info", data, _MODEL_INFO_LIMITS)


async def register_model(dht: DHTNode, prefix: str, info: ModelInfo, *, expiration: float) -> int:
    """File ``info`` in the registry under the model's ``prefix`` until ``expiration`` (absolute,
    on the node's clock); returns how many remote nodes accepted it.

    A prefix the registry cannot hold as a subkey (over 128 bytes of UTF-8, or one that reads as
    a PeerID) raises :class:`LocalProtocolError` or is refused by every node (0).
    """
    return await dht.store(MODELS_KEY, info.to_bytes(), expiration, subkey=prefix)


async def get_models(dht: DHTNode) -> dict[str, ModelInfo]:
    """The registry as the network holds it now: ``{dht_prefix: ModelInfo}``, the newest entry of
    each model.  Entries that do not decode are left out (and logged)."""
    found = await dht.get(MODELS_KEY, latest=True)
    models: dict[str, ModelInfo] = {}
    if found is None:
        return models
    for prefix, entry in found.entries.items():
        if prefix is None:
            continue  # a single value under the key: not an entry of the registry
        try:
            models[prefix] = ModelInfo.from_bytes_untrusted(entry.value)
        except CodecError as exc:
            logger.debug("a bad registry entry for %r: %s", prefix, exc)
    return models
