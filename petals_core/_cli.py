"""What the command-line entry points (``python -m petals_core.server``, ``.dht``) share."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

from ._errors import InvalidMultiaddr

__all__ = ["Refused", "configure_logging", "one_address"]


def configure_logging(level: str) -> None:
    """Log to stderr from ``level`` up (a name such as ``INFO``), with the time and the logger's
    name; aioquic's logger from WARNING up at least, as it logs every handshake at INFO."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("quic").setLevel(max(logging.WARNING, logging.getLogger().level))


class Refused(argparse.Action):
    """A Petals flag with no meaning here: exit 2 saying why."""

    def __init__(self, *args: Any, reason: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error(
            f"{self.option_strings[0]} is a Petals flag that means nothing here: {self.reason}"
        )


def one_address(flag: str, texts: Sequence[str]) -> tuple[str, int]:
    """The host and port of the one QUIC multiaddr ``texts`` holds, for Petals' ``--host_maddrs``
    and ``--announce_maddrs``; :class:`InvalidMultiaddr` saying what is wrong otherwise."""
    from .transport import Multiaddr

    if len(texts) != 1:
        raise InvalidMultiaddr(
            f"{flag}: petals_core listens on and announces one address, not {len(texts)}"
        )
    address = Multiaddr.parse(texts[0])
    if flag == "--host_maddrs" and address.dns is not None:
        raise InvalidMultiaddr(f"{flag}: {texts[0]}: listen on an IP address, not a DNS name")
    if address.peer_id is not None:
        raise InvalidMultiaddr(f"{flag}: {texts[0]} names a PeerID; give the address alone")
    return address.host, address.port
