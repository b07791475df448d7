"""What a connection learns of its path: the datagram size it finds by probing, and a congestion
window that survives idle gaps but grows only while used.  Pairs of sans-IO endpoints in memory
with a virtual clock, the search on its own, and real sockets across real links of a small MTU
(network namespaces)."""

from __future__ import annotations

import json
import subprocess
import sys

from hypothesis import given, strategies as st

from petals_core.testing import MemoryNetwork, Pipe, Topology
from petals_core.transport import PathInfo, TransportConfig
from petals_core.transport._quic_path import (
    BASE_DATAGRAM_BYTES,
    PROBE_ATTEMPTS,
    PROBE_RESOLUTION,
    MtuSearch,
)

from ._pairs import FAR_SERVER, Recorder, handshake, make_pair, transfer
from ._programs import ECHO_HANDLER

# -- the search on its own ---------------------------------------------------------------------


def _search(ceiling: int, mtu: int) -> tuple[MtuSearch, int]:
    """Run a search against a path that carries datagrams up to ``mtu``; returns it and how
    many probes it sent."""
    search = MtuSearch(ceiling=ceiling)
    probes = 0
    while (size := search.next_size()) is not None:
        search.sent(size)
        probes += 1
        if size <= mtu:
            search.acknowledged(size)
        else:
            search.lost(size)
    return search, probes


@given(ceiling=st.integers(1200, 16384), mtu=st.integers(1200, 20000))
def test_the_search_ends_just_below_what_the_path_carries(ceiling: int, mtu: int) -> None:
    search, probes = _search(ceiling, mtu)
    carried = min(ceiling, mtu)
    assert search.done
    assert search.floor <= carried
    assert carried - search.floor < PROBE_RESOLUTION
    # The ceiling first, then halving the gap: a bounded number of probes.
    assert probes <= 1 + PROBE_ATTEMPTS * (1 + (ceiling - BASE_DATAGRAM_BYTES).bit_length())
    if mtu >= ceiling:
        assert search.floor == ceiling and probes == (ceiling > BASE_DATAGRAM_BYTES)


def test_a_size_is_given_up_only_after_several_losses() -> None:
    search = MtuSearch(ceiling=1452)
    for _ in range(PROBE_ATTEMPTS - 1):
        assert search.next_size() == 1452
        search.sent(1452)
        search.lost(1452)
    # One more loss of 1452 makes it too large: the next probe is smaller.
    assert search.next_size() == 1452
    search.sent(1452)
    assert search.next_size() is None  # one in flight at a time
    search.lost(1452)
    assert search.next_size() == (1200 + 1452) // 2
    search.restart()
    assert search.floor == BASE_DATAGRAM_BYTES and search.next_size() == 1452


# -- pairs of endpoints in memory ------------------------------------------------------------


def _path(recorder: Recorder, handle: int | None = None) -> PathInfo:
    if handle is None:
        (handle,) = recorder.ready
    info = recorder.endpoint.path_info(handle)
    assert info is not None
    return info


def _settle(net: MemoryNetwork, *recorders: Recorder) -> None:
    """Run until every connection's search is over."""
    assert net.run_until(
        lambda: all(_path(r).datagram_search_done for r in recorders), max_time_s=60
    )


def test_loopback_connections_grow_to_the_loopback_ceiling() -> None:
    net, client, server = make_pair()
    handle = handshake(net, client, server)
    _settle(net, client, server)
    assert _path(client, handle).datagram_bytes == 16384
    assert _path(server).datagram_bytes == 16384


def test_connections_to_other_hosts_grow_to_the_ceiling_for_them() -> None:
    net, client, server = make_pair(far=True)
    handle = handshake(net, client, server, FAR_SERVER)
    _settle(net, client, server)
    assert _path(client, handle).datagram_bytes == 1452
    transfer(net, client, server, handle, 100_000)
    # Nothing was sent larger than the ceiling.
    assert (
        max(map(len, (d for d, _ in client.endpoint.datagrams_to_send(net.now))), default=0) <= 1452
    )


