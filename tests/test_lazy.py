"""Lazy package re-exports: a name's module loads on first access, type checkers see the same
names as run time, and unknown names still fail."""

from __future__ import annotations

import importlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from petals_core._lazy import exported_names

PACKAGE = Path(__file__).resolve().parents[1] / "petals_core"
#: The packages whose ``__init__`` resolves its names with ``lazy_exports``.
LAZY_PACKAGES = sorted(
    ".".join(path.relative_to(PACKAGE.parent).parts[:-1])
    for path in PACKAGE.rglob("__init__.py")
    if "lazy_exports(__name__)" in path.read_text()
)


def test_the_packages_of_sans_io_modules_are_lazy() -> None:
    assert {
        "petals_core.api",
        "petals_core.client",
        "petals_core.dht",
        "petals_core.server",
        "petals_core.transport",
    } <= set(LAZY_PACKAGES)


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_exported_name_resolves_to_its_origin(package: str) -> None:
    module = importlib.import_module(package)
    names = exported_names(package)
    assert names
    assert module.__all__ == sorted(names)
    assert set(names) <= set(dir(module))
    for name, (origin, attribute) in names.items():
        assert getattr(module, name) is getattr(importlib.import_module(origin), attribute)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'Nothing'"):
        module.Nothing  # noqa: B018


@pytest.fixture
def toy_package(tmp_path: Path) -> Iterator[Path]:
    """The folder of a package ``toy`` exporting ``A`` from ``toy._a`` lazily, importable for
    the test."""
    root = tmp_path / "toy"
    root.mkdir()
    (root / "_a.py").write_text("class A:\n    pass\n")
    (root / "__init__.py").write_text(
        "from petals_core._lazy import lazy_exports\n\n"
        "__getattr__, __dir__, __all__ = lazy_exports(__name__)\n"
    )
    (root / "__init__.pyi").write_text("from ._a import A as A\n")
    sys.path.insert(0, str(tmp_path))
    try:
        yield root
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name == "toy" or name.startswith("toy.")]:
            del sys.modules[name]


def test_a_name_loads_its_module_on_first_access(toy_package: Path) -> None:
    toy = importlib.import_module("toy")
    assert "toy._a" not in sys.modules
    assert toy.__all__ == ["A"]
    assert "A" in dir(toy)
    a = toy.A
    assert a is sys.modules["toy._a"].A
    assert vars(toy)["A"] is a  # later accesses find it without __getattr__
    namespace: dict[str, object] = {}
    exec("from toy import *", namespace)
    assert namespace["A"] is a


def test_only_imports_from_modules_go_in_the_stub(toy_package: Path) -> None:
    stub = toy_package / "__init__.pyi"
    stub.write_text(stub.read_text() + "import toy._a\n")
    with pytest.raises(TypeError, match=re.escape("only `from ... import` statements go in")):
        importlib.import_module("toy")
