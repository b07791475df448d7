"""petals_core: run and fine-tune large language models across machines owned by different people.

The root package's names (the error tree, Petals' model and client classes; listed in
``__init__.pyi``) load on first access, so importing it loads no torch; the transport lives in
``petals_core.transport`` and imports no torch either.
"""

from ._lazy import lazy_exports

__version__ = "0.1.0"

# The names listed in __init__.pyi: each loads on first access (those of the subpackages
# import torch or the network), so that ``import petals_core`` stays light
# (tests/test_layering.py).
__getattr__, __dir__, __all__ = lazy_exports(__name__)
