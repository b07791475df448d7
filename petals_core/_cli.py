"""What the command-line entry points (``python -m petals_core.server``, ``.dht``) share."""

from __future__ import annotations

import logging

__all__ = ["configure_logging"]


def configure_logging(level: str) -> None:
    """Log to stderr from ``level`` up (a name such as ``INFO``), with the time and the logger's
    name; aioquic's logger from WARNING up at least, as it logs every handshake at INFO."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("quic").setLevel(max(logging.WARNING, logging.getLogger().level))
