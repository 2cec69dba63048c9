"""The module graph: no import cycle among hloserve's modules, even for types or inside a
function, the worker (the composition root) imported by nobody but the entry points, the
package root (whose lazy `serve` imports the worker) by no module inside it, and every import
going down the layers (docs/development.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import hloserve
import hloserve.actors

SOURCES = {
    "hloserve": Path(hloserve.__file__).parent,
    "hloserve.actors": Path(hloserve.actors.__file__).parent,
}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[0] == "_proto":
                continue  # generated code
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    return modules


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The hloserve modules `module` imports anywhere: at its top level, under `if TYPE_CHECKING:`
    and inside functions (a lazy import still closes a circle)."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base])
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            found.update(submodules or {base.rstrip(".")})  # `from package import module`: the module
    return {name for name in found if name in known and name != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_the_graph_is_read() -> None:
    """What the other tests rely on: `from package import module`, `import module`, imports for
    types only (service's, under `if TYPE_CHECKING:`) and inside functions (cli's) are all edges."""
    graph = _graph()
    assert "hloserve.worker" in graph["hloserve.cli"]  # inside `_serve_until_signalled`
    assert {"hloserve.engine.model_table", "hloserve.actors.dispatcher", "hloserve.models._xla"} <= graph[
        "hloserve.worker"
    ]
    assert {"hloserve.types", "hloserve.actors.messages"} <= graph["hloserve.engine.model_table"]
    assert "hloserve.engine.model_table" in graph["hloserve.api.data_plane"]  # under TYPE_CHECKING


def test_only_the_entry_points_import_the_worker() -> None:
    importers = sorted(name for name, imports in _graph().items() if "hloserve.worker" in imports)
    assert importers == ["hloserve", "hloserve.cli"]  # lazily, inside the function that serves


def test_no_inner_module_imports_the_package_root() -> None:
    importers = sorted(name for name, imports in _graph().items() if "hloserve" in imports)
    assert importers == []  # the version is `hloserve._version`'s


def test_types_is_a_leaf() -> None:
    assert _graph()["hloserve.types"] == set()


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        path.append(node)
        for successor in sorted(graph[node]):
            if state.get(successor) == 1:
                cycles.append([*path[path.index(successor) :], successor])
            elif successor not in state:
                walk(successor)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert cycles == []


_LEAVES = ("_process", "_version", "extras", "memory_probe")
LAYERS = (
    (
        "leaves",
        (
            "config",
            "types",
            "errors",
            "dtypes",
            "restricted",
            "tls",
            "logs",
            "allocator",
            "kernels",
            *_LEAVES,
        ),
    ),
    ("transport", ("_transport",)),
    ("models", ("models",)),
    ("engine", ("engine", "actors")),
    ("protocols", ("api",)),
    ("processes", ("frontends",)),
    ("fleet", ("fleet",)),
    ("tools", ("export", "importers", "export_torch", "verification")),  # the last two: old paths
    ("face", ("worker", "cli", "client", "buffer_pool")),  # buffer_pool: the pool's old path
)
"""hloserve's layers, lowest first (docs/development.md draws them); the package root is the face."""


def _layer(module: str) -> int:
    """The rank of `module`'s layer (the package root: the face's)."""
    parts = module.split(".")
    if len(parts) == 1:
        return len(LAYERS) - 1
    ranks = [rank for rank, (_, names) in enumerate(LAYERS) if parts[1] in names]
    assert len(ranks) == 1, f"{module} is in no layer (or several): add it to LAYERS"
    return ranks[0]


def test_imports_go_down_the_layers() -> None:
    """A module imports from its own layer and those below it, never from one above."""
    graph = _graph()
    upward = sorted(
        f"{module} ({LAYERS[_layer(module)][0]}) imports {imported} ({LAYERS[_layer(imported)][0]})"
        for module, imports in graph.items()
        for imported in imports
        if _layer(imported) > _layer(module)
    )
    assert upward == []


ADAPTERS = ("hloserve.api.grpc_service", "hloserve.api.health", "hloserve.api.rest", "hloserve.api.control")
"""The protocol adapters: they translate the protocol and serve through the planes alone."""

PLANES = (
    "hloserve.api.data_plane",
    "hloserve.api.model_plane",
    "hloserve.api.repository_plane",
    "hloserve.api.control_plane",
)

ADAPTERS_MAY_IMPORT = (
    *PLANES,
    "hloserve.api.tensor_codec",
    "hloserve.api.viewed_request",
    "hloserve.api.wire_codec",
    "hloserve.api.status",
)
"""Of the layers below and beside them, what an adapter may import besides the leaves and the
transport: the planes and what their messages and errors are made of (never the model table,
the engine or the models, which the planes stand in front of)."""


def _is(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_adapters_reach_no_further_than_the_planes() -> None:
    """An adapter (gRPC, REST, health, control) imports the planes and the protocol's codecs and statuses,
    never the model table, the engine, the actors or the models behind the planes."""
    graph = _graph()
    leaves = tuple(f"hloserve.{name}" for name in LAYERS[0][1])
    allowed = (*ADAPTERS, *ADAPTERS_MAY_IMPORT, *leaves, "hloserve._transport", "hloserve._proto")
    reaching = sorted(
        f"{module} imports {imported}"
        for module, imports in graph.items()
        if _is(module, ADAPTERS)
        for imported in imports
        if not _is(imported, allowed)
    )
    assert reaching == []


def test_the_adapters_rule_sees_an_adapter_reach_past_the_planes() -> None:
    """The rule above can fail: the planes themselves import the model table, which an adapter
    may not (so an adapter's import of a plane's module is a short walk from the table)."""
    graph = _graph()
    assert any(_is(i, ("hloserve.engine",)) for p in PLANES for i in graph[p])
    assert all(_is(a, ADAPTERS) for a in graph if a.startswith("hloserve.api.rest."))
