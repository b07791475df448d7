"""Server-to-server inference: each server pushes its output to the next server of the route.

Real in-process servers in one swarm.  The outputs must equal local blocks whichever way the
steps travel; the servers' statistics tell which way they went.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
import trio

from petals_core import RemoteError
from petals_core._errors import PeerUnreachable
from petals_core.client import InferenceSession, RemoteSequential
from petals_core.dht import NodeID, ServerInfo
from petals_core.protocol import INFERENCE, PUSH, PUSH_GRANTS, PUSH_KEY_BYTES, push_grant
from petals_core.server import Server, ServingLimits
from petals_core.testing import DelayRelay, Pipe
from petals_core.transport import (
    Call,
    CallEnded,
    Connection,
    Handlers,
    Identity,
    Multiaddr,
    ServerCall,
    TransportConfig,
    open_call,
    open_node,
    serve_rpc,
)

from ..dht._swarm import wait_until
from ._swarm_helpers import (
    DEADLINE_S,
    HIDDEN,
    Model,
    _newer_than,
    assert_close,
    in_process_swarm,
    manager_for,
)


async def servers_know_each_other(servers: list[Server]) -> None:
    """Wait until every server's peer table has every other server's address, and its first
    whole read of the DHT is over (the table fills as nodes answer, before the read ends)."""
    for server in servers:
        await wait_until(lambda topic=server.topic: topic.refreshes >= 1)
        for other in servers:
            peer = str(other.dht.peer_id)
            while other is not server and server.topic.address_of(peer) is None:
                version = server.topic.snapshot().version
                await server.topic.wait_snapshot(_newer_than(version))


def pushed_steps(server: Server) -> int:
    return server.block_server.statistics().pushed_steps


async def run_session(
    session: InferenceSession,
    model: Model,
    steps: list[torch.Tensor],
    *,
    done: Sequence[torch.Tensor] = (),
) -> None:
    """Steps through ``session`` (after the steps ``done``), each compared with the local blocks
    over all inputs so far."""
    inputs: torch.Tensor | None = torch.cat(list(done), dim=1) if done else None
    for x in steps:
        position = 0 if inputs is None else inputs.shape[1]
        inputs = x if inputs is None else torch.cat([inputs, x], dim=1)
        with torch.no_grad():
            expected = model.forward(inputs)[:, position:]
        assert_close(await session.step(x), expected)


async def push_streams_reach(servers: list[Server], counts: list[int]) -> None:
    """Wait until each server has opened ``counts`` push streams in all (they are dialled in the
    background; callers bound this with a trio deadline)."""
    for server, count in zip(servers, counts, strict=True):
        await server.block_server.wait_statistics(lambda s, n=count: s.push_streams >= n)


async def test_steps_go_server_to_server_and_equal_local(model: Model, tmp_path: Path) -> None:
    torch.manual_seed(3)
    steps = [torch.randn(2, 4, HIDDEN)] + [torch.randn(2, 1, HIDDEN) for _ in range(6)]
    async with in_process_swarm(model, tmp_path, [(0, 2), (2, 4), (4, 6)]) as swarm:
        servers = list(swarm.servers.values())
        with trio.fail_after(DEADLINE_S):
            for server_to_server in (True, False):
                before = [pushed_steps(server) for server in servers]
                manager = manager_for(servers, use_server_to_server=server_to_server)
                async with (
                    RemoteSequential(manager) as seq,
                    seq.open_inference_session(max_length=16) as session,
                ):
                    # The push streams are dialled as the first step arrives, while it computes:
                    # it is pushed if they are open in time (a dial delays a step by at most a
                    # few milliseconds; else we send it on); every later one server to server.
                    await run_session(session, model, steps[:1])
                    if server_to_server:
                        await push_streams_reach(servers, [1, 1, 0])
                    await run_session(session, model, steps[1:], done=steps[:1])
                    assert [(s.start, s.end) for s in session.route] == [(0, 2), (2, 4), (4, 6)]
                    assert session.retries == 0
                pushed = [
                    pushed_steps(server) - b for server, b in zip(servers, before, strict=True)
                ]
                later = len(steps) - 1
                if server_to_server:
                    assert pushed[0] == 0 and all(later <= p <= later + 1 for p in pushed[1:])
                else:
                    assert pushed == [0, 0, 0]
                statistics = [server.block_server.statistics() for server in servers]
                assert [s.push_streams for s in statistics] == [1, 1, 0]
                assert [s.push_dial_failures for s in statistics] == [0, 0, 0]


@pytest.mark.parametrize(
    ("altered", "form"),
    [(None, None), (0, None), (1, None), (1, PUSH_GRANTS + 1)],
    ids=["all-current", "first-older", "last-older", "last-other-form"],
)
async def test_steps_go_server_to_server_only_where_every_server_knows_the_grants(
    model: Model,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    altered: int | None,
    form: int | None,
) -> None:
    """A server from before push grants (its announcement says nothing of them) would drop the
    grants of the servers after it, and those would refuse its pushes; one of another form of
    grants would refuse ours.  A route through either sends each step to every server itself;
    a route of servers that all announce this client's form goes server to server."""
    torch.manual_seed(12)
    steps = [torch.randn(1, 3, HIDDEN)] + [torch.randn(1, 1, HIDDEN) for _ in range(4)]
    announce = Server.info

    def info(server: Server) -> ServerInfo:
        announced = announce(server)
        is_altered = altered is not None and server.blocks is not None
        if is_altered and server.blocks.start == 3 * altered:  # type: ignore[union-attr]
            return attrs.evolve(announced, push_grants=form)
        return announced

    monkeypatch.setattr(Server, "info", info)
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        first, second = swarm.servers.values()
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for([first, second])) as seq,
                seq.open_inference_session(max_length=16) as session,
            ):
                await run_session(session, model, steps[:1])
                if altered is None:
                    await push_streams_reach([first], [1])
                await run_session(session, model, steps[1:], done=steps[:1])
                assert session.retries == 0
        statistics = second.block_server.statistics()
        if altered is None:
            assert statistics.pushed_steps >= len(steps) - 1
        else:
            assert first.block_server.statistics().push_streams == 0
            assert statistics.pushed_steps == 0
        assert statistics.refused_pushes == 0


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_servers_behind_port_forwarding_are_reached_only_where_they_announce(
    model: Model, tmp_path: Path
) -> None:
    """Each server listens on one port and announces the relay's (``announce_port``), as behind
    a router: the client's steps, the servers' pushes and the DHT all go through the relay."""
    torch.manual_seed(4)
    steps = [torch.randn(1, 3, HIDDEN)] + [torch.randn(1, 1, HIDDEN) for _ in range(4)]
    ports = [_free_udp_port(), _free_udp_port()]
    with DelayRelay(ports) as relay:
        relay.set_link(Pipe(latency_s=0.005))
        async with in_process_swarm(model, tmp_path, []) as swarm:
            with trio.fail_after(DEADLINE_S):
                for span, port, outside in zip([(0, 3), (3, 6)], ports, relay.ports, strict=True):
                    await swarm.add(span, port=port, announce_port=outside)
                servers = list(swarm.servers.values())
                await servers_know_each_other(servers)
                # The second asks as a DHT client until a peer dialled it back; from its next
                # announcement on, it gives its address.
                assert servers[1].reach is not None
                await servers[1].reach.wait_checked()
                await servers[1].wait_announcements(1)
                manager = manager_for(servers)
                async with (
                    RemoteSequential(manager) as seq,
                    seq.open_inference_session(max_length=16) as session,
                ):
                    await run_session(session, model, steps[:1])
                    await push_streams_reach(servers, [1, 0])
                    await run_session(session, model, steps[1:], done=steps[:1])
                    for server in servers:
                        connection = await manager.connect(str(server.dht.peer_id))
                        assert connection.address[1] in relay.ports
                assert session.retries == 0
                # Every step after the first pushed; the first too if its stream opened in time.
                assert len(steps) - 1 <= pushed_steps(servers[1]) <= len(steps)
                first, second = servers
                contact = first.dht.routing_table.get(NodeID.from_peer_id(second.dht.peer_id))
                assert contact is not None
                assert Multiaddr.parse(contact.address).port == relay.ports[1]
        assert relay.stats().forwarded > 0


