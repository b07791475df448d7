"""Hostile-input fuzzing of the block RPCs: hypothesis drives every RPC of a real server.

One in-process server (the tiny LLaMA of ``conftest.server_llama``, blocks 0:6, a small attention
cache) runs in a trio loop on a background thread, next to one raw client node.  Hypothesis runs
in the calling thread and sends each example into that loop with ``trio.from_thread.run``.  Each
example opens fresh calls and sends something hostile (raw bytes, malformed frames, refused
openings, bad steps, bad tensor transfers, duplicate sessions, abandoned streams...).

What must hold for every example (a failure is shrunk by hypothesis to a minimal input):

- every call ends within :data:`EXAMPLE_TIMEOUT_S` (never a hang);
- a refused call ends with an error frame (``RemoteError``) whose type is one of
  :data:`CLEAR_ERRORS` -- never a stray ``KeyError``/``IndexError``, never a bare reset -- and the
  server logs no error (a handler crash is logged by the transport);
- where the input is valid by the documented protocol the call succeeds and the reply has the
  right shape (NaN and infinite values are valid: they are computed, and only their own session
  sees them);
- afterwards the cache budget is back at its baseline and only the canary session is open; the
  canary, a session opened once at the start, returns exactly (bit for bit) its first result for
  the same step (rolled back with ``start_from_position`` so that its cached positions are read,
  not recomputed): no example touched another session's cache.  Steps of examples also run
  concurrently with a canary step (so that they may share a batch), checked within 1e-5.

:func:`run_fuzz` runs it at any size and returns a :class:`FuzzReport` (outcome counts and the
process RSS before and after).

The parts: ``_wire`` (tensors, frames, the raw client call), ``_harness`` (the canary and the
checks), ``_cases`` (each kind of example and what its answer must be), ``_strategies``
(hypothesis' draws of them), ``_run`` (the server thread and the hypothesis runs).
"""

from ._run import FuzzReport as FuzzReport, run_fuzz as run_fuzz
from ._strategies import cases as cases
from ._wire import CLEAR_ERRORS as CLEAR_ERRORS, RawCall as RawCall
