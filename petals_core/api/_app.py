"""The endpoint's HTTP face: a Starlette app answering OpenAI's routes from an :class:`Engine`.

``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions`` and
``POST /v1/chat/completions``, as plain JSON or, with ``"stream": true``, as server-sent events
of OpenAI's chunks ending with ``data: [DONE]``. Every answer counts its tokens (``usage``; in a
stream, on the last chunk, and in a chunk of its own when ``stream_options.include_usage`` asks).
A stream begins as soon as its request is accepted: its headers, and the chunk OpenAI sends
before any token (a chat's role, a completion's echo), go out before the prompt reaches the
swarm, and while no token comes a comment line every 15 s keeps proxies from closing the idle
connection.  Errors found before (the request's own, or too many waiting) are OpenAI's JSON
(``{"error": {...}}``) with its status codes; a failure after a stream began (the swarm's
included) is sent as an event of that shape, then the stream ends.

A client that stops reading its stream without closing its connection (or reads it far slower
than it is generated) is given up on once it falls :data:`~._engine.EVENTS_PER_ROW` events per
row behind (see :mod:`._engine`): its generation stops, its session closes, and what was left
for it is dropped.  Its connection stays open until the client or the operating system closes
it (the server's write to it waits as long); a client that reads again gets an error event
(``code: "slow_reader"``) and the stream's end.  A plain answer is generated whole before it is
sent, so a client that does not read it holds its connection and that answer, not the swarm.
"""

from __future__ import annotations

import functools
import json
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import attrs
import trio
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ._detokenize import text_bytes
from ._engine import EVENTS_PER_ROW, Engine, SlowReader
from ._errors import ApiError
from ._records import Chunk, Event, PromptLogprobs, TokenLogprob, Usage
from ._requests import (
    ChatRequest,
    CompletionRequest,
    parse_chat_untrusted,
    parse_completion_untrusted,
)
from ._tokenizing import Echo

__all__ = ["MAX_BODY_BYTES", "create_app"]

_Parsed = TypeVar("_Parsed")

#: Request bodies above this size are refused (413) before they are parsed.
MAX_BODY_BYTES: Final = 4 * 1024 * 1024
#: Larger bodies are parsed in the tokenizer's worker thread (one at a time with the
#: tokenizing), not on the event loop that serves every request.
_INLINE_BODY_BYTES: Final = 64 * 1024
#: Token-id prompts longer than this, in all, are checked in that thread too.
_INLINE_PROMPT_IDS: Final = 4096
# A JSON escape of a UTF-16 surrogate: only these can make a string with no UTF-8 form.
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F]")
CREATED: Final = int(time.time())
#: Seconds between the comment lines that keep an idle stream's connection busy.
_KEEPALIVE_S: Final = 15


def create_app(
    engine: Engine, *, api_key: str | None = None, allow_origins: Sequence[str] = ()
) -> Starlette:
    """The app serving ``engine``'s model under ``engine.name``; with ``api_key``, requests must
    carry ``Authorization: Bearer <api_key>``; ``allow_origins`` are web origins (or ``"*"``)
    whose pages may call it from a browser (CORS), as chat front-ends do."""
    api = _Api(engine, api_key)
    middleware = []
    if allow_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(allow_origins),
                allow_methods=["GET", "POST"],
                # Clients' SDKs add headers of their own (x-stainless-*, ...): echo what is asked.
                allow_headers=["*"],
            )
        )
    return Starlette(
        middleware=middleware,
        routes=[
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/models/{model:path}", api.model, methods=["GET"]),
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        ],
        exception_handlers={
            ApiError: _api_error_response,
            HTTPException: _http_error_response,
            ClientDisconnect: _client_left_response,
            Exception: _internal_error_response,
        },
    )


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def _http_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(
        ApiError(exc.status_code, message, code=code).body(), status_code=exc.status_code
    )


