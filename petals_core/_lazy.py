"""Package re-exports resolved on first use (PEP 562).

A package whose modules are used apart (sans-IO cores beside the trio code that drives them)
lists its public names as imports under ``if TYPE_CHECKING:``, which type checkers and readers
see, and resolves them at run time with :func:`lazy_exports`::

    if TYPE_CHECKING:
        from ._node import DHTNode as DHTNode
    else:
        __getattr__, __dir__, __all__ = lazy_exports(__name__)

Importing one module of the package then loads that module and what it imports, never its
siblings; ``package.DHTNode`` imports ``package._node`` on first access.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable

__all__ = ["exported_names", "lazy_exports"]


def exported_names(package: str) -> dict[str, tuple[str, str]]:
    """Each name that ``package``'s ``__init__`` imports under ``if TYPE_CHECKING:``, with the
    module it comes from and its name there."""
    found: dict[str, tuple[str, str]] = {}
    for node in ast.parse(inspect.getsource(sys.modules[package])).body:
        if not (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.ImportFrom):
                raise TypeError(f"{package}: only `from ... import` goes under TYPE_CHECKING")
            origin = importlib.util.resolve_name(
                "." * statement.level + (statement.module or ""), package
            )
            for alias in statement.names:
                found[alias.asname or alias.name] = (origin, alias.name)
    return found


def lazy_exports(
    package: str,
) -> tuple[Callable[[str], object], Callable[[], list[str]], list[str]]:
    """The module ``__getattr__``, ``__dir__`` and ``__all__`` of ``package`` (its ``__name__``,
    called from its ``__init__``), which exports :func:`exported_names`."""
    module = sys.modules[package]
    names = exported_names(package)

    def __getattr__(name: str) -> object:
        origin = names.get(name)
        if origin is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(origin[0]), origin[1])
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *names})

    return __getattr__, __dir__, sorted(names)
