"""Package re-exports resolved on first use (PEP 562), listed in a stub.

A package whose modules are used apart (sans-IO cores beside the trio code that drives them)
lists its public names in ``__init__.pyi``, as ``from ._module import Name as Name`` statements
(and annotations of names it defines itself, such as ``__version__: str``), which type checkers
and readers see; its ``__init__.py`` resolves them at run time::

    __getattr__, __dir__, __all__ = lazy_exports(__name__)

Importing one module of the package then loads that module and what it imports, never its
siblings; ``package.DHTNode`` imports ``package._node`` on first access.  (The same convention
as scientific Python's ``lazy_loader`` stubs.)
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["exported_names", "lazy_exports"]


def exported_names(package: str) -> dict[str, tuple[str, str]]:
    """Each name that ``package``'s ``__init__.pyi`` imports, with the module it comes from and
    its name there."""
    init = sys.modules[package].__file__
    if init is None:
        raise TypeError(f"{package} has no __init__ file, so no stub beside it")
    stub = Path(init).with_suffix(".pyi")
    found: dict[str, tuple[str, str]] = {}
    for statement in ast.parse(stub.read_text(), str(stub)).body:
        if isinstance(statement, ast.AnnAssign):
            continue  # a name the package defines itself (``__version__: str``)
        if not isinstance(statement, ast.ImportFrom):
            raise TypeError(f"{stub}: only `from ... import` statements go in the stub")
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
