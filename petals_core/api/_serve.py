"""Running the endpoint in a trio program: the model, its swarm client and the HTTP server."""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from .._http import serve_http
from ._app import create_app
from ._engine import Engine
from ._records import Limits
from ._speculative import PROMPT_LOOKUP_NUM_TOKENS, check_speculative

__all__ = ["ApiConfig", "RunningApi", "serve_api"]

logger = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class ApiConfig:
    """An endpoint for ``model`` (a Hugging Face repo id or a local checkpoint) through the swarm
    at ``initial_peers``, named ``served_name`` (default: ``model``) in requests and answers.

    ``client_options`` go to ``AutoDistributedModelForCausalLM.from_pretrained`` (``dht_prefix``,
    ``request_timeout``, ``torch_dtype``, ``local_files_only``, ...); ``device`` is where the
    client's own layers (embeddings, LM head) run, e.g. ``"cuda"``; ``api_key`` makes requests
    carry ``Authorization: Bearer <api_key>``; ``allow_origins`` lets pages of those web origins
    (or ``"*"``) call it from a browser; ``decode_groups``, ``speculative`` (``"prompt_lookup"``
    or None) and ``prompt_lookup_num_tokens``: see :class:`Engine`."""

    model: str
    initial_peers: tuple[str, ...] = attrs.field(converter=tuple)
    served_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    limits: Limits = attrs.field(factory=Limits)
    api_key: str | None = None
    device: str | None = None
    allow_origins: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    decode_groups: int = 1
    speculative: str | None = None
    prompt_lookup_num_tokens: int = PROMPT_LOOKUP_NUM_TOKENS
    client_options: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        check_speculative(self.speculative, self.prompt_lookup_num_tokens)

    @property
    def name(self) -> str:
        return self.served_name or self.model


@attrs.frozen
class RunningApi:
    """What :func:`serve_api` reports once it serves: its URLs and its engine."""

    urls: list[str]
    engine: Engine


def load_model(config: ApiConfig) -> tuple[Any, Any]:
    """The distributed causal LM and its tokenizer (blocking: run it in a worker thread)."""
    from transformers import AutoTokenizer

    from ..distributed import AutoDistributedModelForCausalLM

    options = dict(config.client_options)
    model = AutoDistributedModelForCausalLM.from_pretrained(
        config.model, initial_peers=list(config.initial_peers), **options
    ).eval()
    if config.device is not None:
        model = model.to(config.device)
    tokenizer_options = {
        key: options[key] for key in ("local_files_only", "revision", "token") if key in options
    }
    tokenizer = AutoTokenizer.from_pretrained(config.model, **tokenizer_options)
    return model, tokenizer


async def serve_api(
    config: ApiConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[RunningApi] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the endpoint until cancelled or until ``shutdown_trigger`` returns: load the model,
    run its swarm client in this program, and answer HTTP on ``config.host``:``config.port``.

    ``task_status.started`` gets a :class:`RunningApi` once requests are answered."""
    model, tokenizer = await trio.to_thread.run_sync(load_model, config)
    async with model.distributed_base.remote_blocks, trio.open_nursery() as nursery:
        engine = Engine(
            model,
            tokenizer,
            name=config.name,
            limits=config.limits,
            nursery=nursery,
            decode_groups=config.decode_groups,
            speculative=config.speculative,
            prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
        )
        app = create_app(engine, api_key=config.api_key, allow_origins=config.allow_origins)
        urls = await nursery.start(
            functools.partial(
                serve_http,
                app,
                host=config.host,
                port=config.port,
                shutdown_trigger=shutdown_trigger,
            )
        )
        task_status.started(RunningApi(urls, engine))
