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
    MissingBlocksError as MissingBlocksError,
    MissingExtra as MissingExtra,
    NetworkError as NetworkError,
    PeerUnreachable as PeerUnreachable,
    PetalsError as PetalsError,
    ProtocolError as ProtocolError,
    ReceiptError as ReceiptError,
    RemoteError as RemoteError,
    RemoteProtocolError as RemoteProtocolError,
    ReportRefused as ReportRefused,
    ServerError as ServerError,
    StreamReset as StreamReset,
    TransportError as TransportError,
    WrongAnswer as WrongAnswer,
)

__version__ = "0.1.0"

# Petals' root names. They import torch or the network: each loads on first access, so that
# ``import petals_core`` stays light (tests/test_layering.py).
_LAZY = {
    **dict.fromkeys(
        (
            "AutoDistributedModel",
            "AutoDistributedModelForCausalLM",
            "AutoDistributedModelForSequenceClassification",
            "AutoDistributedSpeculativeModel",
            "DistributedLlamaForSpeculativeGeneration",
            "DistributedBloomForCausalLM",
            "DistributedBloomForSequenceClassification",
            "DistributedBloomModel",
            "DistributedFalconForCausalLM",
            "DistributedFalconForSequenceClassification",
            "DistributedFalconModel",
            "DistributedLlamaForCausalLM",
            "DistributedLlamaForSequenceClassification",
            "DistributedLlamaModel",
            "DistributedMixtralForCausalLM",
            "DistributedMixtralForSequenceClassification",
            "DistributedMixtralModel",
        ),
        "distributed",
    ),
    **dict.fromkeys(
        (
            "AutoDistributedConfig",
            "DistributedBloomConfig",
            "DistributedFalconConfig",
            "DistributedLlamaConfig",
            "DistributedMixtralConfig",
        ),
        "models",
    ),
    **dict.fromkeys(
        (
            "ClientConfig",
            "InferenceSession",
            "RemoteSequenceManager",
            "RemoteSequential",
            "SequenceManagerConfig",
        ),
        "client",
    ),
}


def __getattr__(name: str) -> object:
    package = _LAZY.get(name)
    if package is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{package}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
