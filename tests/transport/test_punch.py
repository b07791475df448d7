"""Hole punching through real NATs (network namespaces, nftables routers): a peer punches only to
where its relay saw the dialer, whatever address the dialer names; a punched hole leaves the
calls under way on the relayed connection to finish (on loopback no hole is punched).

The roles run in processes of their own (``_punch_roles``).  Needs root, iproute2 and nftables
(CI installs nftables; elsewhere the test skips, saying how to install it).  The whole
generation through punched holes is in tests/server/test_nat.py.
"""

from __future__ import annotations

import json

import trio

from petals_core.testing import SwarmProcess, Topology, open_host_program
from petals_core.transport import Multiaddr

from ._punch_roles import _PROBES_AT_S

DEADLINE_S = 60
ROLES = "tests.transport._punch_roles"
#: The port the stranger listens at.
STRANGER_PORT = 4242


def _role(name: str, settings: dict[str, object]) -> list[str]:
    return ["-m", ROLES, name, json.dumps(settings)]


async def _say(program: SwarmProcess, line: str) -> None:
    stdin = program.process.stdin
    assert stdin is not None
    await stdin.send_all(line.encode() + b"\n")


async def test_a_peer_punches_to_where_its_relay_saw_the_dialer_not_where_it_is_told(
    topology: Topology,
) -> None:
    """A dialer asks a peer behind a home router to punch to a stranger's address: the peer's
    probes go to the dialer's address as the relay saw it, all of them, and none to the
    stranger (a caller cannot aim a peer's datagrams at a host of its choice)."""
    boot = topology.public("boot")
    home = topology.behind_nat("home", "cone")
    caller = topology.public("caller")
    stranger = topology.public("stranger")
    target = str(Multiaddr(stranger.address, STRANGER_PORT))
    with trio.fail_after(DEADLINE_S):
        async with (
            open_host_program(
                stranger,
                "stranger",
                _role("listener", {"host": stranger.address, "port": STRANGER_PORT}),
            ) as listening,
            open_host_program(boot, "relay", _role("relay", {"host": boot.address})) as relay,
        ):
            relay_address = (await relay.wait_output("READY")).split()[1]
            async with open_host_program(
                home, "peer", _role("peer", {"host": home.address, "relay": relay_address})
            ) as peer:
                relayed = (await peer.wait_output("READY")).split()[1]
                settings = {"host": caller.address, "peer": relayed, "target": target}
                async with open_host_program(caller, "dialer", _role("dialer", settings)) as dialer:
                    reply = json.loads((await dialer.wait_output("REPLY")).split(maxsplit=1)[1])
                    assert reply == {"punching": True}
                    punches = await dialer.wait_output("PUNCHES")
                    assert int(punches.split()[1]) == len(_PROBES_AT_S)
            # All probes were sent at once to whatever the peer aimed at: had any gone to the
            # stranger, they would be there by now.
            stdin = listening.process.stdin
            assert stdin is not None
            await stdin.send_all(b"count\n")
            assert await listening.wait_output("COUNT") == "COUNT 0"


async def test_a_call_under_way_on_the_relayed_connection_outlives_the_punched_hole(
    topology: Topology,
) -> None:
    """A dialer reaches a peer behind a home router through a relay and starts a call there; a
    hole is punched meanwhile.  New work goes directly, the call under way finishes on the
    relayed connection, which then closes, and so does its circuit on the relay.  The relay
    asks every handshake to prove its address first (a QUIC Retry): the peer's, through its
    router, and the dialer's both take one and get through."""
    boot = topology.public("boot")
    home = topology.behind_nat("home", "cone")
    caller = topology.public("caller")
    with trio.fail_after(DEADLINE_S):
        relay_role = _role("relay", {"host": boot.address, "max_unproven_handshakes": 0})
        async with open_host_program(boot, "relay", relay_role) as relay:
            relay_address = (await relay.wait_output("READY")).split()[1]
            async with open_host_program(
                home, "peer", _role("peer", {"host": home.address, "relay": relay_address})
            ) as peer:
                _, relayed, mapping = (await peer.wait_output("READY")).split()
                settings = {"host": caller.address, "peer": relayed, "direct": mapping}
                async with open_host_program(
                    caller, "dialer", _role("dialer_with_a_call", settings)
                ) as dialer:
                    dialer_address = (await dialer.wait_output("READY")).split()[1]
                    assert await dialer.wait_output("PUNCHED") == "PUNCHED direct"
                    assert await dialer.wait_output("NEW WORK") == "NEW WORK direct"
                    # The peer's own new work towards the dialer goes direct too.
                    await _say(peer, dialer_address)
                    assert await peer.wait_output("TOWARDS") == "TOWARDS direct"
                    await _say(dialer, "go on")
                    assert await dialer.wait_output("CALL") == "CALL retfa"
                    await dialer.wait_output("RELAYED CLOSED")
                    await _say(relay, "circuits")
                    retries = await relay.wait_output("NO CIRCUITS")
                    # (One each, or more where an Initial went again before its Retry came.)
                    assert int(retries.split()[-1]) >= 2