def test_a_path_of_a_smaller_mtu_is_found_and_carries_data() -> None:
    net, client, server = make_pair(pipe=Pipe(max_payload=1400))
    handle = handshake(net, client, server)
    transfer(net, client, server, handle, 300_000)
    _settle(net, client, server)
    for info in (_path(client, handle), _path(server)):
        assert 1400 - PROBE_RESOLUTION < info.datagram_bytes <= 1400
    # The probes lost on the way were no congestion: the window never shrank below its start.
    assert _path(client, handle).congestion_window_bytes >= 10 * BASE_DATAGRAM_BYTES
    transfer(net, client, server, handle, 300_000)


def test_without_discovery_the_ceiling_is_used_from_the_start() -> None:
    config = TransportConfig(keepalive_interval_s=None, path_mtu_discovery=False)
    net, client, server = make_pair(config, far=True)
    handle = handshake(net, client, server, FAR_SERVER)
    info = _path(client, handle)
    assert info.datagram_bytes == 1452 and info.datagram_search_done


def test_a_path_that_shrinks_is_noticed_and_searched_again() -> None:
    net, client, server = make_pair(pipe=Pipe(latency_s=0.005))
    handle = handshake(net, client, server)
    _settle(net, client, server)
    assert _path(client, handle).datagram_bytes == 16384
    # The route changes: from now on only datagrams of 1300 bytes pass, either way.
    net.default = Pipe(latency_s=0.005, max_payload=1300)
    transfer(net, client, server, handle, 200_000)
    _settle(net, client, server)
    assert 1300 - PROBE_RESOLUTION < _path(client, handle).datagram_bytes <= 1300
    transfer(net, client, server, handle, 200_000)


def test_the_window_survives_an_idle_gap() -> None:
    rtt = 0.1
    net, client, server = make_pair(far=True, pipe=Pipe(latency_s=rtt / 2))
    handle = handshake(net, client, server, FAR_SERVER)
    _settle(net, client, server)
    size = 400_000
    first = transfer(net, client, server, handle, size)
    assert first > 3 * rtt  # slow start: round trip after round trip
    assert not net.run_until(lambda: False, max_time_s=1)  # the last ACKs arrive
    window = _path(client, handle).congestion_window_bytes
    assert window >= size
    # Ten seconds of silence (aioquic's own CUBIC starts over after two).
    assert not net.run_until(lambda: False, max_time_s=10)
    assert _path(client, handle).congestion_window_bytes == window
    again = transfer(net, client, server, handle, size)
    # One paced window (at 1.25 x window / RTT) and the one-way delay, not slow start again.
    assert again < rtt * (size / window / 1.25 + 0.5) + 0.02
    assert again < first / 2


def test_the_window_does_not_grow_while_it_does_not_limit() -> None:
    net, client, server = make_pair(far=True, pipe=Pipe(latency_s=0.01))
    handle = handshake(net, client, server, FAR_SERVER)
    _settle(net, client, server)
    start = _path(client, handle).congestion_window_bytes
    stream_id = client.endpoint.open_stream(handle)
    (server_handle,) = server.ready
    for count in range(1, 201):
        client.endpoint.send_stream_data(handle, stream_id, bytes(500), net.now)
        received = lambda: len(server.received.get((server_handle, stream_id), b""))  # noqa: E731
        assert net.run_until(lambda: received() == 500 * count)  # noqa: B023
    # 200 messages acknowledged, 100 kB that slow start would have added to the window.
    assert _path(client, handle).congestion_window_bytes == start