#: A receiving peer that lets a stream have this much unread: a push's send then lasts about as
#: long as its bytes take to cross (with the default window, all but the last 4 MiB).
_SMALL_WINDOW = TransportConfig(stream_window_bytes=64 << 10)


async def test_a_push_over_a_slow_link_waits_as_long_as_its_bytes_need(
    model: Model, tmp_path: Path
) -> None:
    """The second server is reached through a link of 320 KiB/s (the first joins the swarm
    through it, so that every datagram between them crosses it): pushing it a prefill of 1 MiB
    takes about 3 s, longer than a push's fixed wait, and within what its bytes allow.  It is
    pushed, and so are the steps after it."""
    torch.manual_seed(8)
    steps = [torch.randn(1, 3, HIDDEN), torch.randn(1, 4096, HIDDEN), torch.randn(1, 1, HIDDEN)]
    port = _free_udp_port()
    with DelayRelay([port]) as relay:
        async with in_process_swarm(model, tmp_path, []) as swarm:
            with trio.fail_after(DEADLINE_S):
                second = await swarm.add(
                    (3, 6), port=port, announce_port=relay.ports[0], transport=_SMALL_WINDOW
                )
                first = await swarm.add((0, 3))
                await servers_know_each_other([first, second])
                async with (
                    RemoteSequential(manager_for([first, second])) as seq,
                    seq.open_inference_session(max_length=4100) as session,
                ):
                    await run_session(session, model, steps[:1])
                    await push_streams_reach([first, second], [1, 0])
                    pushed = pushed_steps(second)
                    relay.set_link(
                        Pipe(latency_s=0.005), bytes_per_s=320 << 10, queue_bytes=256 << 10
                    )
                    await run_session(session, model, steps[1:], done=steps[:1])
                    assert session.retries == 0
                assert pushed_steps(second) == pushed + 2
                assert first.block_server.statistics().push_failures == 0
        assert relay.stats().forwarded > (2 << 20) // 16384  # the prefill, there and back


