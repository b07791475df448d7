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
from ._lazy import lazy_exports

__version__ = "0.1.0"

# Petals' root names from the subpackages (listed in __init__.pyi) import torch or the
# network: each loads on first access, so that ``import petals_core`` stays light
# (tests/test_layering.py).
__getattr__, __dir__, __all__ = lazy_exports(__name__)
