"""``python -m petals_core.demo``: see the package docstring."""

import contextlib
import sys

from ._run import main

if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
