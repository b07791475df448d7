"""Hosts behind real NATs, on one machine: network namespaces joined by a bridge, with NAT routers
made of nftables rules, for tests of what crosses a NAT.

A :class:`Topology` is an "Internet": a bridge in a namespace of its own, on 198.51.100.0/24.
:meth:`Topology.public` adds a host on it; :meth:`Topology.behind_nat` adds a router (its WAN
address on the Internet) and a host on a LAN of its own behind it (a /28 of 203.0.113.0/24,
then of 192.0.2.0/24).  The router forwards the LAN out and rewrites its sources
(``masquerade``), and drops what comes in unasked (a home router's filter: only replies to what
the LAN sent pass; nothing unasked reaches the router itself either).  Two kinds of mapping:

- ``"cone"``: Linux's default masquerade keeps a host's source port toward every destination
  (endpoint-independent mapping), as most home routers do; what comes in must answer what went
  out to that address and port;
- ``"symmetric"``: ``masquerade random,fully-random``, a new port per destination, as
  carrier-grade NATs do.

Only documentation address ranges are used (RFC 5737), never the machine's own network: the
namespaces have no route out.  A process runs inside a host with :meth:`Host.command` (``ip
netns exec``).  Everything is removed on :meth:`Topology.close` (the context manager
:func:`open_topology` does it), also after a failure half-way.

Needs root, ``ip`` (iproute2) and ``nft`` (nftables): :func:`missing_nat_tools` says what is
missing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from typing import Literal

import attrs

__all__ = ["Host", "NatKind", "Router", "Topology", "missing_nat_tools", "open_topology"]

NatKind = Literal["cone", "symmetric"]

#: The Internet's addresses; its hosts and the routers' WAN sides take them in turn.
INTERNET = ipaddress.ip_network("198.51.100.0/24")
#: The LANs behind routers: /28s of these, in turn.
LANS = (ipaddress.ip_network("203.0.113.0/24"), ipaddress.ip_network("192.0.2.0/24"))
_topologies = itertools.count()


def missing_nat_tools() -> str | None:
    """Why topologies cannot be built here (not root, no ``ip``, no ``nft``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install -y {package})"
    return None


@attrs.frozen(kw_only=True)
class Host:
    """A host: its network namespace and its address (on the Internet, or on its LAN)."""

    name: str
    netns: str
    address: str

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@attrs.frozen(kw_only=True)
class Router:
    """A NAT router: its namespace, its addresses on the Internet and on its LAN, and the kind
    of its mapping."""

    name: str
    netns: str
    wan_address: str
    lan_address: str
    kind: NatKind

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def set_udp_timeout(self, seconds: int) -> None:
        """How long an idle UDP mapping lives (conntrack's timeouts, for both directions)."""
        for name in ("nf_conntrack_udp_timeout", "nf_conntrack_udp_timeout_stream"):
            _run(self.command("sysctl", "-q", "-w", f"net.netfilter.{name}={seconds}"))


