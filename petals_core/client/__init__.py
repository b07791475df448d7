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

from .._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__)