async def _client_left_response(request: Request, exc: Exception) -> Response:
    # The client hung up while its request was read: nothing failed, and nobody reads an answer.
    return Response(status_code=499)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    # The client learns that the endpoint failed, not how: the exception (a path, a peer's
    # address, ...) goes to the server's log, which Starlette re-raises it to.
    error = ApiError(500, "The endpoint failed with an internal error.")
    return JSONResponse(error.body(), status_code=500)


class _Api:
    def __init__(self, engine: Engine, api_key: str | None) -> None:
        self.engine = engine
        self.api_key = api_key

    # -- plumbing --------------------------------------------------------------------------------

    def _check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        # Header values arrive decoded as Latin-1: their bytes again, to compare with the key's
        # UTF-8 (compare_digest takes no other text than ASCII).
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            key.strip().encode("latin-1"), self.api_key.encode()
        ):
            raise ApiError(
                401,
                "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    async def _parsed(self, request: Request, parse: Callable[[Any], _Parsed]) -> _Parsed:
        """The request's body, read as JSON by ``parse`` (a large one in a worker thread)."""
        self._check_key(request)
        size = 0
        parts = []
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"The request body is larger than {MAX_BODY_BYTES} bytes.")
            parts.append(part)
        body = b"".join(parts)
        if size <= _INLINE_BODY_BYTES:
            return parse(_json(body))
        # Not counted with the requests waiting (bad input gets its 400, not a 429).
        return await trio.to_thread.run_sync(
            lambda: parse(_json(body)), limiter=self.engine.encode_limiter
        )

    def _check_model(self, model: str) -> None:
        if model != self.engine.name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist: this endpoint serves `{self.engine.name}`.",
                param="model",
                code="model_not_found",
            )

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.engine.name, "object": "model", "created": CREATED, "owned_by": "swarm"}

    # -- routes ----------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        self._check_key(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._check_key(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        parsed = await self._parsed(request, parse_completion_untrusted)
        self._check_model(parsed.model)
        engine = self.engine
        engine.check_rows(len(parsed.prompts), parsed.sampling)  # before any tokenizing

        def encode() -> tuple[list[list[int]], list[Echo] | None]:
            if not parsed.echo:
                return [engine.encode_prompt(prompt) for prompt in parsed.prompts], None
            echoed = [engine.encode_echoed(prompt) for prompt in parsed.prompts]
            return [ids for ids, _ in echoed], [echo for _, echo in echoed]

        if (
            parsed.echo
            or any(isinstance(prompt, str) for prompt in parsed.prompts)
            or sum(map(len, parsed.prompts)) > _INLINE_PROMPT_IDS
        ):
            # A long prompt takes a while to tokenize: not on the event loop, which serves all.
            prompts, echo = await engine.tokenize(encode)
        else:  # a few token ids are only checked: no need to wait for the tokenizer
            prompts, echo = encode()
        shape = _CompletionShape(parsed, len(prompts), echo, engine)
        return await self._answer(
            request, shape, prompts, "prompt", prompt_logprobs=shape.wants_prompt_logprobs
        )

    async def chat_completions(self, request: Request) -> Response:
        parsed = await self._parsed(request, parse_chat_untrusted)
        self._check_model(parsed.model)
        self.engine.check_rows(1, parsed.sampling)
        prompt = await self.engine.tokenize(
            functools.partial(self.engine.encode_chat, parsed.messages)
        )
        return await self._answer(request, _ChatShape(parsed, self.engine), [prompt], "messages")

    async def _answer(
        self,
        request: Request,
        shape: _Shape,
        prompts: Sequence[Sequence[int]],
        prompt_param: str,
        *,
        prompt_logprobs: bool = False,
    ) -> Response:
        generation = self.engine.generate(
            prompts, shape.sampling, prompt_param=prompt_param, prompt_logprobs=prompt_logprobs
        )
        if not shape.stream:
            chunks: list[Chunk] = []
            last: Usage | ApiError | None = None
            async with generation as events, trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_when_disconnected, request, nursery.cancel_scope)
                async for event in _slow_reader_as_error(events):
                    if isinstance(event, Chunk):
                        chunks.append(event)
                    elif isinstance(event, PromptLogprobs):
                        shape.take_prompt_logprobs(event)
                    else:
                        last = event
                nursery.cancel_scope.cancel()
            if isinstance(last, ApiError):
                raise last
            if last is None:  # the client left: nobody reads this answer
                return Response(status_code=499)
            return JSONResponse(shape.whole(chunks, last))
        # The stream begins now, before the prompt goes through the swarm: its headers and first
        # chunk go out at once (a slow first token would leave proxies an idle connection).
        events = _slow_reader_as_error(await generation.__aenter__())
        return _EventStream(_stream(shape, events, generation.__aexit__), generation.__aexit__)