class Topology:
    """Namespaces with an Internet bridge, public hosts and NAT'd LANs (see the module)."""

    def __init__(self) -> None:
        self.id = f"{os.getpid() % 10000}{next(_topologies)}"
        self._namespaces: list[str] = []
        self._hosts = iter(INTERNET.hosts())
        next(self._hosts)  # .1 left out, as a gateway would be
        self._lans = (subnet for lan in LANS for subnet in lan.subnets(new_prefix=28))
        self._links = itertools.count()
        self.internet = f"pc{self.id}-inet"
        self.hosts: dict[str, Host] = {}
        self.routers: dict[str, Router] = {}

    def build(self) -> None:
        """The Internet's bridge (:func:`open_topology` calls it)."""
        self._namespace("inet")
        _run(["ip", "-n", self.internet, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.internet, "link", "set", "br0", "up"])

    def public(self, name: str) -> Host:
        """A host on the Internet, with an address of its own."""
        netns = self._namespace(name)
        address = str(next(self._hosts))
        self._link_to_internet(netns, "eth0", address)
        host = Host(name=name, netns=netns, address=address)
        self.hosts[name] = host
        return host

    def behind_nat(self, name: str, kind: NatKind = "cone") -> Host:
        """A host on a LAN of its own behind a NAT router of ``kind`` (the router is
        ``routers[name]``)."""
        if kind not in ("cone", "symmetric"):
            raise ValueError(f"kind must be 'cone' or 'symmetric', not {kind!r}")
        router_ns = self._namespace(f"{name}-r")
        wan = str(next(self._hosts))
        self._link_to_internet(router_ns, "wan", wan)
        lan = next(self._lans)
        gateway, address = (str(ip) for ip in itertools.islice(lan.hosts(), 2))
        netns = self._namespace(name)
        inside, outside = self._veth()
        _run(["ip", "link", "add", inside, "type", "veth", "peer", "name", outside])
        _run(["ip", "link", "set", inside, "netns", netns])
        _run(["ip", "link", "set", outside, "netns", router_ns])
        _run(["ip", "-n", netns, "link", "set", inside, "name", "eth0"])
        _run(["ip", "-n", router_ns, "link", "set", outside, "name", "lan"])
        _address(netns, "eth0", f"{address}/{lan.prefixlen}")
        _address(router_ns, "lan", f"{gateway}/{lan.prefixlen}")
        _run(["ip", "-n", netns, "route", "add", "default", "via", gateway])
        _run(["ip", "netns", "exec", router_ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
        router = Router(name=name, netns=router_ns, wan_address=wan, lan_address=gateway, kind=kind)
        _nat_rules(router)
        self.routers[name] = router
        host = Host(name=name, netns=netns, address=address)
        self.hosts[name] = host
        return host

    def forward_port(self, name: str, port: int) -> None:
        """Forward UDP ``port`` of router ``name``'s WAN address to the same port of the host
        behind it (what a user sets up in a home router's page)."""
        router, host = self.routers[name], self.hosts[name]
        rules = f"""
table ip nat {{
    chain prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        iifname "wan" udp dport {port} dnat to {host.address}:{port}
    }}
}}
insert rule ip filter forward iifname "wan" ct status dnat accept
"""
        _run(router.command("nft", "-f", "-"), stdin=rules)

    def set_mtu(self, netns: str, interface: str, mtu: int) -> None:
        """Give ``interface`` of namespace ``netns`` an MTU of ``mtu`` bytes (a host's
        ``eth0``, a router's ``wan`` or ``lan``): it neither sends nor takes larger packets."""
        _run(["ip", "-n", netns, "link", "set", interface, "mtu", str(mtu)])

    def interface_bytes(self, host: Host, interface: str = "eth0") -> tuple[int, int]:
        """Bytes received and sent on a host's interface so far."""
        counts = []
        for direction in ("rx_bytes", "tx_bytes"):
            out = _run(
                host.command("cat", f"/sys/class/net/{interface}/statistics/{direction}"),
                capture=True,
            )
            counts.append(int(out))
        return counts[0], counts[1]

    def close(self) -> None:
        """Remove every namespace (their links go with them); safe to call twice."""
        for netns in reversed(self._namespaces):
            _run(["ip", "netns", "del", netns], check=False)
        self._namespaces.clear()

    # -- building ------------------------------------------------------------------------------

    def _namespace(self, name: str) -> str:
        netns = f"pc{self.id}-{name}"
        _run(["ip", "netns", "add", netns])
        self._namespaces.append(netns)
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        return netns

    def _veth(self) -> tuple[str, str]:
        """Two fresh interface names (at most 15 characters, unique on this machine)."""
        link = next(self._links)
        return f"pc{self.id}a{link}", f"pc{self.id}b{link}"

    def _link_to_internet(self, netns: str, interface: str, address: str) -> None:
        inside, outside = self._veth()
        _run(["ip", "link", "add", inside, "type", "veth", "peer", "name", outside])
        _run(["ip", "link", "set", inside, "netns", netns])
        _run(["ip", "link", "set", outside, "netns", self.internet])
        _run(["ip", "-n", netns, "link", "set", inside, "name", interface])
        _run(["ip", "-n", self.internet, "link", "set", outside, "master", "br0"])
        _run(["ip", "-n", self.internet, "link", "set", outside, "up"])
        _address(netns, interface, f"{address}/{INTERNET.prefixlen}")


def _nat_rules(router: Router) -> None:
    """A home router's rules: the LAN goes out rewritten; only replies come in."""
    masquerade = "masquerade random,fully-random" if router.kind == "symmetric" else "masquerade"
    rules = f"""
table ip nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "wan" {masquerade}
    }}
}}
table ip filter {{
    chain forward {{
        type filter hook forward priority filter; policy drop;
        ct state established,related accept
        iifname "lan" oifname "wan" accept
    }}
    chain input {{
        type filter hook input priority filter; policy drop;
        ct state established,related accept
        iifname {{ "lo", "lan" }} accept
    }}
}}
"""
    _run(router.command("nft", "-f", "-"), stdin=rules)


def _address(netns: str, interface: str, cidr: str) -> None:
    _run(["ip", "-n", netns, "addr", "add", cidr, "dev", interface])
    _run(["ip", "-n", netns, "link", "set", interface, "up"])


def _run(
    command: Sequence[str], *, check: bool = True, capture: bool = False, stdin: str | None = None
) -> str:
    done = subprocess.run(
        list(command), input=stdin, capture_output=True, text=True, check=False, timeout=30
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip() or done.stdout}")
    return done.stdout if capture else ""


@contextlib.contextmanager
def open_topology() -> Iterator[Topology]:
    """A :class:`Topology`, removed on exit (also when building it fails half-way)."""
    topology = Topology()
    try:
        topology.build()
        yield topology
    finally:
        topology.close()
