"""Repair datagrams: a lost datagram rebuilt from the rest of its group, without a round trip.

On a path that loses datagrams at random, QUIC sends again what was lost once it learns of the
loss, a round trip or more later, and a stream's data past the hole waits for it.  A step's
tensors are hundreds of datagrams, so on such a path most steps would wait out one such round
trip per hop.

A connection whose path lost datagrams lately follows each run of up to ``group`` of its 1-RTT
datagrams with a *repair*: the XOR of the run's datagrams (each padded with zeros to the longest)
and of their lengths, and a short id of each (its last 4 bytes: the tail of its last packet's
AEAD tag, as good as random).  The receiver keeps the datagrams it received lately; when exactly
one of a run is missing, the XOR of the repair and the others is that datagram, which it hands to
QUIC as if it had just arrived.  QUIC authenticates it like any other, so a wrong or forged
rebuild fails decryption and is dropped.  The sender still takes the datagram for lost and sends
its frames again (the receiver ignores what it already has); what changes is that the stream
need not wait for them.  Two losses in one run are left to QUIC.

A repair that would be larger than 1,200 bytes (what every QUIC path carries) travels in two
halves, each no larger than the run's longest datagram, so a repair never needs more of the path
than its run did.  Wire format of a piece (the first byte is below 0x40, so it is never QUIC: see
``_relay_wire``)::

    0x02 | destination connection id | serial (2) | piece (index << 4 | count) | run length (1)
         | XOR of lengths (2) | longest (2) | ids (4 each) | the piece's share of the XOR

I/O free: the endpoint feeds datagrams in and sends what comes out.
"""

from __future__ import annotations

import random
import struct
from collections import deque
from typing import Any, Final, TypeVar

__all__ = ["REPAIR", "RepairDecoder", "RepairEncoder"]

#: First byte of a repair datagram.
REPAIR: Final = 0x02
#: Bytes of a datagram's tail that name it.
ID_BYTES = 4
#: A repair larger than this is sent in two halves.
WHOLE_REPAIR_BYTES = 1200
#: Runs whose datagrams are all shorter than this (acknowledgements and the like) get no repair.
MIN_PROTECTED_BYTES = 200
#: The most datagrams one repair covers (its run length is one byte, and ids cost 4 bytes each).
MAX_GROUP = 64
#: A decoder that saw this many times its window of datagrams without a repair is idle.
IDLE_WINDOWS = 8
#: A decoder keeps the datagrams of this many of the runs its peer sends (at least).
WINDOW_RUNS = 4
_FIELDS = struct.Struct("!HBBHH")
A = TypeVar("A")


def _is_short_header(data: bytes) -> bool:
    return len(data) > ID_BYTES and data[0] & 0xC0 == 0x40


def _xor(datagrams: list[bytes]) -> int:
    """The XOR of ``datagrams``, each padded with zeros to the longest (as a little-endian
    number, padding is leading zeros)."""
    parity = 0
    for data in datagrams:
        parity ^= int.from_bytes(data, "little")
    return parity


