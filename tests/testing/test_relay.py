"""The delay relay: datagrams held for the link's delay both ways, in order, some dropped."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from petals_core.testing import DelayRelay, Pipe

DEADLINE_S = 30.0


@pytest.fixture
def target() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.settimeout(DEADLINE_S)
        yield sock


def _peer() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(DEADLINE_S)
    return sock


def test_each_way_is_held_for_the_delay_and_answers_find_their_way_back(
    target: socket.socket,
) -> None:
    with DelayRelay([target.getsockname()[1]]) as relay, _peer() as a, _peer() as b:
        relay.set_link(Pipe(latency_s=0.03))
        address = (relay.host, relay.ports[0])
        for peer, payload in [(a, b"from a"), (b, b"from b")]:
            sent = time.monotonic()
            peer.sendto(payload, address)
            data, seen_as = target.recvfrom(100)
            arrived = time.monotonic()
            assert data == payload
            assert seen_as[1] not in (a.getsockname()[1], b.getsockname()[1])  # as a NAT does
            target.sendto(data.upper(), seen_as)
            assert peer.recvfrom(100) == (payload.upper(), address)
            # A lower bound only: the relay never hands a datagram on early.
            assert arrived - sent >= 0.03
            assert time.monotonic() - arrived >= 0.03
        stats = relay.stats()
        assert (stats.forwarded, stats.dropped) == (4, 0)
        assert 0.03 <= stats.mean_delay_s <= stats.max_delay_s


def test_jitter_delays_without_reordering_a_flow(target: socket.socket) -> None:
    with DelayRelay([target.getsockname()[1]]) as relay, _peer() as peer:
        relay.set_link(Pipe(latency_s=0.001, jitter_s=0.01))
        for index in range(100):
            peer.sendto(index.to_bytes(2, "big"), (relay.host, relay.ports[0]))
        received = [int.from_bytes(target.recvfrom(10)[0], "big") for _ in range(100)]
        assert received == list(range(100))
        assert relay.stats().max_delay_s >= 0.001


def test_loss_drops_about_that_share_and_forwards_the_rest(target: socket.socket) -> None:
    sent, batch = 400, 20  # in batches: a socket's buffer holds only so many datagrams
    received: list[bytes] = []
    with DelayRelay([target.getsockname()[1]], seed=7) as relay, _peer() as peer:
        relay.set_link(Pipe(latency_s=0.0, loss=0.25))
        for start in range(0, sent, batch):
            for index in range(start, start + batch):
                peer.sendto(index.to_bytes(2, "big"), (relay.host, relay.ports[0]))
            # Wait for the relay to have seen the batch (it counts the ones it drops).
            deadline = time.monotonic() + DEADLINE_S
            while (stats := relay.stats()).forwarded + stats.dropped < start + batch:
                assert time.monotonic() < deadline, stats
            while len(received) < stats.forwarded:
                received.append(target.recvfrom(10)[0])
        assert len(set(received)) == len(received) == stats.forwarded
        assert 0.15 * sent < stats.dropped < 0.35 * sent


def test_datagrams_larger_than_the_link_carries_are_dropped(target: socket.socket) -> None:
    with DelayRelay([target.getsockname()[1]]) as relay, _peer() as peer:
        relay.set_link(Pipe(latency_s=0.0, max_payload=1452))
        for size in (1453, 1452, 9000, 1200):
            peer.sendto(bytes(size), (relay.host, relay.ports[0]))
        assert [len(target.recvfrom(10_000)[0]) for _ in range(2)] == [1452, 1200]
        deadline = time.monotonic() + DEADLINE_S
        while (stats := relay.stats()).dropped < 2:
            assert time.monotonic() < deadline, stats
        assert (stats.forwarded, stats.dropped, stats.too_large) == (2, 2, 2)
        assert stats.largest_forwarded == 1452


def test_a_rate_limit_sends_one_datagram_after_the_other_and_drops_past_its_queue(
    target: socket.socket,
) -> None:
    """100 datagrams of 1000 bytes sent at once to a link of 100 kB/s with a queue of 65 535
    bytes: the 65 that fit the queue leave 10 ms apart, in order; the rest are dropped."""
    with DelayRelay([target.getsockname()[1]]) as relay, _peer() as peer:
        relay.set_link(Pipe(latency_s=0.0), bytes_per_s=100_000, queue_bytes=65_535)
        sent = time.monotonic()
        for index in range(100):
            peer.sendto(index.to_bytes(2, "big") + bytes(998), (relay.host, relay.ports[0]))
        deadline = time.monotonic() + DEADLINE_S
        while (stats := relay.stats()).forwarded + stats.dropped < 100:
            assert time.monotonic() < deadline, stats
        received = [int.from_bytes(target.recvfrom(2000)[0][:2], "big") for _ in range(50)]
        # The 50th left the bottleneck 50 x 1000 bytes / 100 kB/s after the burst arrived.
        assert time.monotonic() - sent >= 0.5
        # Those the queue took go in order.  It drains 100 bytes a millisecond, so a burst sent
        # within 5 ms finds room for 65 to 70 of them.
        assert received == list(range(50))
        assert stats.queue_full == stats.dropped
        assert 30 <= stats.dropped <= 35


def test_a_link_it_cannot_make_is_refused_and_the_relay_keeps_working(
    target: socket.socket,
) -> None:
    with DelayRelay([target.getsockname()[1]]) as relay, _peer() as peer:
        for bad in [Pipe(latency_s=-1.0), Pipe(loss=1.0), Pipe(drop=lambda index, data: True)]:
            with pytest.raises(ValueError, match=r"relay|link"):
                relay.set_link(bad)
        with pytest.raises(ValueError, match="rate must be above 0"):
            relay.set_link(Pipe(), bytes_per_s=0)
        with pytest.raises(ValueError, match="queue must hold a datagram"):
            relay.set_link(Pipe(), bytes_per_s=1000, queue_bytes=1000)
        peer.sendto(b"still", (relay.host, relay.ports[0]))
        assert target.recvfrom(10)[0] == b"still"
    with pytest.raises(RuntimeError, match="closed"):
        relay.stats()
