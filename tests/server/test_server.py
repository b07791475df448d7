"""Whether peers can reach a server."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from petals_core import PeerUnreachable
from petals_core.dht import Reachability
from petals_core.server._cli_args import config_from_args, parse_args

from ..client._swarm_helpers import DEADLINE_S, Model, in_process_swarm


async def test_a_server_learns_that_peers_can_dial_it_and_announces_so(
    model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with in_process_swarm(model, tmp_path, [(0, 6), (0, 6)]) as swarm:
            first, second = swarm.servers.values()
            # The first started a swarm: nobody to ask.  The second asks the first.
            assert first.reach is None and second.reach is not None
            with caplog.at_level(logging.INFO, logger="petals_core.server"):
                second.reach.report = None
                report = await second.reach.check()
            assert report.reachability is Reachability.PUBLIC
            listen = second.dht.listen_multiaddr.with_peer_id(None)
            assert report.reachable == (listen,)
            assert f"reachable at {listen} (dialled back by" in caplog.text
            assert second.multiaddrs[0] == second.dht.listen_multiaddr
            info = second.info()
            assert (info.reachability, info.relay) == ("public", True)
            # Peers can dial it: it relays for those they cannot.
            assert second.dht.relay is not None and second.dht.relay.accepting


def test_skip_reachability_check_turns_the_check_off() -> None:
    args = ["m", "--new_swarm", "--skip_reachability_check"]
    assert not config_from_args(parse_args(args)).check_reachability
    assert config_from_args(parse_args(["m", "--new_swarm"])).check_reachability


@pytest.mark.parametrize(
    ("flags", "relay", "auto_relay"),
    [
        ([], True, True),
        (["--use_relay", "--use_auto_relay"], True, True),
        (["--no_relay"], False, True),
        (["--no_auto_relay"], True, False),
        (["--no_relay", "--no_auto_relay"], False, False),
    ],
)
def test_petals_relay_flags(flags: list[str], relay: bool, auto_relay: bool) -> None:
    config = config_from_args(parse_args(["m", "--new_swarm", *flags]))
    assert (config.relay, config.auto_relay) == (relay, auto_relay)


async def test_an_announcement_whose_two_parts_fail_at_once_is_logged_and_the_server_goes_on(
    model: Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Storing the announcement and the model's registry entry fail together: one warning names
    both, and no exception group escapes the announcement."""
    async with in_process_swarm(model, tmp_path, [(0, 3)]) as swarm:
        (server,) = swarm.servers.values()
        both_started = trio.Event()
        started = 0

        async def unreachable(*args: object, **kwargs: object) -> None:
            nonlocal started
            started += 1
            which = started
            if which == 2:
                # The first is woken, and this one fails before any checkpoint: both fail.
                both_started.set()
                raise PeerUnreachable(f"peer {which} gone")
            await both_started.wait()
            raise PeerUnreachable(f"peer {which} gone")

        server.dht.announce = unreachable  # type: ignore[method-assign]
        server._register_model = unreachable  # type: ignore[method-assign]
        with trio.fail_after(DEADLINE_S), caplog.at_level(logging.WARNING):
            await server.announce()
        # The first warning is this announcement's (the server's own later ones fail alone).
        line = next(r.getMessage() for r in caplog.records if "announcing failed" in r.message)
        assert line.count("gone") == 2 and "at the same time: PeerUnreachable" in line