async def test_a_push_the_next_server_does_not_take_in_time_is_given_up(
    model: Model, tmp_path: Path
) -> None:
    """The next "server" takes the push stream's header and reads no more.  A step of 128 KiB
    waits for it the fixed 2 s plus its bytes at 256 KiB/s, and is answered unpushed; the
    push stream is reset (the part of the step sent is never taken for a whole one), and the
    session pushes no more there."""
    torch.manual_seed(9)
    ended = trio.Event()

    async def take_the_header_only(call: ServerCall) -> None:
        await call.receive()
        try:
            await trio.sleep_forever()  # a peer that stalls: what it is sent stays unread
        finally:
            ended.set()  # (the stream was reset: its handler is cancelled)

    handlers = Handlers()
    handlers.add_stream(PUSH, take_the_header_only)
    async with (
        _one_server(model, tmp_path) as (server, connection),
        open_node(config=_SMALL_WINDOW) as stalled,
        open_node() as dialler,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_rpc, stalled, handlers)

        async def dial(peer_id: str) -> Connection:
            return await dialler.connect(stalled.listen_multiaddr)

        server.block_server.connect_peer = dial
        async with open_call(connection, INFERENCE) as call:
            opening = {"session_id": os.urandom(8).hex(), "blocks": [0, 6], "max_length": 600}
            await call.send(opening)
            assert (await call.receive())["ready"] is True
            push = [{"peer": "stalled", "session_id": "next"}]
            # The first step starts the dial; the second finds the stream open; the third
            # fills what the next peer lets one stream have unread, and more.
            for step_id, tokens in enumerate([0, 1, 512, 1], start=1):
                hidden = torch.randn(1, tokens, HIDDEN)
                started = trio.current_time()
                await call.send({"hidden_states": hidden, "step_id": step_id, "push": push})
                answer = await call.receive()
                waited = trio.current_time() - started
                assert answer["step_id"] == step_id
                if step_id == 1:
                    await push_streams_reach([server], [1])
                    continue
                assert answer["pushed"] is (step_id == 2)
                if step_id == 3:
                    assert waited >= 2.0 + hidden.nbytes / (256 << 10)
                    await ended.wait()  # while the session is open
            await call.send_eof()
        nursery.cancel_scope.cancel()
    statistics = server.block_server.statistics()
    assert (statistics.push_streams, statistics.push_failures) == (1, 1)


