"""petals_core: run and fine-tune large language models across machines owned by different people.

The root package re-exports only what is cheap to import; the transport lives in
``petals_core.transport`` and imports no torch.
"""

from ._errors import (
    AdapterError as AdapterError,
    AllocationFailed as AllocationFailed,
    CallEnded as CallEnded,
    CheckpointError as CheckpointError,
    ClosedResourceError as ClosedResourceError,
    CodecError as CodecError,
    ConfigError as ConfigError,
    ConnectionClosed as ConnectionClosed,
    ConnectTimeout as ConnectTimeout,
    IdentityFileError as IdentityFileError,
    IdentityMismatch as IdentityMismatch,
    InvalidMultiaddr as InvalidMultiaddr,
    LocalProtocolError as LocalProtocolError,
    NetworkError as NetworkError,
    PeerUnreachable as PeerUnreachable,
    PetalsError as PetalsError,
    ProtocolError as ProtocolError,
    RemoteError as RemoteError,
    RemoteProtocolError as RemoteProtocolError,
    ServerError as ServerError,
    StreamReset as StreamReset,
    TransportError as TransportError,
)

__version__ = "0.1.0"

# The distributed models import torch and the client: they load on first access only, so that
# ``import petals_core`` stays light (tests/test_layering.py).
_DISTRIBUTED_MODELS = frozenset(
    {
        "AutoDistributedModel",
        "AutoDistributedModelForCausalLM",
        "AutoDistributedModelForSequenceClassification",
        "DistributedBloomForCausalLM",
        "DistributedBloomForSequenceClassification",
        "DistributedBloomModel",
        "DistributedLlamaForCausalLM",
        "DistributedLlamaForSequenceClassification",
        "DistributedLlamaModel",
    }
)


def __getattr__(name: str) -> object:
    if name in _DISTRIBUTED_MODELS:
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