def _json(body: bytes) -> Any:
    """A request's body as JSON; :class:`ApiError` (400) unless it is JSON in UTF-8 whose every
    string has a UTF-8 form (JSON lets a ``\\ud800`` escape stand alone)."""
    try:
        # Strict UTF-8 (json.loads would let encoded surrogates through, and UTF-16 or 32).
        value = json.loads(body.decode("utf-8"))
    except (ValueError, RecursionError):
        raise ApiError(
            400,
            "We could not parse the JSON body of your request. The body must be a JSON "
            "object encoded in UTF-8.",
        ) from None
    if _SURROGATE_ESCAPE.search(body) is not None:
        _check_unicode(value)
    return value


def _check_unicode(value: Any) -> None:
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode()
            except UnicodeEncodeError:
                raise ApiError(
                    400,
                    "The body of your request holds a string that is not valid Unicode (an "
                    "unpaired surrogate escape such as \\ud800).",
                ) from None


class _EventStream(EventSourceResponse):
    """A streamed answer that ends its generation however the response ends: after its last
    event, or when the client leaves before the stream even began."""

    def __init__(
        self,
        events: AsyncIterator[dict[str, str]],
        close: Callable[[Any, Any, Any], Awaitable[None]],
    ) -> None:
        super().__init__(events, ping=_KEEPALIVE_S)
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with trio.CancelScope(shield=True):
                await self._close(None, None, None)


