"""The package's layout, checked from its source with `ast`: layers import downward only, no
import cycle (imports inside functions count), no module uses another module's private
names except the one documented restore door, and every module says what it does.

The layers are those of the Layout section of docs/internals.md; a new module goes into both.
Modules are named by their dotted path inside the package (`engine.requests`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from rollout_store.engine.encoding import ECHO_PACKED

PACKAGE = Path(__file__).resolve().parents[2] / "rollout_store"

#: Bottom to top; a module may import modules of its own layer or of the layers below. A
#: wing (a subpackage) is one layer or several consecutive ones; its `__init__` sits in its
#: first.
LAYERS: list[tuple[str, set[str]]] = [
    ("errors and folders", {"errors", "folders"}),
    ("model", {"model.nodes", "model.raw", "model.training", "model.timeline", "model.drift"}),
    ("stores", {"stores.content", "stores.local", "stores.redis_store", "stores.s3_store"}),
    (
        "engine: foundations",
        {"engine.encoding", "engine.index", "engine.tokens", "engine.messages"},
    ),
    ("engine: values and blobs", {"engine.blobs", "engine.shared_blobs", "engine.values"}),
    ("engine: intake", {"engine.intake"}),
    (
        "engine: stored turns and indexes",
        {
            "engine.stored",
            "engine.turn_records",
            "engine.confirm",
            "engine.keys",
            "engine.materialize",
        },
    ),
    ("engine: request storage and linking", {"engine.requests", "engine.linking"}),
    ("graph", {"metadata", "views", "graph"}),
    (
        "files",
        {"files.atomic", "files.packed", "files.frames", "files.framing", "files.key_check"}
        | {"files.storage"},
    ),
    (
        "export",
        {"export.checks", "export.jsonstream", "export.document", "export.figures"}
        | {"export.rows", "export.row_files"},
    ),
    ("viewer", {"viewer.hosts", "viewer.app"}),
    (
        "serve",
        {"serve.loopback", "serve.replicas", "serve.sse", "serve.ack_ledger", "serve.sessions"}
        | {
            "serve.server",
            "serve.stub_engine",
            "serve.idle_trim",
            "serve.capture",
            "serve.assemble",
        },
    ),
    ("command line and package", {"cli", "__main__", "__init__"}),
]
WINGS = ("model", "stores", "engine", "files", "export", "viewer", "serve")
for _wing in WINGS:
    next(names for _, names in LAYERS if any(n.startswith(f"{_wing}.") for n in names)).add(
        f"{_wing}.__init__"
    )

#: The one private name a module may use from another: storage rebuilds a graph through it.
RESTORE_DOOR = ("files.storage", "_restorer")


def dotted(path: Path) -> str:
    """`engine/requests.py` -> `engine.requests`; the package's own `__init__` stays `__init__`."""
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


@functools.cache
def modules() -> dict[str, ast.Module]:
    """Each module's syntax tree, parsed once for all the tests here (none changes one)."""
    return {dotted(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of() -> dict[str, int]:
    return {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def _known(parts: list[str], known: set[str]) -> str | None:
    """The module a dotted target names: itself, its package's `__init__`, or its parent
    (an attribute of a module)."""
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in known:
            return name
        if f"{name}.__init__" in known:
            return f"{name}.__init__"
    return "__init__" if not parts else None


def imported(tree: ast.Module, known: set[str], here: str = "__init__") -> set[str]:
    """Package modules `tree` (the module `here`) imports anywhere: module level, in
    functions, under TYPE_CHECKING, relative or absolute."""
    here_pkg = here.split(".")[:-1]
    targets: list[list[str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here_pkg[: len(here_pkg) - (node.level - 1)]
            elif node.module == "rollout_store" or (node.module or "").startswith("rollout_store."):
                base = []
            else:
                continue
            module = (node.module or "").split(".") if node.module else []
            if not node.level:
                module = module[1:]
            targets.append(base + module)
            targets += [base + module + [alias.name] for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "rollout_store":
                    targets.append(parts[1:])
    found = {_known(t, known) for t in targets}
    return {name for name in found if name is not None}


def import_graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: imported(tree, known, name) - {name} for name, tree in trees.items()}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_definitions(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, assigned names and attributes,
    and slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            for item in ast.walk(node.value):
                if isinstance(item, ast.Constant) and isinstance(item.value, str):
                    names.add(item.value)
    return {n for n in names if is_private(n)}


def test_every_module_has_a_layer() -> None:
    placed = layer_of()
    missing = sorted(set(modules()) - set(placed))
    assert not missing, (
        f"put {missing} in a layer: LAYERS here and the Layout section of docs/internals.md"
    )
    gone = sorted(set(placed) - set(modules()))
    assert not gone, f"{gone} are in LAYERS but not in the package"


def test_layers_import_downward_only() -> None:
    placed = layer_of()
    upward = [
        f"{name} ({LAYERS[placed[name]][0]}) imports {dep} ({LAYERS[placed[dep]][0]})"
        for name, deps in import_graph().items()
        for dep in sorted(deps)
        if name in placed and dep in placed and placed[dep] > placed[name]
    ]
    assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                cycle = visit(dep)
                if cycle:
                    return cycle
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_uses_another_modules_private_names() -> None:
    trees = modules()
    defined = {name: private_definitions(tree) for name, tree in trees.items()}
    uses = []
    for name, tree in trees.items():
        others = set().union(*(d for other, d in defined.items() if other != name))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                uses += [(name, a.name, node.lineno) for a in node.names if is_private(a.name)]
            elif (
                isinstance(node, ast.Attribute)
                and is_private(node.attr)
                and node.attr not in defined[name]
                and node.attr in others
            ):
                uses.append((name, node.attr, node.lineno))
    bad = [f"{m}:{line} uses {attr}" for m, attr, line in uses if (m, attr) != RESTORE_DOOR]
    assert not bad, "\n".join(bad)


def test_the_restore_door_is_used_and_documented_where_it_is_defined() -> None:
    graph = (PACKAGE / "graph.py").read_text()
    assert "def _restorer(" in graph and "RESTORE DOOR" in graph
    assert "._restorer()" in (PACKAGE / "files" / "storage.py").read_text()


def test_every_module_says_what_it_does_and_asserts_nothing_at_import() -> None:
    for name, tree in modules().items():
        docstring = ast.get_docstring(tree)
        assert docstring and len(docstring) > 20, f"{name}.py needs a docstring saying its job"
        asserts = [node.lineno for node in tree.body if isinstance(node, ast.Assert)]
        assert not asserts, f"{name}.py asserts at import (lines {asserts}): check it in a test"


def test_the_echo_placeholder_is_three_bytes() -> None:
    # the inline comparison of a stored tail (RequestStore.matches) counts on it
    assert len(ECHO_PACKED) == 3
