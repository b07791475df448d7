"""The layering rules of the architecture, checked by importing in fresh interpreters and by
reading the import statements of each package."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from ._fresh import MODEL_STACK, run_fresh

HEAVY = ("torch", "transformers", "triton")
#: What model code must not import: our network layers, routing, and the layer above the client
#: (trio itself may come in through huggingface_hub's HTTP client).
ABOVE_MODELS = (
    "petals_core.transport",
    "petals_core.dht",
    "petals_core.routing",
    "petals_core.client",
    "petals_core.distributed",
)
#: Every package below the Hugging Face-facing models (``petals_core.distributed``).
BELOW_DISTRIBUTED = (
    "petals_core",
    "petals_core.transport",
    "petals_core.kernels",
    "petals_core.models",
    "petals_core.dht",
    "petals_core.routing",
    "petals_core.server",
    "petals_core.client",
    "petals_core.testing",
    "petals_core.monitor",
)
#: The top layer: the HTTP faces and the stack only they use.
TOP = ("petals_core.api", "petals_core.monitor", "petals_core._http")
PACKAGE = Path(__file__).resolve().parents[1] / "petals_core"
#: Third-party modules that torch and transformers do not import.
NOT_IN_MODEL_STACK = ("aioquic",)
#: The part of the model stack below transformers (which loads trio), and what it does not import.
TORCH_STACK = ("numpy", "torch", "safetensors.torch", "huggingface_hub")
NOT_IN_TORCH_STACK = ("aioquic", "trio", "transformers")


def _imported_after(module: str, watched: tuple[str, ...]) -> list[str]:
    """Which of ``watched`` are loaded once ``module`` is imported into an interpreter that has
    loaded nothing of petals_core (the checks of this file are run together, see
    :func:`_fresh_imports`)."""
    found = _fresh_imports().get((module, watched))
    if found is None:
        found = _run_checks(watched, [module])[module]
    return found


def _run_checks(watched: tuple[str, ...], modules: list[str]) -> dict[str, list[str]]:
    # The third-party model stack, or its torch part, is preloaded where no module it may load is
    # watched (the driver fails if it loaded one anyway).
    preload: tuple[str, ...] = ()
    for stack, absent in ((MODEL_STACK, NOT_IN_MODEL_STACK), (TORCH_STACK, NOT_IN_TORCH_STACK)):
        if all(_within(name, ("petals_core", *absent)) for name in watched):
            preload = stack
            break
    snippets = {
        module: f"import sys, {module}\n"
        f"print(','.join(m for m in {watched!r} if m in sys.modules))\n"
        for module in modules
    }
    results = run_fresh(snippets, preload=preload, absent=watched)
    return {
        module: [name for name in fresh.check().strip().split(",") if name]
        for module, fresh in results.items()
    }


@functools.cache
def _fresh_imports() -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """Every check of :data:`_CHECKS`, a driver process per watched set."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for module, watched in _CHECKS:
        groups.setdefault(watched, []).append(module)
    return {
        (module, watched): found
        for watched, modules in groups.items()
        for module, found in _run_checks(watched, modules).items()
    }


TORCHLESS = (
    "petals_core",
    "petals_core._groups",
    "petals_core._cli",
    "petals_core.transport",
    "petals_core.testing",
    "petals_core.dht",
    "petals_core.routing",
    "petals_core.monitor",
)
MODEL_CODE = (
    "petals_core.models",
    "petals_core.models.llama",
    "petals_core.models.bloom",
    "petals_core.models.falcon",
    "petals_core.models.mixtral",
    "petals_core.models._loading",
    "petals_core.models._lora_loading",
    "petals_core.models._config",
    "petals_core.models._cpu_decode",
    "petals_core.models._span_steps",
    "petals_core.kernels",
)
NETWORK = ("aioquic", *ABOVE_MODELS)
# The server, the client and the testing swarm import every other lower layer.
LOWER_LAYERS = (
    "petals_core",
    "petals_core.server",
    "petals_core.client",
    "petals_core.testing",
    "petals_core.monitor",
)
DISTRIBUTED = ("petals_core.distributed",)
#: Modules that only keep state and decide: fed events, they answer with what to send.
SANS_IO = (
    "petals_core.protocol",
    "petals_core.client._session_core",
    "petals_core.api._job",
    "petals_core.server._session_state",
    "petals_core.routing",
    "petals_core.dht._routing",
    "petals_core.dht._lookup",
    "petals_core.dht._gossip",
    "petals_core.dht._record_store",
    "petals_core.transport._codec",
)
#: What a sans-IO module must not import: an event loop, a clock, sockets or threads.
IO = ("trio", "anyio", "asyncio", "time", "socket", "threading", "select", "selectors")
#: What importing a sans-IO module must not load, through every import on the way (package
#: ``__init__`` files included): the event loop and the QUIC stack.
LOOP_AND_NETWORK = ("trio", "aioquic")


