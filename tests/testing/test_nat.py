"""Hosts behind real NATs (network namespaces, nftables): what each kind of NAT does to a host's
datagrams, seen from public hosts, and that nothing is left behind.  Needs root, iproute2 and
nftables (CI installs nftables; elsewhere the tests skip, saying how to install it)."""

from __future__ import annotations

import json
import subprocess
import sys

from petals_core.testing import Host, Topology, missing_nat_tools, open_topology

from .._system import missing

#: Answers every datagram with the address and port it came from, as JSON; serves 60 s at most.
OBSERVER = """
import json, socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 7000))
sock.settimeout(60)
print("ready", flush=True)
while True:
    data, (host, port) = sock.recvfrom(2048)
    sock.sendto(json.dumps([host, port]).encode(), (host, port))
"""

#: From one socket bound to port 40000: one datagram to each address given, printing each reply
#: (or null after a second without one).
ASKER = """
import json, socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", 40000))
sock.settimeout(1.0)
seen = []
for host in sys.argv[1:]:
    sock.sendto(b"?", (host, 7000))
    try:
        seen.append(json.loads(sock.recvfrom(2048)[0]))
    except TimeoutError:
        seen.append(None)
print(json.dumps(seen))
"""


def _observers(hosts: list[Host]) -> list[subprocess.Popen[str]]:
    processes = []
    for host in hosts:
        process = subprocess.Popen(
            host.command(sys.executable, "-c", OBSERVER), stdout=subprocess.PIPE, text=True
        )
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        processes.append(process)
    return processes


def _ask(host: Host, targets: list[Host]) -> list[tuple[str, int] | None]:
    done = subprocess.run(
        host.command(sys.executable, "-c", ASKER, *(t.address for t in targets)),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [None if seen is None else tuple(seen) for seen in json.loads(done.stdout)]


def test_what_each_nat_shows_public_hosts(topology: Topology) -> None:
    first, second = topology.public("first"), topology.public("second")
    cone = topology.behind_nat("cone", "cone")
    symmetric = topology.behind_nat("sym", "symmetric")
    observers = _observers([first, second])
    try:
        # A public host is seen as it is.
        assert (
            _ask(topology.public("plain"), [first, second])
            == [(topology.hosts["plain"].address, 40000)] * 2
        )
        # Behind a cone NAT: the router's address, one port toward every peer (here its own).
        wan = topology.routers["cone"].wan_address
        assert _ask(cone, [first, second]) == [(wan, 40000)] * 2
        # Behind a symmetric NAT: the router's address, a port of its own per peer.
        seen = _ask(symmetric, [first, second])
        assert all(s is not None and s[0] == topology.routers["sym"].wan_address for s in seen)
        assert seen[0] != seen[1]
    finally:
        for process in observers:
            process.kill()
            process.wait()


def test_a_nat_lets_in_only_replies(topology: Topology) -> None:
    """A datagram to the router's address reaches no one behind it unless it answers one the
    host sent to that address and port."""
    outside = topology.public("outside")
    inside = topology.behind_nat("home", "cone")
    observers = _observers([inside])  # listens on 7000 behind the NAT
    try:
        wan = topology.routers["home"].wan_address
        unsolicited = Host(name="to-wan", netns=outside.netns, address=wan)
        assert _ask(outside, [unsolicited]) == [None]
    finally:
        for process in observers:
            process.kill()
            process.wait()


def test_nothing_is_left_behind() -> None:
    reason = missing_nat_tools()
    if reason is not None:
        missing(f"what NAT tests need ({reason})", "apt-get install -y nftables iproute2")
    with open_topology() as topology:
        topology.public("a")
        topology.behind_nat("b", "symmetric")
        namespaces = [topology.internet, *(h.netns for h in topology.hosts.values())]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)


def test_a_forwarded_port_lets_strangers_in(topology: Topology) -> None:
    """With UDP port 7000 forwarded, a datagram from anywhere reaches the host behind the
    router, at the router's address (from a public host that never heard from it)."""
    outside = topology.public("outside")
    behind = topology.behind_nat("behind", "cone")
    topology.forward_port("behind", 7000)
    (observer,) = _observers([behind])
    try:
        router = topology.routers["behind"]
        (seen,) = _ask(outside, [Host(name="router", netns="", address=router.wan_address)])
        assert seen == (outside.address, 40000)
    finally:
        observer.kill()
        observer.wait()
