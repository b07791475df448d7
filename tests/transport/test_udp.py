"""The node's UDP socket on loopback: runs of datagrams in one call where Linux allows, one per call
where it does not, and the same datagrams arriving either way."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterator

import pytest

from petals_core.testing import Topology
from petals_core.transport._udp import DatagramSocket

# Linux's SO_NO_CHECK: the kernel refuses segmented sends from a socket that skips checksums.
_SO_NO_CHECK = 11

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="UDP offload is Linux's")


Bind = Callable[..., DatagramSocket]


@pytest.fixture
def bound() -> Iterator[Bind]:
    """``bound(offload=True, host="127.0.0.1")``: a bound socket, closed after the test."""
    opened: list[DatagramSocket] = []

    def bind(*, offload: bool = True, host: str = "127.0.0.1") -> DatagramSocket:
        udp = _bound(offload=offload, host=host)
        opened.append(udp)
        return udp

    yield bind
    for udp in opened:
        udp.close()


def _bound(*, offload: bool, host: str) -> DatagramSocket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.bind((host, 0))
    sock.setblocking(False)
    return DatagramSocket(sock, offload=offload)


def _datagrams(count: int, size: int, *, last: int | None = None) -> list[bytes]:
    sizes = [size] * count if last is None else [size] * (count - 1) + [last]
    return [bytes([index % 251]) * length for index, length in enumerate(sizes)]


def _receive_all(udp: DatagramSocket, expected: int) -> list[tuple[bytes, tuple[str, int]]]:
    received: list[tuple[bytes, tuple[str, int]]] = []
    # Loopback delivers before the send returns: everything is already waiting.
    while len(received) < expected:
        batch = udp.receive(256)
        assert batch, f"only {len(received)} of {expected} datagrams arrived"
        received += batch
    assert udp.receive(256) == []
    return received


@linux_only
def test_a_run_leaves_in_one_call_and_arrives_as_the_datagrams_sent(bound: Bind) -> None:
    sender, receiver = bound(), bound()
    if not (sender.segmentation and receiver.coalescing):
        pytest.skip("this kernel offers no UDP segmentation or receive offload")
    payloads = _datagrams(45, 1452, last=700)
    outbox = deque((payload, receiver.local_address()) for payload in payloads)
    sender.send(outbox)
    assert not outbox
    assert sender.send_calls == 1
    assert sender.datagrams_sent == 45
    assert sender.bytes_sent == 44 * 1452 + 700
    received = _receive_all(receiver, 45)
    assert [data for data, _ in received] == payloads
    assert {address for _, address in received} == {sender.local_address()}
    assert receiver.receive_calls == 1
    assert receiver.datagrams_received == 45
    assert receiver.bytes_received == sender.bytes_sent


def test_without_offload_each_datagram_takes_a_call(bound: Bind) -> None:
    sender, receiver = bound(offload=False), bound(offload=False)
    assert not sender.segmentation
    assert not receiver.coalescing
    payloads = _datagrams(10, 1200)
    sender.send(deque((payload, receiver.local_address()) for payload in payloads))
    assert sender.send_calls == 10
    received = _receive_all(receiver, 10)
    assert [data for data, _ in received] == payloads
    assert receiver.receive_calls == 10
    # Each reading that empties the socket ends with a call that found nothing.
    assert receiver.empty_receives == 2


@linux_only
def test_runs_split_where_the_address_or_the_size_changes(bound: Bind) -> None:
    sender, first, second = bound(), bound(), bound()
    to_first, to_second = first.local_address(), second.local_address()
    outbox = deque(
        [(payload, to_first) for payload in _datagrams(5, 1300)]
        + [(payload, to_second) for payload in _datagrams(3, 1300)]
        # Larger than the run before: a new run starts.
        + [(payload, to_second) for payload in _datagrams(4, 1400, last=20)]
        + [(b"x" * 1500, to_first), (b"y" * 64, to_first), (b"", to_first)]
    )
    expected_first = [data for data, to in outbox if to == to_first]
    expected_second = [data for data, to in outbox if to == to_second]
    sender.send(outbox)
    assert not outbox
    if sender.segmentation:
        assert sender.send_calls == 5
    assert [data for data, _ in _receive_all(first, 8)] == expected_first
    assert [data for data, _ in _receive_all(second, 7)] == expected_second


@linux_only
def test_a_refused_segmented_send_goes_again_one_datagram_at_a_time(bound: Bind) -> None:
    sender, receiver = bound(), bound()
    if not sender.segmentation:
        pytest.skip("this kernel offers no UDP segmentation offload")
    sender.sock.setsockopt(socket.SOL_SOCKET, _SO_NO_CHECK, 1)
    payloads = _datagrams(8, 1452)
    outbox = deque((payload, receiver.local_address()) for payload in payloads)
    sender.send(outbox)
    assert not outbox
    assert not sender.segmentation
    assert sender.send_calls == 8
    assert [data for data, _ in _receive_all(receiver, 8)] == payloads


def test_a_socket_without_udp_options_is_probed_as_having_no_offload() -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    udp = DatagramSocket(sock, offload=True)
    try:
        assert not udp.segmentation
        assert not udp.coalescing
    finally:
        udp.close()


@linux_only
def test_ipv4_peers_of_a_dual_stack_socket_get_runs_too(bound: Bind) -> None:
    sender, receiver = bound(host="::"), bound()
    payloads = _datagrams(6, 1452)
    port = receiver.local_address()[1]
    sender.send(deque((payload, ("127.0.0.1", port)) for payload in payloads))
    received = _receive_all(receiver, 6)
    assert [data for data, _ in received] == payloads
    assert received[0][1] == ("127.0.0.1", sender.local_address()[1])


def test_receive_takes_about_limit_and_leaves_the_rest(bound: Bind) -> None:
    sender, receiver = bound(offload=False), bound(offload=False)
    payloads = _datagrams(20, 100)
    sender.send(deque((payload, receiver.local_address()) for payload in payloads))
    first = receiver.receive(8)
    assert len(first) == 8
    assert receiver.empty_receives == 0
    rest = receiver.receive(256)
    assert [data for data, _ in first + rest] == payloads
    assert receiver.empty_receives == 1


#: In a namespace whose loopback carries at most 1300-byte packets: a run headed by a datagram
#: too large for it, sent with "don't fragment".  Prints what happened as JSON.
_TOO_LARGE = """
import errno, json, socket
from collections import deque
from petals_core.transport._udp import DatagramSocket, forbid_fragmentation

sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
assert forbid_fragmentation(sock)
sock.bind(("127.0.0.1", 0))
sock.setblocking(False)
udp = DatagramSocket(sock)
address = udp.local_address()
outbox = deque([(bytes(1400), address), (bytes(1000), address), (bytes(1000), address)])
refused = None
try:
    udp.send(outbox)
except OSError as exc:
    refused = errno.errorcode[exc.errno]
    outbox.popleft()
udp.send(outbox)
sizes = sorted(len(data) for data, _ in udp.receive(10))
print(json.dumps({"refused": refused, "received": sizes, "runs": udp.segmentation}))
"""


def test_a_datagram_too_large_for_the_route_is_refused_alone(topology: Topology) -> None:
    host = topology.public("h")
    topology.set_mtu(host.netns, "lo", 1300)
    done = subprocess.run(
        host.command(sys.executable, "-c", _TOO_LARGE),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    report = json.loads(done.stdout)
    # The 1400-byte one is refused at once (never fragmented), the others arrive, and runs of
    # datagrams still leave in one call afterwards.
    assert report == {"refused": "EMSGSIZE", "received": [1000, 1000], "runs": True}