def _module_files(module: str) -> list[Path]:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def _modules_in(module: str) -> list[str]:
    """``module``, and each module of it if it is a package."""
    found = []
    for path in _module_files(module):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


SANS_IO_MODULES = tuple(name for module in SANS_IO for name in _modules_in(module))
#: What importing routing must not load: the server's choice of blocks loads no client.
ROUTING_LOADS_NEITHER = ("petals_core.client", "petals_core.server")
_CHECKS = (
    *((module, HEAVY) for module in TORCHLESS),
    *((module, NETWORK) for module in MODEL_CODE),
    *((module, DISTRIBUTED) for module in LOWER_LAYERS),
    *((module, LOOP_AND_NETWORK) for module in SANS_IO_MODULES),
    ("petals_core.routing", ROUTING_LOADS_NEITHER),
)


@pytest.mark.parametrize("module", TORCHLESS)
def test_transport_imports_no_torch(module: str) -> None:
    assert _imported_after(module, HEAVY) == []


@pytest.mark.parametrize("module", MODEL_CODE)
def test_model_code_knows_nothing_of_the_network(module: str) -> None:
    assert _imported_after(module, NETWORK) == []


def test_kernels_import_no_triton_on_cpu() -> None:
    # Triton is loaded only when a CUDA tensor first needs a kernel.
    assert _imported_after("petals_core.kernels", ("triton",)) == []


def _imports_in(package: str) -> dict[str, set[str]]:
    """What each file of ``package`` imports, as absolute names, lazy imports inside functions
    included."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.joinpath(*package.split(".")[1:]).rglob("*.py")):
        # The package a relative import starts from (for __init__.py, its own).
        here = path.relative_to(PACKAGE.parent).parts[:-1]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else ()
                stem = ".".join([*base, node.module] if node.module else base)
                names.add(stem)
                names.update(f"{stem}.{alias.name}" for alias in node.names)
        found[path.relative_to(PACKAGE.parent).as_posix()] = names
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def test_models_import_nothing_above_them() -> None:
    offending = {
        path: sorted(name for name in names if _within(name, ABOVE_MODELS))
        for path, names in _imports_in("petals_core.models").items()
    }
    assert {path: names for path, names in offending.items() if names} == {}


@pytest.mark.parametrize("package", [p for p in BELOW_DISTRIBUTED if p != "petals_core"])
def test_nothing_below_the_distributed_models_imports_them(package: str) -> None:
    offending = {
        path: sorted(name for name in names if _within(name, ("petals_core.distributed",)))
        for path, names in _imports_in(package).items()
    }
    assert {path: names for path, names in offending.items() if names} == {}


@pytest.mark.parametrize("module", LOWER_LAYERS)
def test_importing_a_lower_layer_loads_no_distributed_model(module: str) -> None:
    assert _imported_after(module, DISTRIBUTED) == []


def test_nothing_imports_the_top_layer() -> None:
    """The endpoint and the monitor use the layers below them; nothing below uses them."""
    offending = {
        path: sorted(name for name in names if _within(name, TOP))
        for path, names in _imports_in("petals_core").items()
        if not any(path.startswith(package.replace(".", "/") + "/") for package in TOP)
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_demo_uses_no_test_helpers() -> None:
    """The demo is the package at work: what it shares with the tests (the swarm of processes)
    lives outside ``petals_core.testing``."""
    offending = {
        path: sorted(name for name in names if _within(name, ("petals_core.testing",)))
        for path, names in _imports_in("petals_core.demo").items()
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_the_endpoint_runs_without_the_server() -> None:
    assert _imported_after("petals_core.api", ("petals_core.server",)) == []


def test_the_client_loads_neither_the_server_nor_the_models() -> None:
    # The messages it shares with servers come from petals_core.protocol.
    watched = ("petals_core.server", "petals_core.models", "transformers", "triton")
    assert _imported_after("petals_core.client", watched) == []


def test_the_protocol_is_messages_only() -> None:
    # Message classes and transfers in parts over any send / receive: no event loop, no network,
    # neither side of the RPCs.
    watched = (
        "trio",
        "aioquic",
        "petals_core.transport",
        "petals_core.server",
        "petals_core.client",
        "petals_core.models",
        "transformers",
    )
    assert _imported_after("petals_core.protocol", watched) == []


def test_the_library_reads_no_private_module_state() -> None:
    """torch's hook tables and nn.Module's dicts are torch's own: what a block may compute with
    is decided from public information (module types, adapters added) by the block's owner."""
    private = re.compile(r"_global_forward|\._modules\b|\._parameters\b|_forward_(pre_)?hooks")
    package = PACKAGE
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


