"""``python -m petals_core.cli.run_dht``: a DHT node under Petals' module name (the same as
``python -m petals_core.dht``)."""

from __future__ import annotations

import sys

from ..dht.__main__ import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
