# The names petals_core.client exports, each loaded on first access (see petals_core._lazy).

from ._bridge import Bridge as Bridge, bridge as bridge
from ._client_config import (
    PETALS_MANAGER_NAMES as PETALS_MANAGER_NAMES,
    ClientConfig as ClientConfig,
    with_our_names as with_our_names,
)
from ._inference import FirstStepTimes as FirstStepTimes, InferenceSession as InferenceSession
from ._remote_sequential import (
    RemoteSequential as RemoteSequential,
    SyncInferenceSession as SyncInferenceSession,
)
from ._report_judge import judge_listed as judge_listed, run_manager as run_manager
from ._reports import ReportBook as ReportBook, Verdict as Verdict, book_of as book_of
from ._sequence_manager import (
    RemoteSequenceManager as RemoteSequenceManager,
    SequenceManagerConfig as SequenceManagerConfig,
    SequenceManagerState as SequenceManagerState,
)
from ._sequential import remote_backward as remote_backward, remote_forward as remote_forward