def test_only_the_quic_modules_reach_into_aioquic() -> None:
    """aioquic's private state is read and patched in ``transport._quic`` and ``_quic_path``
    alone (the contract ``tests/transport`` holds); everything else asks them."""
    private = re.compile(r"\b_?quic\._[a-z]")
    allowed = {"transport/_quic.py", "transport/_quic_path.py"}
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() not in allowed
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert found == []


#: A module longer than this does several jobs: split it by concern.
MAX_MODULE_LINES = 700


def test_no_module_does_several_jobs() -> None:
    lengths = {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES} == {}


@pytest.mark.parametrize("module", SANS_IO_MODULES)
def test_sans_io_modules_load_no_event_loop_and_no_network(module: str) -> None:
    assert _imported_after(module, LOOP_AND_NETWORK) == []


#: What routing reads of the DHT: the servers' announcements and the table of them.
ROUTING_READS_OF_THE_DHT = (
    "petals_core.dht",
    "petals_core.dht.PeerTableSnapshot",
    "petals_core.dht.ServerInfo",
    "petals_core.dht.ServerState",
)


def test_routing_imports_no_event_loop_no_network_and_neither_side() -> None:
    """Routing decides over announcements: no trio, no DHT node, no transport, and neither the
    client (whose sequence manager drives its planners) nor the server (whose block choice
    does)."""
    forbidden = (
        "trio",
        "petals_core.dht",
        "petals_core.transport",
        "petals_core.client",
        "petals_core.server",
    )
    offending = {
        path: sorted(
            name
            for name in names
            if _within(name, forbidden) and name not in ROUTING_READS_OF_THE_DHT
        )
        for path, names in _imports_in("petals_core.routing").items()
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_routing_loads_neither_the_client_nor_the_server() -> None:
    assert _imported_after("petals_core.routing", ROUTING_LOADS_NEITHER) == []


@pytest.mark.parametrize("module", SANS_IO)
def test_sans_io_modules_import_no_event_loop_and_no_clock(module: str) -> None:
    files = {path.relative_to(PACKAGE.parent).as_posix() for path in _module_files(module)}
    assert files
    package = ".".join(module.split(".")[:2])
    offending = {
        path: sorted(name for name in names if _within(name, IO))
        for path, names in _imports_in(package).items()
        if path in files
    }
    assert {path: names for path, names in offending.items() if names} == {}


def test_no_package_imports_another_packages_private_module() -> None:
    """``petals_core.a`` may use ``petals_core.b``'s public names, never a private module (or
    name) of it: what one package offers another is in its ``__init__``.  The root's private
    modules (``petals_core._groups`` and the like) are shared by every package below it."""
    packages = sorted(
        path.name for path in PACKAGE.iterdir() if path.joinpath("__init__.py").exists()
    )
    offending: dict[str, list[str]] = {}
    for package in packages:
        for path, names in _imports_in(f"petals_core.{package}").items():
            bad = sorted(
                name
                for name in names
                if (parts := name.split("."))[0] == "petals_core"
                and len(parts) > 2
                and parts[1] != package
                and any(part.startswith("_") and not part.startswith("__") for part in parts[2:])
            )
            if bad:
                offending[path] = bad
    assert offending == {}
