"""Bad, hostile and unanswerable requests get OpenAI-shaped errors, and the endpoint serves on."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import urllib.parse
from typing import Any

import openai
import pytest
import trio
from hypothesis import HealthCheck, given, settings, strategies as st

from petals_core._http import serve_http
from petals_core.api import MAX_BODY_BYTES, ApiConfig, create_app, serve_api
from petals_core.api._engine import _api_error
from petals_core.api._requests import _CHAT, _COMPLETION

from ._endpoint import LIMITS, post_scope

CHAT = [{"role": "user", "content": "Hi"}]


def _post(url: str, path: str, body: bytes, method: str = "POST") -> tuple[int, Any]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request(method, path, body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        data = reply.read()
        if reply.getheader("content-type", "").startswith("text/event-stream"):
            events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" or "error" in json.loads(events[-1]), events[-1]
            return reply.status, None
        return reply.status, json.loads(data) if data else None
    finally:
        connection.close()


def _error(status: int, body: Any, expected_status: int) -> dict[str, Any]:
    assert status == expected_status, body
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def _still_serving(endpoint: Any) -> None:
    status, body = _post(endpoint.url, "/v1/models", b"", method="GET")
    assert status == 200 and body["data"][0]["id"] == endpoint.repo


def test_openai_client_errors(endpoint: Any, client: Any) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(model=endpoint.repo, messages=CHAT, max_tokens=10**6)
    assert too_long.value.code == "context_length_exceeded"
    assert f"maximum context length is {LIMITS.max_request_tokens}" in str(too_long.value)
    with pytest.raises(openai.BadRequestError, match="at most 4 choices"):
        client.chat.completions.create(model=endpoint.repo, messages=CHAT, n=5)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=endpoint.repo, messages=CHAT, temperature=3)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=endpoint.repo, messages=CHAT, temperature=10**400)
    with pytest.raises(openai.BadRequestError, match="frequency_penalty is not supported"):
        client.chat.completions.create(model=endpoint.repo, messages=CHAT, frequency_penalty=0.5)
    _still_serving(endpoint)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"not json", 400, None),
        (b"\xff\xfe", 400, None),
        (b"[1, 2]", 400, None),
        (b"[" * 100_000 + b"]" * 100_000, 400, None),
        (b'{"messages": [{"role": "user", "content": "Hi"}]}', 400, "model"),
        (b'{"model": "M"}', 400, "messages"),
        (b'{"model": "M", "messages": []}', 400, "messages"),
        (b'{"model": "M", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "nope": 1}', 400, "nope"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "n": true}', 400, "n"),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
            400,
            "top_p",
        ),
        (b'{"model": "M", "messages": [{"role": ["user"], "content": "x"}]}', 400, "messages"),
        (b'{"model": "M", "messages": [{"role": {}, "content": "x"}]}', 400, "messages"),
        # JSON lets a surrogate escape stand alone: a string with no UTF-8 form.
        (b'{"model": "M", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None),
        (b'{"model": "\\udfff", "messages": [{"role": "user", "content": "x"}]}', 400, None),
        # The same surrogate encoded as bytes (not UTF-8), and a body in UTF-16.
        (b'{"model": "M", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}', 400, None),
        (
            '{"model": "M", "messages": [{"role": "user", "content": "x"}]}'.encode("utf-16"),
            400,
            None,
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "\\ud800": 1}',
            400,
            None,
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], '
            b'"max_completion_tokens": 5, "max_tokens": "abc"}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "stream": true, '
            b'"stream_options": {"include_obfuscation": 3}}',
            400,
            "include_obfuscation",
        ),
    ],
)
def test_malformed_bodies(endpoint: Any, body: bytes, status: int, param: str | None) -> None:
    body = body.replace(b'"M"', json.dumps(endpoint.repo).encode())
    got, answer = _post(endpoint.url, "/v1/chat/completions", body)
    assert _error(got, answer, status)["param"] == param


def test_a_prompt_far_over_the_context_is_refused_before_tokenizing(endpoint: Any) -> None:
    engine = endpoint.api.engine
    huge = "word " * (MAX_BODY_BYTES // 5 - 100)
    # Refused without waiting for the tokenizer, which is held here.
    with engine._encoder_lock:
        for path, body in (
            ("/v1/completions", {"model": endpoint.repo, "prompt": huge}),
            (
                "/v1/chat/completions",
                {
                    "model": endpoint.repo,
                    "messages": [{"role": "user", "content": huge}],
                },
            ),
            (  # each message is a token at least: refused before the template is rendered
                "/v1/chat/completions",
                {
                    "model": endpoint.repo,
                    "messages": [{"role": "user", "content": ""}] * (LIMITS.max_request_tokens + 1),
                },
            ),
        ):
            status, answer = _post(endpoint.url, path, json.dumps(body).encode())
            error = _error(status, answer, 400)
            assert error["code"] == "context_length_exceeded"
            assert error["param"] == ("prompt" if "prompt" in body else "messages")
            assert f"maximum context length is {LIMITS.max_request_tokens}" in error["message"]
    # A prompt just over the context is counted in tokens, and blamed, not max_tokens.
    status, answer = _post(
        endpoint.url,
        "/v1/completions",
        json.dumps({"model": endpoint.repo, "prompt": "word " * 600, "max_tokens": 4}).encode(),
    )
    error = _error(status, answer, 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "in the prompt, 4 in the completion" in error["message"]
    _still_serving(endpoint)


def test_routes_methods_and_sizes(endpoint: Any) -> None:
    assert _error(*_post(endpoint.url, "/v1/nothing", b"{}"), 404)["code"] == "not_found"
    status, body = _post(endpoint.url, "/v1/chat/completions", b"", method="GET")
    assert _error(status, body, 405)["code"] == "method_not_allowed"
    huge = json.dumps({"model": endpoint.repo, "prompt": "x" * MAX_BODY_BYTES}).encode()
    _error(*_post(endpoint.url, "/v1/completions", huge), 413)
    bad_ids = json.dumps({"model": endpoint.repo, "prompt": [10**9]}).encode()
    assert _error(*_post(endpoint.url, "/v1/completions", bad_ids), 400)["param"] == "prompt"
    _still_serving(endpoint)


def test_large_bodies_are_read_in_a_worker_with_the_same_checks(endpoint: Any) -> None:
    ids = json.dumps({"model": endpoint.repo, "prompt": [1] * 300_000, "max_tokens": 1})
    error = _error(*_post(endpoint.url, "/v1/completions", ids.encode()), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    unpaired = {"model": endpoint.repo, "prompt": "x\ud800", "user": "y" * 100_000}
    error = _error(*_post(endpoint.url, "/v1/completions", json.dumps(unpaired).encode()), 400)
    assert "not valid Unicode" in error["message"]
    _still_serving(endpoint)


def test_keys_are_compared_as_the_bytes_sent(endpoint: Any) -> None:
    """A key beyond ASCII matches when its UTF-8 bytes are sent; other bytes are refused (401),
    not a failure of the endpoint."""

    def get(url: str, key: bytes) -> int:
        parts = urllib.parse.urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        try:
            connection.putrequest("GET", "/v1/models")
            connection.putheader("Authorization", b"Bearer " + key)
            connection.endheaders()
            reply = connection.getresponse()
            reply.read()
            return reply.status
        finally:
            connection.close()

    async def ask() -> list[int]:
        app = create_app(endpoint.api.engine, api_key="clé")
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_http(
                    app, host="127.0.0.1", port=0, task_status=task_status
                )
            )
            statuses = [
                await trio.to_thread.run_sync(get, urls[0], key)
                for key in ("clé".encode(), "é".encode("latin-1"), b"cl", "clé".encode("latin-1"))
            ]
            nursery.cancel_scope.cancel()
        return statuses

    assert endpoint.run(ask) == [200, 401, 401, 401]


def test_no_server_for_the_blocks_is_a_503(endpoint: Any) -> None:
    """An endpoint whose swarm name nobody serves answers 503 after the client's bounded wait."""

    async def ask() -> tuple[int, Any]:
        config = ApiConfig(
            model=endpoint.repo,
            initial_peers=tuple(endpoint.swarm.initial_peers),
            port=0,
            client_options={
                "local_files_only": True,
                "dht_prefix": "nobody-serves-this",
                "missing_blocks_timeout_s": 1.0,
            },
        )
        async with trio.open_nursery() as nursery:
            api = await nursery.start(serve_api, config)
            body = json.dumps({"model": endpoint.repo, "messages": CHAT}).encode()
            with trio.fail_after(60):
                answer = await trio.to_thread.run_sync(
                    _post, api.urls[0], "/v1/chat/completions", body
                )
            nursery.cancel_scope.cancel()
        return answer

    error = _error(*endpoint.run(ask), 503)
    assert error["code"] == "missing_blocks"
    assert "nobody-serves-this" in error["message"]
    _still_serving(endpoint)