class RepairEncoder:
    """Repairs for one connection's outgoing datagrams.

    ``cid_bytes``: length of the destination connection id that follows a short header's first
    byte (the receiver finds its connection by it).
    """

    def __init__(self, *, group: int, cid_bytes: int) -> None:
        if not 1 <= group <= MAX_GROUP:
            raise ValueError(f"a repair covers 1 to {MAX_GROUP} datagrams, not {group}")
        self.group = group
        self.cid_bytes = cid_bytes
        # A fresh encoder's first serial is unlikely to meet an old encoder's unmatched half.
        self._serial = random.randrange(1 << 16)
        self._run: list[bytes] = []
        self._run_address: Any = None
        #: Repair datagrams produced (pieces).
        self.sent = 0

    def interleave(
        self, datagrams: list[tuple[bytes, A]], limit: int, *, last: bool
    ) -> list[tuple[bytes, A]]:
        """``datagrams`` (payload, address) with a repair after each run of ``group``
        protectable ones: 1-RTT datagrams of at most ``limit`` bytes (larger ones are path MTU
        probes, which may well be lost) to one address.  A run goes on across calls (a paced
        sender hands over a few datagrams at a time) until it is full, or until a call says these
        are the ``last`` for now: then the run so far gets its repair."""
        out: list[tuple[bytes, A]] = []
        for data, address in datagrams:
            if not (_is_short_header(data) and len(data) <= limit):
                out.append((data, address))
                continue
            if self._run and address != self._run_address:
                out += self._close()
            out.append((data, address))
            self._run.append(data)
            self._run_address = address
            if len(self._run) == self.group:
                out += self._close()
        if last and self._run:
            out += self._close()
        return out

    def _close(self) -> list[tuple[bytes, Any]]:
        run, self._run = self._run, []
        return [(piece, self._run_address) for piece in self._repair(run)]

    def _repair(self, run: list[bytes]) -> list[bytes]:
        longest = max(map(len, run))
        if longest < MIN_PROTECTED_BYTES:
            return []
        lengths = 0
        for data in run:
            lengths ^= len(data)
        parity = _xor(run).to_bytes(longest, "little")
        ids = b"".join(data[-ID_BYTES:] for data in run)
        serial = self._serial
        self._serial = (serial + 1) & 0xFFFF
        cid = run[0][1 : 1 + self.cid_bytes]
        head_bytes = 1 + len(cid) + _FIELDS.size + len(ids)
        count = 1 if head_bytes + longest <= WHOLE_REPAIR_BYTES else 2
        share = -(-longest // count)
        pieces = []
        for index in range(count):
            fields = _FIELDS.pack(serial, index << 4 | count, len(run), lengths, longest)
            body = parity[index * share : (index + 1) * share]
            pieces.append(bytes([REPAIR]) + cid + fields + ids + body)
        self.sent += count
        return pieces


class RepairDecoder:
    """Rebuilds one connection's lost datagrams from the repairs that follow them.

    Keeps the last ``window`` 1-RTT datagrams received (by id; more once the peer's runs turn out
    longer, up to ``WINDOW_RUNS`` of the longest runs there are) of at most ``max_bytes`` each,
    and the pieces of a few repairs still incomplete.  What it rebuilds is a 1-RTT datagram of
    the repair's connection, never another repair.
    """

    def __init__(self, *, window: int, cid_bytes: int, max_bytes: int = 65535) -> None:
        self.window = window
        self.cid_bytes = cid_bytes
        self.max_bytes = max_bytes
        self._kept: dict[bytes, bytes] = {}
        self._order: deque[bytes] = deque()
        self._pieces: dict[int, dict[int, bytes]] = {}
        #: Datagrams received since the last repair (a decoder long without repairs is idle).
        self.since_repair = 0
        #: Datagrams rebuilt; repairs that could not rebuild one (nothing or several missing);
        #: repairs that did not parse or disagreed with themselves.
        self.rebuilt = 0
        self.useless = 0
        self.malformed = 0

    @property
    def idle(self) -> bool:
        """Whether the peer stopped sending repairs (the decoder may go)."""
        return self.since_repair > IDLE_WINDOWS * self.window

    def record(self, data: bytes) -> None:
        """A datagram that arrived (or was rebuilt)."""
        if not _is_short_header(data) or len(data) > self.max_bytes:
            return
        self.since_repair += 1
        key = data[-ID_BYTES:]
        if key in self._kept:
            return
        self._kept[key] = data
        self._order.append(key)
        if len(self._order) > self.window:
            self._kept.pop(self._order.popleft(), None)

    def receive(self, piece: bytes) -> bytes | None:
        """A repair piece; the datagram it rebuilds, if it completes a repair that can."""
        self.since_repair = 0
        start = 1 + self.cid_bytes
        if len(piece) < start + _FIELDS.size:
            self.malformed += 1
            return None
        serial, index_count, size, lengths, longest = _FIELDS.unpack_from(piece, start)
        index, count = index_count >> 4, index_count & 0xF
        body_at = start + _FIELDS.size + ID_BYTES * size
        if not (
            1 <= count <= 2
            and index < count
            and 1 <= size <= MAX_GROUP
            and longest <= self.max_bytes
        ):
            self.malformed += 1
            return None
        share = -(-longest // count)
        expected = min(share, longest - index * share)
        if len(piece) != body_at + expected:
            self.malformed += 1
            return None
        self.window = max(self.window, WINDOW_RUNS * size)
        pieces = self._pieces.setdefault(serial, {})
        pieces[index] = piece
        if len(pieces) < count:
            while len(self._pieces) > 4:
                self._pieces.pop(next(iter(self._pieces)))
            return None
        del self._pieces[serial]
        # The halves of one repair agree on everything but their index.
        heads = {p[start + 3 : body_at] for p in pieces.values()}
        if len(heads) != 1:
            self.malformed += 1
            return None
        return self._rebuild([pieces[i] for i in range(count)], body_at, lengths, longest)

    def _rebuild(
        self, pieces: list[bytes], body_at: int, lengths: int, longest: int
    ) -> bytes | None:
        """The datagram that the complete repair ``pieces`` (in order) rebuilds, if exactly one
        of its run is missing."""
        start = 1 + self.cid_bytes
        head = pieces[0]
        ids = [head[at : at + ID_BYTES] for at in range(start + _FIELDS.size, body_at, ID_BYTES)]
        present = [self._kept[i] for i in ids if i in self._kept]
        missing = [i for i in ids if i not in self._kept]
        if len(missing) != 1:
            self.useless += 1
            return None
        parity = b"".join(piece[body_at:] for piece in pieces)
        if any(len(data) > longest for data in present):
            self.malformed += 1
            return None
        length = lengths
        for data in present:
            length ^= len(data)
        value = int.from_bytes(parity, "little") ^ _xor(present)
        if not ID_BYTES < length <= longest or value >= 1 << (8 * length):
            self.malformed += 1
            return None
        rebuilt = value.to_bytes(length, "little")
        if (
            rebuilt[-ID_BYTES:] != missing[0]
            or not _is_short_header(rebuilt)
            or rebuilt[1:start] != head[1:start]
        ):
            self.malformed += 1
            return None
        self.rebuilt += 1
        return rebuilt
