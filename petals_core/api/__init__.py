"""An OpenAI-compatible HTTP endpoint in front of a swarm: ``python -m petals_core.api``.

``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's
chat template), plain JSON or streamed as server-sent events, for curl, the ``openai`` package
and anything that speaks OpenAI's API. Each request is one ``generate()`` of the distributed
model in one inference session; concurrent requests are concurrent sessions, which the servers
batch. A client that disconnects stops its generation, which frees the servers' caches.

In a trio program, :func:`serve_api` runs the whole endpoint; :class:`Engine` and
:func:`create_app` put it together around a model you already hold.

Its modules: ``_requests`` (bodies read into checked records), ``_records`` (limits and what a
request yields), ``_tokenizing`` (prompts and chats to tokens), ``_job`` (a request's state,
I/O-free: tokens in, chunks out; stop sequences, ``max_tokens``, logprobs), ``_sampling``
(choosing tokens: greedy, seeded temperature and top-p, drafts kept), ``_lineup`` (decode steps
lined up across requests), ``_engine`` (a session and a task per request), ``_detokenize``,
``_speculative`` (prompt lookup), ``_app`` (routes, JSON and server-sent events, OpenAI-shaped
errors), ``_serve`` (model, swarm client and HTTP in one trio program).
"""

from .._extras import require
from .._lazy import lazy_exports

require("http", "the OpenAI endpoint (petals_core.api)")

__getattr__, __dir__, __all__ = lazy_exports(__name__)