async def _slow_reader_as_error(events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """``events``, ending with an error event where the reader was given up on for falling too
    far behind (:class:`~._engine.SlowReader`): a stream ends with it as with any failure."""
    try:
        async for event in events:
            yield event
    except SlowReader:
        yield ApiError(
            408,
            f"The client read its answer too slowly: it fell {EVENTS_PER_ROW} events per choice "
            "behind the generation, which was stopped.",
            code="slow_reader",
        )


async def _cancel_when_disconnected(request: Request, scope: trio.CancelScope) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


async def _stream(
    shape: _Shape,
    events: AsyncIterator[Event],
    close: Callable[[Any, Any, Any], Awaitable[None]],
) -> AsyncIterator[dict[str, str]]:
    try:
        held: dict[str, Any] | None = None
        for chunk in shape.stream_start():
            yield {"data": json.dumps(chunk)}
        async for event in events:
            if isinstance(event, PromptLogprobs):
                for chunk in shape.prompt_chunks(event):
                    yield {"data": json.dumps(chunk)}
                continue
            if isinstance(event, ApiError):
                if held is not None:
                    yield {"data": json.dumps(held)}
                yield {"data": json.dumps(event.body())}
                return
            if isinstance(event, Usage):
                if held is not None:
                    if not shape.include_usage:  # else only the usage chunk carries it
                        held["usage"] = event.to_json()
                    yield {"data": json.dumps(held)}
                if shape.include_usage:
                    yield {"data": json.dumps(shape.usage_chunk(event))}
                yield {"data": "[DONE]"}
                return
            if held is not None:
                yield {"data": json.dumps(held)}
                held = None
            if event.finish_reason is None:
                yield {"data": json.dumps(shape.chunk(event))}
            else:
                # A choice's last chunk waits for the next event: if that is the usage, it goes
                # on this chunk (every answer counts its tokens, and no chunk is left choiceless).
                held = shape.chunk(event)
        if held is not None:
            yield {"data": json.dumps(held)}
    finally:
        await close(None, None, None)


# -- answer shapes --------------------------------------------------------------------------------


class _Shape:
    """How one kind of request's answer looks, whole and streamed."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, parsed: CompletionRequest | ChatRequest, engine: Engine) -> None:
        self.sampling = parsed.sampling
        self.stream = parsed.stream
        self.include_usage = parsed.include_usage
        self.model = engine.name
        self.id = f"{self.id_prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.rows = 0  # set by the subclass

    def _head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def whole(self, chunks: Sequence[Chunk], usage: Usage) -> dict[str, Any]:
        by_row: list[list[Chunk]] = [[] for _ in range(self.rows)]
        for chunk in chunks:
            by_row[chunk.row].append(chunk)
        return {
            **self._head(self.object_name),
            "choices": [self.whole_choice(row, parts) for row, parts in enumerate(by_row)],
            "usage": usage.to_json(),
        }

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._head(self.chunk_object_name), "choices": [], "usage": usage.to_json()}

    def stream_start(self) -> list[dict[str, Any]]:
        """The chunks a stream begins with, sent once the request is accepted (before anything
        is generated)."""
        return []

    def _opening_chunk(self, content: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
        """A chunk starting every choice with ``content(row)``."""
        choices = [
            {"index": row, **content(row), "logprobs": None, "finish_reason": None}
            for row in range(self.rows)
        ]
        return {**self._head(self.chunk_object_name), "choices": choices, "usage": None}

    def take_prompt_logprobs(self, event: PromptLogprobs) -> None:
        """A prompt's tokens with their logprobs, for the whole answer."""
        raise NotImplementedError

    def prompt_chunks(self, event: PromptLogprobs) -> list[dict[str, Any]]:
        """The chunks that stream a prompt's tokens with their logprobs."""
        raise NotImplementedError

    def chunk(self, chunk: Chunk) -> dict[str, Any]:
        return {
            **self._head(self.chunk_object_name),
            "choices": [self.chunk_choice(chunk)],
            "usage": None,
        }

    def whole_choice(self, row: int, parts: Sequence[Chunk]) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_choice(self, chunk: Chunk) -> dict[str, Any]:
        raise NotImplementedError


def _finish_reason(parts: Sequence[Chunk]) -> str | None:
    reasons = [part.finish_reason for part in parts if part.finish_reason is not None]
    return reasons[-1] if reasons else None


class _CompletionShape(_Shape):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self, parsed: CompletionRequest, prompts: int, echo: list[Echo] | None, engine: Engine
    ) -> None:
        super().__init__(parsed, engine)
        self.rows = prompts * parsed.sampling.n
        self.echo = echo
        self.with_logprobs = parsed.sampling.logprobs is not None
        #: An echoed prompt comes with its tokens' logprobs when logprobs are asked.
        self.wants_prompt_logprobs = echo is not None and self.with_logprobs
        self._prompt_logprobs: dict[int, tuple[TokenLogprob, ...]] = {}

    def _prefix(self, row: int) -> str:
        return self.echo[row // self.sampling.n].text if self.echo is not None else ""

    def _placed(self, event: PromptLogprobs) -> tuple[TokenLogprob, ...]:
        """A prompt's tokens, each at its place in the echoed text."""
        starts = self.echo[event.prompt].starts if self.echo is not None else None
        if starts is None:
            return event.logprobs
        return tuple(
            attrs.evolve(token, offset=start)
            for token, start in zip(event.logprobs, starts, strict=True)
        )

    @staticmethod
    def _entries(tokens: Sequence[TokenLogprob], start: int) -> dict[str, Any]:
        """Tokens of a text that starts at ``start`` in the choice's text."""
        return {
            "tokens": [token.token for token in tokens],
            "token_logprobs": [token.logprob for token in tokens],
            "top_logprobs": [
                None if token.logprob is None else _top_by_text(token.top) for token in tokens
            ],
            "text_offset": [start + token.offset for token in tokens],
        }

    def _logprobs(self, row: int, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        return self._entries(tokens, len(self._prefix(row)))  # the answer follows the echo

    def whole_choice(self, row: int, parts: Sequence[Chunk]) -> dict[str, Any]:
        logprobs = self._logprobs(row, [t for part in parts for t in part.logprobs])
        prompt = self._prompt_logprobs.get(row // self.sampling.n)
        if logprobs is not None and prompt is not None:
            head = self._entries(prompt, 0)
            logprobs = {key: head[key] + values for key, values in logprobs.items()}
        return {
            "index": row,
            "text": self._prefix(row) + "".join(part.text for part in parts),
            "logprobs": logprobs,
            "finish_reason": _finish_reason(parts),
        }

    def stream_start(self) -> list[dict[str, Any]]:
        # The echo, unless it is sent with its logprobs once the swarm has scored it.  Without
        # one, nothing: a completion's chunks each carry a token.
        if self.echo is None or self.wants_prompt_logprobs:
            return []
        return [self._opening_chunk(lambda row: {"text": self._prefix(row)})]

    def take_prompt_logprobs(self, event: PromptLogprobs) -> None:
        self._prompt_logprobs[event.prompt] = self._placed(event)

    def prompt_chunks(self, event: PromptLogprobs) -> list[dict[str, Any]]:
        n = self.sampling.n
        logprobs = self._entries(self._placed(event), 0)
        choices = [
            {"index": row, "text": self._prefix(row), "logprobs": logprobs, "finish_reason": None}
            for row in range(event.prompt * n, (event.prompt + 1) * n)
        ]
        return [{**self._head(self.chunk_object_name), "choices": choices, "usage": None}]

    def chunk_choice(self, chunk: Chunk) -> dict[str, Any]:
        return {
            "index": chunk.row,
            "text": chunk.text,
            "logprobs": self._logprobs(chunk.row, chunk.logprobs),
            "finish_reason": chunk.finish_reason,
        }


def _top_by_text(top: Sequence[tuple[str, float]]) -> dict[str, float]:
    """The alternatives by text; tokens that decode alike keep the likeliest's log-probability."""
    merged: dict[str, float] = {}
    for text, logprob in top:
        merged[text] = max(logprob, merged.get(text, -math.inf))
    return merged


def _chat_logprob(token: TokenLogprob) -> dict[str, Any]:
    return {
        "token": token.token,
        "logprob": token.logprob,
        "bytes": list(text_bytes(token.token)),
        "top_logprobs": [
            {"token": text, "logprob": value, "bytes": list(text_bytes(text))}
            for text, value in token.top
        ],
    }


class _ChatShape(_Shape):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, parsed: ChatRequest, engine: Engine) -> None:
        super().__init__(parsed, engine)
        self.rows = parsed.sampling.n
        self.with_logprobs = parsed.sampling.logprobs is not None

    def _logprobs(self, tokens: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        # A chat answer's logprobs are its content's tokens: the end token is not content.
        content = [_chat_logprob(token) for token in tokens if not token.end]
        return {"content": content, "refusal": None}

    def whole_choice(self, row: int, parts: Sequence[Chunk]) -> dict[str, Any]:
        return {
            "index": row,
            "message": {
                "role": "assistant",
                "content": "".join(part.text for part in parts),
                "refusal": None,
            },
            "logprobs": self._logprobs([t for part in parts for t in part.logprobs]),
            "finish_reason": _finish_reason(parts),
        }

    def stream_start(self) -> list[dict[str, Any]]:
        return [self._opening_chunk(lambda row: {"delta": {"role": "assistant", "content": ""}})]

    def chunk_choice(self, chunk: Chunk) -> dict[str, Any]:
        return {
            "index": chunk.row,
            "delta": {"content": chunk.text} if chunk.text else {},
            "logprobs": (
                self._logprobs(chunk.logprobs)
                if any(not token.end for token in chunk.logprobs)
                else None
            ),
            "finish_reason": chunk.finish_reason,
        }
