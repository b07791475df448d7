"""The node's UDP socket: datagrams in and out in as few system calls as the kernel allows.

Linux can move a run of datagrams in one system call each way.  A run of equal-sized datagrams to
one address leaves in one ``sendmsg`` with segmentation offload (``UDP_SEGMENT``, Linux 4.18): the
kernel cuts it into datagrams.  With receive offload (``UDP_GRO``, Linux 5.0) the kernel hands over
datagrams that arrived as such a run in one buffer, with the segment size beside it.  Where the
kernel, or a sandbox's network stack, refuses either, the socket sends and receives one datagram
per call, as every UDP socket can.  Support is probed once per socket (an option that does not
read back as set is not there), and a send that the kernel refuses with segmentation turns it off
for the socket and goes again one datagram at a time: a refusal never reaches the caller.

The socket also counts what it did (system calls, datagrams, bytes), for the node's statistics.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import struct
import sys
from collections import deque

__all__ = ["Address", "DatagramSocket", "forbid_fragmentation", "normalise_host"]

logger = logging.getLogger(__name__)

Address = tuple[str, int]

# Linux's option numbers (Python names them only from 3.12 on).
_SOL_UDP = 17
_UDP_SEGMENT = 103
_UDP_GRO = 104
# The kernel cuts at most this many datagrams out of one send (UDP_MAX_SEGMENTS).
_MAX_SEGMENTS = 64
# A run sent with segmentation must fit one IPv4 packet's payload (65535 minus IP and UDP headers).
_MAX_RUN_BYTES = 65507
# Room for any datagram, and for a run handed over with receive offload.
_RECEIVE_BYTES = 65536
_SEGMENT_SIZE = struct.Struct("=H")
_GRO_SIZE = struct.Struct("=i")
# Room for the segment size that comes with a coalesced run (platforms without ancillary data
# have no receive offload either).
_GRO_SPACE = socket.CMSG_SPACE(_GRO_SIZE.size) if hasattr(socket, "CMSG_SPACE") else 0


class DatagramSocket:
    """A bound, non-blocking UDP socket that sends and receives runs of datagrams.

    ``offload=False`` keeps to one datagram per system call even where the kernel could do more.
    """

    def __init__(self, sock: socket.socket, *, offload: bool = True) -> None:
        self.sock = sock
        self.family = sock.family
        #: Whether runs of datagrams leave in one send (UDP segmentation offload).
        self.segmentation = offload and _set_option(sock, _UDP_SEGMENT, 0)
        #: Whether runs of datagrams arrive in one receive (UDP receive offload).
        self.coalescing = offload and _GRO_SPACE > 0 and _set_option(sock, _UDP_GRO, 1)
        self.datagrams_sent = 0
        self.bytes_sent = 0
        self.send_calls = 0
        self.blocked_sends = 0
        self.datagrams_received = 0
        self.bytes_received = 0
        self.receive_calls = 0
        self.empty_receives = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def local_address(self) -> Address:
        host, port = self.sock.getsockname()[:2]
        return normalise_host(host), port

    # -- receiving --------------------------------------------------------------------------------

    def receive(self, limit: int) -> list[tuple[bytes, Address]]:
        """The datagrams waiting in the kernel, at most about ``limit`` of them; never blocks."""
        received: list[tuple[bytes, Address]] = []
        sock = self.sock
        coalescing = self.coalescing
        mapped = self.family == socket.AF_INET6
        calls = nbytes = 0
        for _ in range(limit):
            try:
                if coalescing:
                    data, ancillary, _flags, source = sock.recvmsg(_RECEIVE_BYTES, _GRO_SPACE)
                else:
                    data, source = sock.recvfrom(_RECEIVE_BYTES)
                    ancillary = None
            except (BlockingIOError, InterruptedError):
                self.empty_receives += 1
                break
            except OSError:
                # ICMP errors surface here on some systems; QUIC's own timers handle them.
                calls += 1
                continue
            calls += 1
            address = (normalise_host(source[0]), source[1]) if mapped else source
            size = len(data)
            nbytes += size
            segment = _segment_size(ancillary) if ancillary else 0
            if 0 < segment < size:
                received.extend(
                    (data[start : start + segment], address) for start in range(0, size, segment)
                )
            else:
                received.append((data, address))
            if len(received) >= limit:
                break
        self.receive_calls += calls
        self.bytes_received += nbytes
        self.datagrams_received += len(received)
        return received

    # -- sending ----------------------------------------------------------------------------------

    def send(self, outbox: deque[tuple[bytes, Address]]) -> None:
        """Send datagrams from the head of ``outbox``, removing each once the kernel took it.

        Raises :class:`BlockingIOError` when the socket's buffer is full (the rest stays queued),
        and the kernel's :class:`OSError` for the datagram at the head when it refuses that one
        (it stays at the head, for the caller to judge).
        """
        sock = self.sock
        while outbox:
            data, address = outbox[0]
            target = self._socket_address(address)
            run = self._run(outbox) if self.segmentation and len(outbox) > 1 else None
            if run is not None:
                try:
                    sock.sendmsg(
                        run, [(_SOL_UDP, _UDP_SEGMENT, _SEGMENT_SIZE.pack(len(data)))], 0, target
                    )
                except (BlockingIOError, InterruptedError):
                    self.blocked_sends += 1
                    raise
                except OSError as exc:
                    if exc.errno == errno.EMSGSIZE:
                        # One of the run is larger than the route carries (a path MTU probe
                        # meets "don't fragment"): send this run singly, so that only that one
                        # is refused.
                        run = None
                    else:
                        # Refused by this kernel: one datagram per call from now on.
                        logger.debug("UDP segmentation offload refused (%s); sending singly", exc)
                        self.segmentation = False
                        continue
            if run is not None:
                for _ in run:
                    outbox.popleft()
                self.datagrams_sent += len(run)
                self.bytes_sent += sum(map(len, run))
            else:
                try:
                    sock.sendto(data, target)
                except (BlockingIOError, InterruptedError):
                    self.blocked_sends += 1
                    raise
                outbox.popleft()
                self.datagrams_sent += 1
                self.bytes_sent += len(data)
            self.send_calls += 1

    def _run(self, outbox: deque[tuple[bytes, Address]]) -> list[bytes] | None:
        """The datagrams at the head of ``outbox`` that one segmented send can carry: the same
        address, the same size but for a shorter last one; None for fewer than two."""
        first, address = outbox[0]
        size = len(first)
        most = min(_MAX_SEGMENTS, _MAX_RUN_BYTES // size) if size else 0
        if most < 2:
            return None
        run = [first]
        for data, to in itertools.islice(outbox, 1, most):
            if to != address or len(data) > size:
                break
            run.append(data)
            if len(data) < size:
                break
        return run if len(run) > 1 else None

    def _socket_address(self, address: Address) -> Address:
        host, port = address
        if self.family == socket.AF_INET6 and ":" not in host:
            return (f"::ffff:{host}", port)
        return address


def normalise_host(host: str) -> str:
    """IPv4 peers reached through a dual-stack socket appear as ``::ffff:a.b.c.d``: plain IPv4."""
    return host[7:] if host.startswith("::ffff:") and "." in host else host


# Linux's option numbers for "don't fragment, and don't trust the cached path MTU either".
_IP_MTU_DISCOVER, _IPV6_MTU_DISCOVER, _PMTUDISC_PROBE = 10, 23, 3


def forbid_fragmentation(sock: socket.socket) -> bool:
    """Set "don't fragment" on ``sock``'s datagrams, ignoring the kernel's idea of the path MTU
    (``IP_PMTUDISC_PROBE``): a datagram the path does not carry is lost (or refused at once with
    ``EMSGSIZE`` when the local interface cannot carry it), never cut into IP fragments.  That is
    what path MTU discovery needs to learn anything.  Returns whether the kernel took it (Linux
    only; elsewhere datagrams go out as the system decides)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        sock.setsockopt(socket.IPPROTO_IP, _IP_MTU_DISCOVER, _PMTUDISC_PROBE)
        if sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, _IPV6_MTU_DISCOVER, _PMTUDISC_PROBE)
    except OSError:
        return False
    return True


def _set_option(sock: socket.socket, option: int, value: int) -> bool:
    """Set a UDP option and read it back: some network stacks accept and ignore what they do
    not implement (gVisor's does), and only the read-back tells."""
    try:
        sock.setsockopt(_SOL_UDP, option, value)
        return sock.getsockopt(_SOL_UDP, option) == value
    except OSError:
        return False


def _segment_size(ancillary: list[tuple[int, int, bytes]]) -> int:
    for level, kind, data in ancillary:
        if level == _SOL_UDP and kind == _UDP_GRO and len(data) >= _GRO_SIZE.size:
            return int(_GRO_SIZE.unpack_from(data)[0])
    return 0
