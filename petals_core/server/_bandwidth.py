"""The network bandwidth a server announces its throughput with: given, measured, or assumed.

``--network_bandwidth`` wins, and then nothing is measured.  Otherwise the server speed-tests a
few peers at start (``dht.speed_test``, see :func:`~petals_core.dht.measure_bandwidth`) within
:data:`SPEED_TEST_TIMEOUT_S`, and announces the lesser of the best upload and the best download
rate.  When no peer gives a rate both ways (none answered, none to ask, too slow to tell), it
assumes :data:`DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S`: the server starts either way.  One INFO
line says which.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, Literal

import attrs

from ..dht import BandwidthReport, measure_bandwidth
from ..transport import Node
from ._throughput import DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S

__all__ = ["SPEED_TEST_TIMEOUT_S", "NetworkBandwidth", "find_network_bandwidth"]

logger = logging.getLogger("petals_core.server")

#: How long a server's speed tests may take at start, all peers together.
SPEED_TEST_TIMEOUT_S: Final = 6.0


@attrs.frozen(kw_only=True)
class NetworkBandwidth:
    """The bandwidth a server uses for its ``network_rps``, where it came from and why."""

    bits_per_s: float
    source: Literal["given", "measured", "assumed"]
    #: The speed tests run (None: none were).
    report: BandwidthReport | None = None
    #: Why the bandwidth is assumed.
    reason: str | None = None

    def __str__(self) -> str:
        head = f"network bandwidth: {self.bits_per_s / 1e6:.0f} Mbit/s"
        if self.source == "given":
            return f"{head} given by --network_bandwidth"
        if self.source == "assumed":
            return f"{head} assumed ({self.reason})"
        assert self.report is not None
        up, down = self.report.upload_bits_per_s, self.report.download_bits_per_s
        assert up is not None and down is not None
        peers = self.report.peers_measured
        return (
            f"{head} measured to {peers} peer{'s' if peers != 1 else ''} "
            f"(up {up / 1e6:.0f}, down {down / 1e6:.0f})"
        )


async def find_network_bandwidth(
    given: float | None,
    node: Node,
    peers: Sequence[str],
    *,
    timeout_s: float = SPEED_TEST_TIMEOUT_S,
) -> NetworkBandwidth:
    """``given`` if not None, else measured to ``peers`` (multiaddrs) within ``timeout_s``, else
    assumed; logs which (see the module)."""
    if given is not None:
        bandwidth = NetworkBandwidth(bits_per_s=given, source="given")
    else:
        try:
            report = await measure_bandwidth(node, peers, timeout_s=timeout_s)
            reason = _why_unmeasured(report)
        except Exception as exc:
            # Peers' failures are in the report: this is a bug, which must not stop the start.
            logger.warning("the speed test failed", exc_info=True)
            report, reason = BandwidthReport(), f"the speed test failed: {exc!r}"
        measured = report.bits_per_s
        if measured is not None:
            bandwidth = NetworkBandwidth(bits_per_s=measured, source="measured", report=report)
        else:
            bandwidth = NetworkBandwidth(
                bits_per_s=DEFAULT_NETWORK_BANDWIDTH_BITS_PER_S,
                source="assumed",
                report=report,
                reason=reason,
            )
    logger.info("%s", bandwidth)
    return bandwidth


def _why_unmeasured(report: BandwidthReport) -> str | None:
    if report.bits_per_s is not None:
        return None
    if not report.results:
        return "no peer to run the speed test with"
    if report.upload_bits_per_s is None and report.download_bits_per_s is None:
        errors = "; ".join(f"{r.peer}: {r.error}" for r in report.results)
        return f"no peer answered the speed test: {errors}"
    way = "upload" if report.download_bits_per_s is None else "download"
    return f"the speed test measured only the {way}"
