"""``python -m petals_core.cli.run_server``: the server's command line under Petals' module name
(the same as ``python -m petals_core.server``)."""

from __future__ import annotations

import sys

from ..server.__main__ import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
