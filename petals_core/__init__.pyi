# The names petals_core exports; those of the subpackages load on first access (see
# petals_core._lazy), so that `import petals_core` loads no torch.

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
    SessionTooLarge as SessionTooLarge,
    StreamReset as StreamReset,
    TransportError as TransportError,
    WrongAnswer as WrongAnswer,
)
from .client import (
    ClientConfig as ClientConfig,
    InferenceSession as InferenceSession,
    RemoteSequenceManager as RemoteSequenceManager,
    RemoteSequential as RemoteSequential,
    SequenceManagerConfig as SequenceManagerConfig,
)
from .distributed import (
    AutoDistributedModel as AutoDistributedModel,
    AutoDistributedModelForCausalLM as AutoDistributedModelForCausalLM,
    AutoDistributedModelForSequenceClassification as AutoDistributedModelForSequenceClassification,
    AutoDistributedSpeculativeModel as AutoDistributedSpeculativeModel,
    DistributedBloomForCausalLM as DistributedBloomForCausalLM,
    DistributedBloomForSequenceClassification as DistributedBloomForSequenceClassification,
    DistributedBloomModel as DistributedBloomModel,
    DistributedFalconForCausalLM as DistributedFalconForCausalLM,
    DistributedFalconForSequenceClassification as DistributedFalconForSequenceClassification,
    DistributedFalconModel as DistributedFalconModel,
    DistributedLlamaForCausalLM as DistributedLlamaForCausalLM,
    DistributedLlamaForSequenceClassification as DistributedLlamaForSequenceClassification,
    DistributedLlamaForSpeculativeGeneration as DistributedLlamaForSpeculativeGeneration,
    DistributedLlamaModel as DistributedLlamaModel,
    DistributedMixtralForCausalLM as DistributedMixtralForCausalLM,
    DistributedMixtralForSequenceClassification as DistributedMixtralForSequenceClassification,
    DistributedMixtralModel as DistributedMixtralModel,
)
from .models import (
    AutoDistributedConfig as AutoDistributedConfig,
    DistributedBloomConfig as DistributedBloomConfig,
    DistributedFalconConfig as DistributedFalconConfig,
    DistributedLlamaConfig as DistributedLlamaConfig,
    DistributedMixtralConfig as DistributedMixtralConfig,
)

__version__: str
