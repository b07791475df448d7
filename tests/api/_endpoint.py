"""The endpoint under test: SmolLM2-135M-Instruct on 2 server processes (blocks 0:15 and 15:30),
and ``serve_api`` in front of them, in one trio program on a daemon thread for the whole module.

Tests talk to it over HTTP from their own thread (the ``openai`` package, or raw requests), and
run coroutines on its loop with :meth:`Endpoint.run` (asking the servers what they hold open).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from petals_core.api import ApiConfig, Limits, RunningApi, serve_api
from petals_core.protocol import INFO, InfoReply, InfoRequest
from petals_core.testing import LocalSwarm, fixed_server_args, open_local_swarm
from petals_core.transport import call_unary, open_node

T = TypeVar("T")
START_TIMEOUT_S = 300.0
SPANS = ((0, 15), (15, 30))
#: Small enough that a test can go over it, large enough for every chat prompt here.
LIMITS = Limits(max_concurrent_requests=4, max_request_tokens=512, max_rows=4)


class Endpoint:
    """The swarm and the endpoint (``url``, ``engine``), until :meth:`close`."""

    def __init__(self, repo: str, **options: Any) -> None:
        self.repo = repo
        self._options = options
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self.swarm: LocalSwarm | None = None
        self.api: RunningApi | None = None
        self._nursery: trio.Nursery | None = None
        self._thread = threading.Thread(target=self._main, name="test-endpoint", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise TimeoutError("the endpoint did not start")
        if self._error is not None:
            raise RuntimeError("the endpoint failed to start") from self._error

    @property
    def url(self) -> str:
        assert self.api is not None
        return self.api.urls[0]

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as error:
            self._error = error
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        args = [fixed_server_args(span) for span in SPANS]
        async with open_local_swarm(self.repo, args) as swarm, trio.open_nursery() as nursery:
            self.swarm = swarm
            self._nursery = nursery
            self.api = await nursery.start(serve_api, self._config(self._options))
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _config(self, options: dict[str, Any]) -> ApiConfig:
        assert self.swarm is not None
        return ApiConfig(
            model=self.repo,
            initial_peers=tuple(self.swarm.initial_peers),
            port=0,
            limits=LIMITS,
            client_options={"local_files_only": True},
            **options,
        )

    def open_api(self, **options: Any) -> RunningApi:
        """Another endpoint in front of the same swarm, with these :class:`ApiConfig` options,
        until :meth:`close`."""
        return self.run(self._open_api, options)

    async def _open_api(self, options: dict[str, Any]) -> RunningApi:
        assert self._nursery is not None
        api: RunningApi = await self._nursery.start(serve_api, self._config(options))
        return api

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on the endpoint's loop, from a test's thread."""
        assert self._token is not None
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def server_infos(self) -> list[InfoReply]:
        """What each server process says it holds now."""
        return self.run(self._server_infos)

    async def _server_infos(self) -> list[InfoReply]:
        assert self.swarm is not None
        replies = []
        async with open_node(host="127.0.0.1") as node:
            for server in self.swarm.servers:
                connection = await node.connect(server.address)
                reply = await call_unary(connection, INFO, InfoRequest().to_wire())
                replies.append(InfoReply.from_wire_untrusted(reply))
        return replies

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(START_TIMEOUT_S)