def test_random_loss_leaves_the_window_and_heavy_loss_shrinks_it() -> None:
    rtt = 0.1
    net, client, server = make_pair(far=True, pipe=Pipe(latency_s=rtt / 2, loss=0.005))
    handle = handshake(net, client, server, FAR_SERVER)
    _settle(net, client, server)
    size = 300_000
    for _ in range(3):  # slow start, then the window it reached
        transfer(net, client, server, handle, size)
        net.run_until(lambda: False, max_time_s=1)
    window = _path(client, handle).congestion_window_bytes
    took = []
    for _ in range(10):
        took.append(transfer(net, client, server, handle, size))
        net.run_until(lambda: False, max_time_s=1)
    assert net.dropped > 10
    # A lost datagram costs its transfer a round trip to send it again, no more: the window
    # (enough for the whole transfer) stays.
    assert _path(client, handle).congestion_window_bytes == window
    assert max(took) < 2.5 * rtt
    assert _path(client, handle).losing  # repairs follow the client's runs
    # A fifth of everything lost: that is congestion, and the window shrinks; repairs, which
    # the window does not count, stop.
    net.default = Pipe(latency_s=rtt / 2, loss=0.2)
    transfer(net, client, server, handle, size)
    assert _path(client, handle).congestion_window_bytes < window / 2
    assert not _path(client, handle).losing


# -- real links in network namespaces ---------------------------------------------------------

#: Echoes each stream back; prints its PeerID, then serves 120 s at most.
ECHO = (
    """
import sys, trio
from petals_core.transport import open_node

"""
    + ECHO_HANDLER
    + """

async def main():
    async with open_node(host="0.0.0.0", port=7100) as node, trio.open_nursery() as nursery:
        node.set_stream_handler(lambda stream: nursery.start_soon(echo, stream))
        print(node.peer_id, flush=True)
        await trio.sleep(120)

trio.run(main)
"""
)

#: Sends a megabyte to the echo server at argv[1] and back; prints the datagram size the
#: connection settled on, and whether the socket still sends runs of datagrams in one call (a
#: probe that the kernel refused as too large for the interface must not turn that off).
SEND = """
import json, os, sys, trio
from petals_core.transport import open_node

async def main():
    payload = os.urandom(1 << 20)
    with trio.fail_after(60):
        async with open_node(host="0.0.0.0") as node:
            connection = await node.connect(sys.argv[1])
            stream = await connection.open_stream()
            await stream.send_all(payload, eof=True)
            echoed = bytearray()
            while data := await stream.receive_some():
                echoed += data
            assert echoed == payload
            while not connection.path().datagram_search_done:
                await trio.sleep(0.05)
            path = connection.path()
            segmentation = node.statistics().segmentation_offload
            print(json.dumps({"datagram_bytes": path.datagram_bytes, "gso": segmentation}))

trio.run(main)
"""


def _run_pair(topology: Topology, server: str, client: str) -> int:
    """The datagram size a connection from host ``client`` to host ``server`` settles on."""
    server_host, client_host = topology.hosts[server], topology.hosts[client]
    echo = subprocess.Popen(
        server_host.command(sys.executable, "-c", ECHO), stdout=subprocess.PIPE, text=True
    )
    try:
        assert echo.stdout is not None
        peer_id = echo.stdout.readline().strip()
        done = subprocess.run(
            client_host.command(
                sys.executable,
                "-c",
                SEND,
                f"/ip4/{server_host.address}/udp/7100/quic-v1/p2p/{peer_id}",
            ),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["gso"]
        return int(report["datagram_bytes"])
    finally:
        echo.kill()
        echo.wait()


def test_real_links_of_a_smaller_mtu(topology: Topology) -> None:
    topology.public("server")
    # A host whose own interface has a small MTU (its kernel refuses larger datagrams at once),
    # and one behind a router whose Internet side has a smaller MTU still (the router drops
    # them: "don't fragment").
    topology.public("small")
    topology.set_mtu(topology.hosts["small"].netns, "eth0", 1400)
    topology.behind_nat("home")
    topology.set_mtu(topology.routers["home"].netns, "wan", 1280)
    # IPv4 and UDP headers take 28 bytes of each packet.
    assert 1400 - 28 - PROBE_RESOLUTION < _run_pair(topology, "server", "small") <= 1400 - 28
    assert 1280 - 28 - PROBE_RESOLUTION < _run_pair(topology, "server", "home") <= 1280 - 28
    # A full-size Internet path: the ceiling for other hosts.
    topology.public("plain")
    assert _run_pair(topology, "server", "plain") == 1452
