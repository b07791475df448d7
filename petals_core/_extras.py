"""Optional dependencies, each brought by an extra of the package, and the error that names it.

``pip install petals_core`` brings what clients and servers of a swarm need.  The web faces (the
OpenAI endpoint, the monitor) need ``[http]``; int8 and nf4 quantisation ``[quant]``; loading the
SmolLM2 GGUF checkpoint ``[gguf]``; ``[all]`` brings every one.
"""

from __future__ import annotations

import importlib.util

from ._errors import MissingExtra

__all__ = ["EXTRAS", "require"]

#: The modules each extra brings.
EXTRAS: dict[str, tuple[str, ...]] = {
    "http": ("hypercorn", "starlette", "sse_starlette"),
    "quant": ("bitsandbytes",),
    "gguf": ("gguf", "accelerate"),
}


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` naming ``extra`` if a module it brings is not installed;
    ``what`` is the part of the package that needs it (the error's subject).  Nothing is
    imported: the part imports what it uses when it uses it."""
    missing = [module for module in EXTRAS[extra] if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingExtra(
            f"{what} needs {', '.join(missing)}, which is not installed: "
            f"pip install 'petals_core[{extra}]'"
        )
