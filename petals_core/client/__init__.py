"""The client: routes requests through servers and survives their failures.

- :class:`RemoteSequenceManager`: which servers a client's requests go through: the model's peer
  table read by a client-mode DHT node, pings and bans, and routes from the planners of
  :mod:`petals_core.routing`; configured by :class:`SequenceManagerConfig` (or
  :class:`ClientConfig`, which also takes Petals' field names).
- :class:`InferenceSession` (async): a session over a chain of servers; a failed server is
  banned, its blocks routed anew and its history replayed, so the outputs are the same as
  without the failure.
- :func:`remote_forward` / :func:`remote_backward` (async): fine-tuning passes, retried per span.
- :class:`RemoteSequential`: the same as a PyTorch module (autograd, sync inference sessions
  through the bridge, slicing), and an ``async with`` object for trio programs.
- Fraud reports: a client publishes the signed answers of servers it caught, and judges others'
  (:func:`judge_listed`, run by :func:`run_manager` beside the sequence manager); its
  :class:`ReportBook` (:func:`book_of`) holds its :class:`Verdict` s.

Each name is imported on first use: the sans-IO state of a session (``_session_core``) imports
without trio.

Its modules: ``_client_config`` and ``_sequence_manager`` (routes, pings, bans, which answers
to check), ``_session_core`` (a session's state, I/O-free: positions, histories, step ids,
replays), ``_inference`` (the trio driver around it: failover), ``_span_call`` (one span's
stream on its server), ``_second_opinions`` (other servers' view of an answer: routes over the
same blocks, followers), ``_checks`` (receipts checked, answers compared), ``_sequential``
(forward / backward), ``_remote_sequential`` (the module), ``_bridge`` (sync -> trio),
``_placement`` (CPU copies for the wire, results back on the caller's device), ``_reports`` and
``_report_judge`` (fraud reports published, read and judged).
"""

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
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
else:
    __getattr__, __dir__, __all__ = lazy_exports(__name__)