def test_prompts_of_different_lengths_for_trainable_prompts_are_a_400_before_any_stream(
    endpoint: Any,
) -> None:
    """A model with trainable prompts takes the prompts of one request only of one length: a
    request of several lengths is refused with a 400, streamed or not (before any stream
    begins), and one of one length is answered."""

    async def ask() -> list[tuple[int, Any]]:
        config = ApiConfig(
            model=endpoint.repo,
            initial_peers=tuple(endpoint.swarm.initial_peers),
            port=0,
            client_options={"local_files_only": True, "tuning_mode": "ptune", "pre_seq_len": 2},
        )
        answers = []
        async with trio.open_nursery() as nursery:
            api = await nursery.start(serve_api, config)
            unequal = ["Hello", "Hello there, friend"]
            for prompt, stream in ((unequal, False), (unequal, True), (["Hi", "Hi"], True)):
                body = {"model": endpoint.repo, "prompt": prompt, "max_tokens": 1}
                with trio.fail_after(60):
                    answers.append(
                        await trio.to_thread.run_sync(
                            _post,
                            api.urls[0],
                            "/v1/completions",
                            json.dumps({**body, "stream": stream}).encode(),
                        )
                    )
            nursery.cancel_scope.cancel()
        return answers

    unequal, unequal_streamed, equal = endpoint.run(ask)
    for answer in (unequal, unequal_streamed):
        error = _error(*answer, 400)
        assert error["param"] == "prompt"
        assert "the same number of tokens" in error["message"]
    assert equal == (200, None)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = sorted(_CHAT | _COMPLETION)


