"""The endpoint under test: SmolLM2-135M-Instruct on 2 server processes (blocks 0:15 and 15:30),
and ``serve_api`` in front of them, in one trio program on a daemon thread for the whole module.

Tests talk to it over HTTP from their own thread (the ``openai`` package, or raw requests), and
run coroutines on its loop with :meth:`Endpoint.run` (asking the servers what they hold open).
"""

from __future__ import annotations

from typing import Any

import trio

from petals_core.api import ApiConfig, Limits, RunningApi, serve_api
from petals_core.protocol import INFO, InfoReply, InfoRequest
from petals_core.testing import LocalSwarm, fixed_server_args, open_local_swarm
from petals_core.transport import call_unary, open_node

from .._trio_thread import TrioThread

START_TIMEOUT_S = 300.0
SPANS = ((0, 15), (15, 30))
#: Small enough that a test can go over it, large enough for every chat prompt here.
LIMITS = Limits(max_concurrent_requests=4, max_request_tokens=512, max_rows=4)


class Endpoint(TrioThread):
    """The swarm and the endpoint (``url``, ``engine``), until :meth:`close`."""

    def __init__(self, repo: str, **options: Any) -> None:
        super().__init__(
            "the endpoint", thread_name="test-endpoint", start_timeout_s=START_TIMEOUT_S
        )
        self.repo = repo
        self._options = options
        self.swarm: LocalSwarm | None = None
        self.api: RunningApi | None = None
        self._nursery: trio.Nursery | None = None
        self.start()

    @property
    def url(self) -> str:
        assert self.api is not None
        return self.api.urls[0]

    async def _program(self) -> None:
        assert self._stop is not None
        args = [fixed_server_args(span) for span in SPANS]
        async with open_local_swarm(self.repo, args) as swarm, trio.open_nursery() as nursery:
            self.swarm = swarm
            self._nursery = nursery
            self.api = await nursery.start(serve_api, self._config(self._options))
            self._serving()
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
        self.stop()


def post_scope(path: str) -> dict[str, Any]:
    """The ASGI scope of a JSON ``POST`` to ``path``, for tests that call the app themselves."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 1),
    }