async def test_a_server_missing_from_the_peer_table_is_looked_up_in_the_dht(
    model: Model, tmp_path: Path
) -> None:
    """A server dials the next one even when its peer table has not heard of it yet (a client
    can be quicker than gossip): it reads the DHT.  (Its periodic reads are far apart, so that
    the reads counted are the lookups'.)"""
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)], update_period_s=600) as swarm:
        first, second = swarm.servers.values()
        with trio.fail_after(DEADLINE_S):
            await servers_know_each_other([first, second])
            peer = str(second.dht.peer_id)
            # As if the announcement had not reached it: a table that never heard of the peer.
            first.topic._store.expire(math.inf)
            first.topic._mark_changed()
            assert first.topic.address_of(peer) is None
            refreshes = first.topic.refreshes
            assert first.block_server.connect_peer is not None
            connection = await first.block_server.connect_peer(peer)
            assert str(connection.peer_id) == peer
            assert first.topic.refreshes == refreshes + 1
            # A peer nobody announced: unreachable, and no second DHT read so soon.
            with pytest.raises(PeerUnreachable, match="announced no address"):
                await first.block_server.connect_peer(str(first.dht.peer_id)[:-4] + "abcd")
            assert first.topic.refreshes == refreshes + 1


async def test_a_server_that_cannot_push_lets_the_client_send(model: Model, tmp_path: Path) -> None:
    torch.manual_seed(4)
    steps = [torch.randn(1, 3, HIDDEN)] + [torch.randn(1, 1, HIDDEN) for _ in range(3)]
    async with in_process_swarm(model, tmp_path, [(0, 3), (3, 6)]) as swarm:
        first, second = swarm.servers.values()

        async def unreachable(peer_id: str) -> Connection:
            raise PeerUnreachable(f"no way to {peer_id} from here")

        first.block_server.connect_peer = unreachable
        with trio.fail_after(DEADLINE_S):
            async with (
                RemoteSequential(manager_for([first, second])) as seq,
                seq.open_inference_session(max_length=16) as session,
            ):
                await run_session(session, model, steps[:1])
                # The dial failed in the background; every step still goes to each server.
                await first.block_server.wait_statistics(lambda s: s.push_dial_failures >= 1)
                await run_session(session, model, steps[1:], done=steps[:1])
                assert session.retries == 0
        assert pushed_steps(second) == 0
        assert first.block_server.statistics().push_streams == 0


@asynccontextmanager
async def _session_at_step_5(
    connection: Connection, session_id: str, prefix: torch.Tensor, **opening: Any
) -> AsyncIterator[Call]:
    """A raw session over blocks 0:6 (``opening``: more fields of its opening) that took
    ``prefix`` as its step 5."""
    async with open_call(connection, INFERENCE) as call:
        await call.send({"session_id": session_id, "blocks": [0, 6], "max_length": 8, **opening})
        assert (await call.receive())["ready"] is True
        await call.send({"hidden_states": prefix, "step_id": 5})
        assert (await call.receive())["step_id"] == 5
        yield call


@asynccontextmanager
async def _one_server(
    model: Model, tmp_path: Path, **swarm: Any
) -> AsyncIterator[tuple[Server, Connection]]:
    """A server of all the blocks (``swarm``: options of :func:`in_process_swarm`) and a raw
    client's connection to it, under the tests' deadline."""
    async with in_process_swarm(model, tmp_path, [(0, 6)], **swarm) as served:
        (server,) = served.servers.values()
        with trio.fail_after(DEADLINE_S):
            async with open_node(host="127.0.0.1") as node:
                yield server, await node.connect(server.multiaddrs[0])