@st.composite
def _hostile(draw: st.DrawFn, repo: str) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(st.binary(max_size=64))
    body: dict[str, Any] = {"model": repo, "max_tokens": 2}
    if path == "/v1/completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = [{"role": "user", "content": "Hello"}]
    for field in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3, unique=True)):
        body[field] = draw(_JSON)
    # A length limit is always given, hostile or not, so that an answer stays short (without one
    # a chat answer may run to the endpoint's limit).
    limits = st.integers(-3, 2) | st.integers() | st.floats() | st.text(max_size=3) | st.booleans()
    chat = path == "/v1/chat/completions"
    for field in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        value = body.get(field)
        if value is None:
            value = body[field] = draw(limits)
        if _is_length(value) and 2 < value <= LIMITS.max_request_tokens:
            body[field] = 2  # a length the endpoint would honour: keep the answer short
    return path, json.dumps(body).encode()


def _is_length(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def test_hostile_requests_get_errors_and_the_endpoint_keeps_serving(endpoint: Any) -> None:
    @settings(
        max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    @given(request=_hostile(endpoint.repo))
    def check(request: tuple[str, bytes]) -> None:
        path, body = request
        status, answer = _post(endpoint.url, path, body)
        statuses.append(status)
        if status == 200:
            if answer is None:  # a stream: its events came and went
                return
            usage = answer["usage"]
            assert usage["completion_tokens"] <= 2 * len(answer["choices"])
            assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
            assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        else:
            assert 400 <= status < 500, answer
            _error(status, answer, status)

    statuses: list[int] = []
    check()
    assert 400 in statuses
    _still_serving(endpoint)
    assert endpoint.api.engine.running == 0


def test_a_client_leaving_mid_upload_is_no_error(
    endpoint: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that hangs up while its body is still coming in left: nothing failed, so the
    app ends without an error and the server logs none."""
    ended: list[BaseException | None] = []

    def leave_mid_upload(url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
                + json.dumps({"model": endpoint.repo, "messages": CHAT}).encode()[:20]
            )

    async def serve() -> None:
        app = create_app(endpoint.api.engine)
        done = trio.Event()

        async def watched(scope: Any, receive: Any, send: Any) -> None:
            # The app as served, noting how its call for the request ended.
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            try:
                await app(scope, receive, send)
            except BaseException as exc:
                ended.append(exc)
                raise
            else:
                ended.append(None)
            finally:
                done.set()

        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                lambda task_status: serve_http(
                    watched, host="127.0.0.1", port=0, task_status=task_status
                )
            )
            await trio.to_thread.run_sync(leave_mid_upload, urls[0])
            with trio.fail_after(60):
                await done.wait()
            nursery.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING):
        endpoint.run(serve)
    assert ended == [None]
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
    _still_serving(endpoint)


def test_an_internal_error_tells_the_client_nothing_of_its_details(endpoint: Any) -> None:
    """An unexpected failure is a 500 saying so; what failed and where stays in the log."""
    secret = "/srv/secret/weights.bin: connection to 10.1.2.3 refused"
    sent: list[dict[str, Any]] = []
    scope = post_scope("/v1/chat/completions")

    async def receive() -> dict[str, Any]:
        raise RuntimeError(secret)  # the server fails under the app

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def call() -> None:
        with pytest.raises(RuntimeError, match="secret"):  # re-raised for the server to log
            await create_app(endpoint.api.engine)(scope, receive, send)

    endpoint.run(call)
    assert sent[0]["status"] == 500
    body = b"".join(message.get("body", b"") for message in sent[1:])
    error = _error(500, json.loads(body), 500)
    assert "internal error" in error["message"]
    assert "secret" not in body.decode() and "RuntimeError" not in body.decode()
    # A generation's own failure reads the same way.
    failed = _api_error(RuntimeError(secret))
    assert failed.status == 500 and "secret" not in json.dumps(failed.body())
