"""What a connection learns of its path, and keeps: congestion window, pacing and datagram size.

aioquic's congestion controllers follow the letter of their RFCs in ways that cost a swarm dearly:
a step's tensors (hundreds of kB) leave every few seconds on a connection that idles in between.

* **The window survives idle gaps.**  aioquic's CUBIC falls back to its initial window after two
  seconds without an ACK, so every step after a pause slow-starts again and needs several round
  trips for what one carried before.  Here the window stays; what makes a full window after a
  pause safe is pacing (RFC 9002 section 7.7): it leaves at ``PACING_GAIN`` times window / RTT
  (``SLOW_START_PACING_GAIN`` in slow start), spread over the round trip, not as one burst.
  Both controllers also grow their window only while it limits the sender (RFC 9002 section
  7.8): a connection that carries small requests for an hour has not learned that the path
  carries megabytes, and must not believe it.  CUBIC's clock stops while the window does not
  limit (RFC 9438 section 5.8), so a pause is not mistaken for time spent probing.  Slow start
  ends at loss only, not at the first rise of the RTT as in aioquic (a swarm's RTTs include a
  peer's busy event loop, so they rise whenever a server computes).
* **Random loss is not congestion.**  Links between homes lose a packet here and there that no
  queue overflowed for; halving the window for each (as Reno and CUBIC do) caps a path that
  loses 0.5% of its packets at about 17 packets per round trip, whatever its capacity.  As BBR
  does, losses count as congestion only above ``LOSS_TOLERANCE`` of the packets sent lately (a
  queue that overflows loses many in a row); below it, the lost packets are sent again and the
  window stays.  Persistent congestion (everything lost for several probe timeouts) still
  collapses it.
* **The datagram size is discovered** (datagram packetization layer PMTU discovery, RFC 8899 and
  RFC 9000 section 14.3).  A connection starts at QUIC's 1,200 bytes and probes larger sizes up to
  a ceiling with padded PING packets; a size whose probe is acknowledged is used from then on,
  one lost ``PROBE_ATTEMPTS`` times is too large for the path.  The search tries the ceiling first
  (most paths carry it), then halves the gap between what worked and what did not, down to
  ``PROBE_RESOLUTION`` bytes.  A lost probe says nothing about congestion and leaves the window
  alone.  When the path stops carrying the size in use (``BLACK_HOLE_TIMEOUTS`` probe timeouts in
  a row: nothing sent was acknowledged), the connection falls back to 1,200 bytes and searches
  again.  Probes are only sent with the socket's "don't fragment" flag set (see ``_node``), or
  the kernel would fragment them and every size would seem to work.

:class:`MtuSearch` is the search alone; :func:`congestion_control` makes the controllers;
``_quic.PeerQuicConnection`` sends the probes.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from aioquic.quic.congestion.base import K_INITIAL_WINDOW, QuicCongestionControl
from aioquic.quic.congestion.cubic import CubicCongestionControl
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.packet_builder import QuicSentPacket

__all__ = [
    "BASE_DATAGRAM_BYTES",
    "BLACK_HOLE_TIMEOUTS",
    "LOSS_TOLERANCE",
    "PathInfo",
    "PACING_GAIN",
    "SLOW_START_PACING_GAIN",
    "PROBE_ATTEMPTS",
    "PROBE_RESOLUTION",
    "MtuSearch",
    "PathCongestionControl",
    "congestion_control",
]

#: The datagram size every QUIC path must carry (RFC 9000 section 14): where the search starts.
BASE_DATAGRAM_BYTES = 1200
#: Sends are paced at this many times window / RTT (RFC 9002 section 7.7 suggests 1.25), so that
#: jitter in the RTT does not leave the window unused; in slow start at ``SLOW_START_PACING_GAIN``
#: times, so that a window the connection may double is not spread over the whole round trip
#: (Linux paces TCP at 2x and 1.2x).
PACING_GAIN = 1.25
SLOW_START_PACING_GAIN = 2.0
#: A probe size lost this many times in a row is too large for the path (RFC 8899's MAX_PROBES).
PROBE_ATTEMPTS = 3
#: The search stops when what worked and what did not are this close.
PROBE_RESOLUTION = 32
#: Probe timeouts in a row after which the datagram size in use is no longer trusted.
BLACK_HOLE_TIMEOUTS = 3
#: Losses below this share of the packets sent lately are not taken for congestion (BBR's 2%).
LOSS_TOLERANCE = 0.02
#: "Lately": about the last this many to twice this many packets sent.
LOSS_WINDOW_PACKETS = 256
#: A path that lost a packet counts as losing until this many more were sent without a loss.
#: Long, because the repairs sent on a losing path (see ``_repair``) hide most of its losses.
LOSING_PACKETS = 16384


@attrs.frozen(kw_only=True)
class PathInfo:
    """What a connection knows of its path now."""

    #: The largest datagram it sends (UDP payload bytes).
    datagram_bytes: int
    #: Whether the search for that size is over.
    datagram_search_done: bool
    #: Smoothed round-trip time (seconds; 0 before the first sample).
    rtt_s: float
    #: Congestion window (bytes in flight allowed).
    congestion_window_bytes: int
    #: Whether a packet (other than a path MTU probe) was lost lately (see ``LOSING_PACKETS``).
    losing: bool = False


@attrs.define
class MtuSearch:
    """Which datagram size to probe next, from what earlier probes told.

    ``floor`` is the largest size known to pass (at first :data:`BASE_DATAGRAM_BYTES`); sizes from
    ``failed`` up are known not to.  I/O free: the caller sends probes and reports their fate.
    """

    ceiling: int
    floor: int = BASE_DATAGRAM_BYTES
    failed: int = attrs.field(init=False)
    #: Losses of the size now being probed.
    attempts: int = attrs.field(default=0, init=False)
    #: The size of the probe in flight, if any.
    in_flight: int | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.failed = self.ceiling + 1

    @property
    def done(self) -> bool:
        if self.floor >= self.ceiling:
            return True
        # The ceiling is always tried; after it failed, sizes closer than this are not.
        return self.failed <= self.ceiling and self.failed - self.floor <= PROBE_RESOLUTION

    def next_size(self) -> int | None:
        """The size to probe now, or None (one is in flight, or the search is over)."""
        if self.in_flight is not None or self.done:
            return None
        if self.failed > self.ceiling:
            return self.ceiling
        return (self.floor + self.failed) // 2

    def sent(self, size: int) -> None:
        self.in_flight = size

    def acknowledged(self, size: int) -> None:
        self.in_flight = None
        self.attempts = 0
        self.floor = max(self.floor, size)

    def lost(self, size: int) -> None:
        self.in_flight = None
        self.attempts += 1
        if self.attempts >= PROBE_ATTEMPTS:
            self.attempts = 0
            self.failed = min(self.failed, size)

    def restart(self) -> None:
        """The path no longer carries ``floor``: start again from the base size."""
        self.floor = BASE_DATAGRAM_BYTES
        self.failed = self.ceiling + 1
        self.attempts = 0
        self.in_flight = None


class PathCongestionControl(QuicCongestionControl):
    """The changes described in the module docstring, over one of aioquic's controllers.

    A mixin: it comes first in the bases of a class that also derives from an aioquic controller.
    """

    _max_datagram_size: int

    def _init_path(self) -> None:
        #: Packet numbers of PMTU probes in flight: their loss is no congestion signal.
        self.probe_packets: set[int] = set()
        self._limited_at = -1.0
        self._rtt = 0.0
        self._probes_only = False
        # Packets sent and lost lately (both halved now and then: a sliding count).
        self._recent_sent = 0.0
        self._recent_lost = 0.0
        # Packets sent since the last loss (None: none lost yet).
        self._sent_since_loss: int | None = None

    @property
    def in_slow_start(self) -> bool:
        return self.ssthresh is None or self.congestion_window < self.ssthresh

    @property
    def losing(self) -> bool:
        """Whether a packet other than a path MTU probe was lost within the last
        ``LOSING_PACKETS`` sent, at random: losses of more than ``LOSS_TOLERANCE`` of the
        packets sent lately are congestion, which sending more would make worse."""
        return (
            self._sent_since_loss is not None
            and self._sent_since_loss < LOSING_PACKETS
            and not self._congested()
        )

    def _congested(self) -> bool:
        return self._recent_lost > LOSS_TOLERANCE * max(self._recent_sent, LOSS_WINDOW_PACKETS)

    def pacing_gain(self) -> float:
        """How many times window / RTT to pace at now."""
        return SLOW_START_PACING_GAIN if self.in_slow_start else PACING_GAIN

    def window_limited(self) -> bool:
        """Whether the window holds the sender back now: in slow start, when at least half of
        it is in flight (it may double in a round trip); else when another datagram would not
        fit."""
        window = self.congestion_window
        if self.in_slow_start:
            return 2 * self.bytes_in_flight >= window
        return self.bytes_in_flight + self._max_datagram_size > window

    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        # Counted here for both controllers: CUBIC's own method would also reset its window
        # after an idle gap.
        self.bytes_in_flight += packet.sent_bytes
        if self.window_limited() and packet.sent_time is not None:
            self._limited_at = packet.sent_time
        self._recent_sent += 1
        if self._sent_since_loss is not None:
            self._sent_since_loss += 1
        if self._recent_sent >= 2 * LOSS_WINDOW_PACKETS:
            self._recent_sent /= 2
            self._recent_lost /= 2

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        self.probe_packets.discard(packet.packet_number)
        # Sent while the window limited the sender, or within a round trip after: the ACK
        # tells something about the window, and it may grow.
        if (packet.sent_time or 0.0) <= self._limited_at + self._rtt:
            self._resume(now)
            super().on_packet_acked(now=now, packet=packet)  # type: ignore[safe-super]
        else:
            self.bytes_in_flight -= packet.sent_bytes
            self._pause(now)

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        ordinary = []
        for packet in packets:
            if packet.packet_number in self.probe_packets:
                self.probe_packets.discard(packet.packet_number)
                self.bytes_in_flight -= packet.sent_bytes
            else:
                ordinary.append(packet)
        self._probes_only = not ordinary
        if not ordinary:
            return
        self._recent_lost += len(ordinary)
        self._sent_since_loss = 0
        if self._congested():
            super().on_packets_lost(now=now, packets=ordinary)  # type: ignore[safe-super]
        else:
            # Lost at random: sent again (by the connection), the window stays.
            for packet in ordinary:
                self.bytes_in_flight -= packet.sent_bytes

    def on_packets_expired(self, *, packets: Iterable[QuicSentPacket]) -> None:
        packets = list(packets)
        self.probe_packets.difference_update(packet.packet_number for packet in packets)
        super().on_packets_expired(packets=packets)  # type: ignore[safe-super]

    def on_persistent_congestion(self) -> None:
        if not self._probes_only:
            super().on_persistent_congestion()  # type: ignore[safe-super]

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        # aioquic's controllers also leave slow start at the first rise of the RTT (a crude
        # HyStart).  On a swarm's paths the RTT includes the peer's event loop, which a
        # compute step keeps busy, so it rises whenever a server works: slow start would end
        # long before the window fits a step's tensors.  Loss above the tolerance ends it.
        self._rtt = rtt

    def set_datagram_size(self, size: int) -> None:
        """The connection now sends datagrams of ``size``: before the first loss, the window is
        at least the initial window of that size."""
        if self.ssthresh is None:
            self.congestion_window = max(self.congestion_window, K_INITIAL_WINDOW * size)
        self._max_datagram_size = size

    def _pause(self, now: float) -> None:
        """The window does not limit the sender from ``now`` on (see :class:`_Cubic`)."""

    def _resume(self, now: float) -> None:
        """The window limits the sender again (see :class:`_Cubic`)."""


class _Reno(PathCongestionControl, RenoCongestionControl):
    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._init_path()


class _Cubic(PathCongestionControl, CubicCongestionControl):
    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self._init_path()
        self._paused_at: float | None = None

    def _pause(self, now: float) -> None:
        if self._paused_at is None:
            self._paused_at = now

    def _resume(self, now: float) -> None:
        # CUBIC's window is a function of the time since its epoch: time spent not using the
        # window does not count (its epoch moves forward by the pause).
        if self._paused_at is not None:
            if self._t_epoch:
                self._t_epoch += now - self._paused_at
            self._paused_at = None

    def on_packet_acked(self, *, now: float, packet: QuicSentPacket) -> None:
        super().on_packet_acked(now=now, packet=packet)
        if not self.bytes_in_flight:
            self._pause(now)

    def set_datagram_size(self, size: int) -> None:
        super().set_datagram_size(size)
        self.additive_increase_factor = size

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        super().on_rtt_measurement(now=now, rtt=rtt)
        self.rtt = rtt  # what CUBIC's window function looks ahead by


_CONTROLLERS: dict[str, type[PathCongestionControl]] = {"reno": _Reno, "cubic": _Cubic}


def congestion_control(
    name: str, *, max_datagram_size: int, initial_datagram_size: int
) -> PathCongestionControl:
    """A controller by name ("reno" or "cubic"), with the changes of this module, for a
    connection that starts with datagrams of ``initial_datagram_size`` and may find that the
    path carries up to ``max_datagram_size``: its initial window is ten of the larger (on a path
    of 1,452 bytes, RFC 9002's 14,720 bytes at most; on loopback, where nothing queues but the
    receiver, as aioquic's own), so that a connection does not wait on its window while it
    probes."""
    controller = _CONTROLLERS[name](max_datagram_size=initial_datagram_size)
    controller.congestion_window = K_INITIAL_WINDOW * max(max_datagram_size, initial_datagram_size)
    return controller