def _prefix_and_next(model: Model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs of 2 positions and of the next one, and the model's output at that next one."""
    prefix = torch.randn(1, 2, HIDDEN)
    x = torch.randn(1, 1, HIDDEN)
    with torch.no_grad():
        return prefix, x, model.forward(torch.cat([prefix, x], dim=1))[:, 2:]


async def test_stale_and_misaddressed_pushes(model: Model, tmp_path: Path) -> None:
    """Raw calls: a pushed step whose id is not above the session's last one is dropped; the
    next one is computed and answered on the client's stream; an unknown session, and a
    header that names none, are refused."""
    torch.manual_seed(5)
    limits = ServingLimits(request_timeout_s=2.0, early_push_wait_s=0.5)
    session_id = os.urandom(8).hex()
    prefix, pushed, expected = _prefix_and_next(model)
    async with _one_server(model, tmp_path, limits=limits) as (server, connection):
        async with _session_at_step_5(connection, session_id, prefix) as call:
            async with open_call(connection, PUSH) as push:
                await push.send({"session_id": session_id})
                stale = {"hidden_states": torch.randn(1, 1, HIDDEN), "step_id": 5}
                await push.send({**stale, "start_from_position": 2})
                await push.send({"hidden_states": pushed, "step_id": 6, "start_from_position": 2})
                answer = await call.receive()
            assert answer["step_id"] == 6
            assert answer["position"] == 3
            assert_close(answer["hidden_states"], expected)
            statistics = server.block_server.statistics()
            assert (statistics.pushed_steps, statistics.stale_pushes) == (1, 1)
            await call.send_eof()
        async with open_call(connection, PUSH) as push:
            await push.send({"session_id": "no-such-session"})
            with pytest.raises(RemoteError, match="unknown session"):
                await push.receive()  # after the server's early_push_wait_s
        async with open_call(connection, PUSH) as push:
            await push.send({"session_id": 7})
            with pytest.raises(RemoteError, match="push refused: session_id must be"):
                await push.receive()


async def test_a_session_pushes_to_a_few_next_sessions_at_once_and_tries_a_few_more(
    model: Model, tmp_path: Path
) -> None:
    """Every step (zero tokens: free) names another next session.  While four dials hang, the
    steps naming more are answered unpushed, without dialling; once those four failed, the
    server dials again, up to sixteen next sessions tried in all."""
    dialled: list[str] = []
    release = trio.Event()

    async def dial_and_fail(peer_id: str) -> Connection:
        dialled.append(peer_id)
        if len(dialled) <= 4:
            await release.wait()
        raise PeerUnreachable(f"no way to {peer_id} from here")

    async with _one_server(model, tmp_path) as (server, connection):
        server.block_server.connect_peer = dial_and_fail
        prefix = torch.randn(1, 2, HIDDEN)
        async with _session_at_step_5(connection, os.urandom(8).hex(), prefix) as call:

            async def step(step_id: int) -> None:
                push = [{"peer": f"peer-{step_id}", "session_id": "next"}]
                empty = torch.zeros(1, 0, HIDDEN)
                await call.send({"hidden_states": empty, "step_id": step_id, "push": push})
                answer = await call.receive()
                assert (answer["step_id"], answer["pushed"]) == (step_id, False)

            for step_id in range(6, 12):
                await step(step_id)
            assert dialled == [f"peer-{step_id}" for step_id in range(6, 10)]
            release.set()
            await server.block_server.wait_statistics(lambda s: s.push_dial_failures >= 4)
            for step_id in range(12, 30):
                await step(step_id)
                failures = min(step_id - 7, 16)
                await server.block_server.wait_statistics(
                    lambda s, n=failures: s.push_dial_failures >= n
                )
            await call.send_eof()
            with pytest.raises(CallEnded):
                await call.receive()
    # Four hung, two refused while they did; twelve more tried; the rest refused.
    assert dialled == [f"peer-{step_id}" for step_id in [*range(6, 10), *range(12, 24)]]
    assert server.block_server.statistics().push_dial_failures == 16


async def _opens_and_answers_the_push(call: Call, expected: torch.Tensor) -> None:
    """The session of ``call`` opens, then answers the pushed step 1 (of 3 positions) with
    ``expected``; its client then ends it."""
    assert (await call.receive())["ready"] is True
    answer = await call.receive()
    assert (answer["step_id"], answer["position"]) == (1, 3)
    assert_close(answer["hidden_states"], expected)
    await call.send_eof()


async def test_a_push_that_comes_before_its_session_opens_waits_for_it(
    model: Model, tmp_path: Path
) -> None:
    """A client sends its openings and its first step at once: the previous server's push may
    name a session this server has not opened yet.  It waits for the opening."""
    torch.manual_seed(6)
    session_id = os.urandom(8).hex()
    pushed = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        expected = model.forward(pushed)
    async with _one_server(model, tmp_path) as (server, connection):
        async with open_call(connection, PUSH) as push:
            await push.send({"session_id": session_id})
            await push.send({"hidden_states": pushed, "step_id": 1})
            async with open_call(connection, INFERENCE) as call:
                opening = {"session_id": session_id, "blocks": [0, 6], "max_length": 8}
                await call.send(opening)
                await _opens_and_answers_the_push(call, expected)
        assert server.block_server.statistics().pushed_steps == 1


async def test_a_push_waits_for_a_session_waiting_for_cache_however_long(
    model: Model, tmp_path: Path
) -> None:
    """The session a push names is being opened, waiting for cache that another session holds:
    the push waits for it past ``early_push_wait_s`` (which only bounds the wait for an opening
    not yet arrived), and its step is computed once the session has its cache."""
    torch.manual_seed(10)
    pushed = torch.randn(1, 3, HIDDEN)
    with torch.no_grad():
        expected = model.forward(pushed)
    limits = ServingLimits(request_timeout_s=10.0, early_push_wait_s=0.001)
    async with (
        _one_server(model, tmp_path, limits=limits, attn_cache_tokens=8) as (server, connection),
        open_call(connection, INFERENCE) as fills,
        open_call(connection, INFERENCE) as late,
    ):
        await fills.send({"session_id": "fills", "blocks": [0, 4], "max_length": 10})
        assert (await fills.receive())["ready"] is True
        opening = {"session_id": "late", "blocks": [0, 6], "max_length": 8, "alloc_timeout": 30}
        await late.send(opening)
        await server.block_server.wait_statistics(lambda s: s.openings == 1)
        async with open_call(connection, PUSH) as push:
            await push.send({"session_id": "late"})
            await push.send({"hidden_states": pushed, "step_id": 1})
            await fills.send_eof()  # its cache freed, the late session opens
            await _opens_and_answers_the_push(late, expected)
    assert server.block_server.statistics().pushed_steps == 1


async def test_a_pushed_step_with_prompts_or_hypo_ids_is_refused_and_the_session_untouched(
    model: Model, tmp_path: Path
) -> None:
    """A pushed step is the output of a step that could be pushed on: it never carries deep
    prompts nor beam reordering.  One that does (here from a peer that learned the session's id,
    redoing position 0) ends its push stream with the fault named, and the client's next step
    computes as if it had never come."""
    torch.manual_seed(7)
    session_id = os.urandom(8).hex()
    prefix, x, expected = _prefix_and_next(model)
    forged = {"hidden_states": torch.randn(1, 1, HIDDEN), "step_id": 6, "start_from_position": 0}
    carried = {"prompts": torch.randn(6, 1, 1, HIDDEN), "hypo_ids": torch.tensor([0])}
    async with _one_server(model, tmp_path) as (server, connection):
        async with _session_at_step_5(connection, session_id, prefix) as call:
            for name, value in carried.items():
                async with open_call(connection, PUSH) as push:
                    await push.send({"session_id": session_id})
                    await push.send({**forged, name: value})
                    with pytest.raises(RemoteError, match=f"push refused: .* no {name}"):
                        await push.receive()
            await call.send({"hidden_states": x, "step_id": 6})
            answer = await call.receive()
            assert (answer["step_id"], answer["position"]) == (6, 3)
            assert_close(answer["hidden_states"], expected)
            await call.send_eof()
        statistics = server.block_server.statistics()
        assert (statistics.refused_pushes, statistics.pushed_steps) == (2, 0)


async def test_a_push_without_the_clients_grant_of_exactly_that_step_changes_nothing(
    model: Model, tmp_path: Path
) -> None:
    """A session opened with a push key takes a pushed step only with the client's grant of
    that very step from the server meant to push it: a peer that learned the session's id cannot
    roll it back or run a step of its own in it, with no grant, with another session's, or with
    the grant of another position, step id, size or pusher, nor end it with a malformed push.
    Each such push ends its push stream with the fault named; a granted step that does not fit
    the session is dropped.  The granted step is then computed as if none of them had come."""
    torch.manual_seed(8)
    session_id, key = os.urandom(8).hex(), os.urandom(PUSH_KEY_BYTES)
    prefix, x, expected = _prefix_and_next(model)
    pusher = Identity.generate()

    def grant(step_id: int = 6, position: int = 2, tokens: int = 1, **kwargs: Any) -> bytes:
        at = {"key": key, "step_id": step_id, "position": position, "tokens": tokens, "batch": 1}
        at["pusher"] = str(pusher.peer_id)
        return push_grant(**{**at, **kwargs})  # type: ignore[arg-type]

    step = {"hidden_states": x, "step_id": 6, "start_from_position": 2}
    refused = [
        (step, "its client did not grant this step"),
        ({**step, "grant": grant(key=os.urandom(PUSH_KEY_BYTES))}, "did not grant"),
        ({**step, "start_from_position": 0, "grant": grant()}, "did not grant"),  # a rollback
        ({**step, "start_from_position": 0, "grant": grant(position=0, tokens=2)}, "not grant"),
        ({**step, "step_id": 9, "grant": grant()}, "did not grant"),
        ({**step, "grant": grant(pusher=str(Identity.generate().peer_id))}, "did not grant"),
        ({**step, "hidden_states": torch.randn(1, 2, HIDDEN), "grant": grant()}, "not grant"),
        ({**step, "grant": 5}, "grant must be 1..64 bytes"),
        ({**step, "step_id": -1, "grant": grant()}, "step_id must be an integer >= 0"),
    ]
    misfit = {**step, "hidden_states": torch.randn(1, 1, HIDDEN + 1), "grant": grant()}
    async with (
        _one_server(model, tmp_path) as (server, connection),
        open_node(pusher, host="127.0.0.1") as node,
    ):
        pushing = await node.connect(server.multiaddrs[0])
        async with _session_at_step_5(connection, session_id, prefix, push_key=key) as call:
            # From the client's own connection, the grant meant for the pusher does not check.
            refused.append(({**step, "grant": grant()}, "did not grant"))
            for index, (message, says) in enumerate(refused):
                sender = connection if index == len(refused) - 1 else pushing
                async with open_call(sender, PUSH) as push:
                    await push.send({"session_id": session_id})
                    await push.send(message)
                    with pytest.raises(RemoteError, match=f"push refused: .*{says}"):
                        await push.receive()
            async with open_call(pushing, PUSH) as push:
                await push.send({"session_id": session_id})
                await push.send(misfit)
                await server.block_server.wait_statistics(
                    lambda s: s.refused_pushes == len(refused) + 1
                )
                await push.send({**step, "step_id": 7, "grant": grant(step_id=7)})
                answer = await call.receive()
            assert (answer["step_id"], answer["position"]) == (7, 3)
            assert_close(answer["hidden_states"], expected)
            await call.send_eof()
        assert server.block_server.statistics().pushed_steps == 1


async def test_a_push_stream_ends_with_its_session(model: Model, tmp_path: Path) -> None:
    """The previous server keeps its push stream open; when the client ends the session, the
    receiving server ends the push stream too instead of waiting on it."""
    session_id = os.urandom(8).hex()
    prefix, pushed, expected = _prefix_and_next(model)
    async with (
        _one_server(model, tmp_path) as (_, connection),
        _session_at_step_5(connection, session_id, prefix) as call,
        open_call(connection, PUSH) as push,
    ):
        await push.send({"session_id": session_id})
        await push.send({"hidden_states": pushed, "step_id": 6})
        assert_close((await call.receive())["hidden_states"], expected)
        await call.send_eof()
        with pytest.raises(CallEnded):
            await call.receive()
        with pytest.raises(CallEnded):
            await push.receive()


async def test_a_malformed_pushed_step_ends_its_push_stream_and_not_the_session(
    model: Model, tmp_path: Path
) -> None:
    """A malformed pushed step ends its push stream with the fault named, whatever its step id;
    the session goes on as if it had never come (a peer that learned its id cannot end it)."""
    torch.manual_seed(11)
    session_id = os.urandom(8).hex()
    prefix, x, expected = _prefix_and_next(model)
    async with _one_server(model, tmp_path) as (server, connection):
        async with _session_at_step_5(connection, session_id, prefix) as call:
            async with open_call(connection, PUSH) as push:
                await push.send({"session_id": session_id})
                await push.send({"hidden_states": torch.ones(1, 1, HIDDEN).long()})
                with pytest.raises(RemoteError, match="push refused: hidden_states must"):
                    await push.receive()
            await call.send({"hidden_states": x, "step_id": 6})
            answer = await call.receive()
            assert (answer["step_id"], answer["position"]) == (6, 3)
            assert_close(answer["hidden_states"], expected)
            assert server.block_server.open_sessions == 1
            await call.send_eof()
        assert server.block_server.statistics().refused_pushes == 1
