"""The package's layout, checked from its source with `ast`: layers import downward only, no
import cycle (imports inside functions count), no module uses another module's private
names except the one documented restore door, and every module says what it does.

The layers are those of the Layout section of docs/internals.md; a new module goes into both.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from rollout_store.encoding import ECHO_PACKED

PACKAGE = Path(__file__).resolve().parents[2] / "rollout_store"

#: Bottom to top; a module may import modules of its own layer or of the layers below.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundations",
        {
            "errors",
            "encoding",
            "index",
            "tokens",
            "messages",
            "raw",
            "nodes",
            "training",
            "loopback",
            "hosts",
            "drift",
            "timeline",
            "replicas",
        },
    ),
    ("values and blobs", {"content", "blobs", "shared_blobs", "values"}),
    ("intake", {"intake", "metadata"}),
    (
        "stored turns and indexes",
        {"stored", "turn_records", "confirm", "keys", "materialize", "views"},
    ),
    ("request storage and linking", {"requests", "linking"}),
    ("graph", {"graph"}),
    ("export", {"checks", "jsonstream", "export", "figures", "rows"}),
    ("files", {"atomic", "packed", "frames", "framing", "key_check", "storage", "row_files"}),
    ("stores", {"stores", "redis_store", "s3_store"}),
    ("viewer", {"viewer"}),
    ("server", {"sse", "sessions", "server", "stub_engine", "idle_trim", "capture"}),
    ("command line and package", {"cli", "__main__", "__init__"}),
]

#: The one private name a module may use from another: storage rebuilds a graph through it.
RESTORE_DOOR = ("storage", "_restorer")


@functools.cache
def modules() -> dict[str, ast.Module]:
    """Each module's syntax tree, parsed once for all the tests here (none changes one)."""
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def layer_of() -> dict[str, int]:
    return {name: i for i, (_, names) in enumerate(LAYERS) for name in names}


def imported(tree: ast.Module, known: set[str]) -> set[str]:
    """Package modules `tree` imports anywhere: module level, in functions, under
    TYPE_CHECKING, relative or absolute."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x
                found.update(alias.name for alias in node.names)
            elif node.module == "rollout_store":
                found.update(alias.name for alias in node.names)
                found.add("__init__")
            elif node.module and node.module.startswith("rollout_store."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "rollout_store":
                    found.add("__init__")
                elif alias.name.startswith("rollout_store."):
                    found.add(alias.name.split(".")[1])
    return found & known


def import_graph() -> dict[str, set[str]]:
    trees = modules()
    known = set(trees)
    return {name: imported(tree, known) - {name} for name, tree in trees.items()}


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
    assert "._restorer()" in (PACKAGE / "storage.py").read_text()


def test_every_module_says_what_it_does_and_asserts_nothing_at_import() -> None:
    for name, tree in modules().items():
        docstring = ast.get_docstring(tree)
        assert docstring and len(docstring) > 20, f"{name}.py needs a docstring saying its job"
        asserts = [node.lineno for node in tree.body if isinstance(node, ast.Assert)]
        assert not asserts, f"{name}.py asserts at import (lines {asserts}): check it in a test"


def test_the_echo_placeholder_is_three_bytes() -> None:
    # the inline comparison of a stored tail (RequestStore.matches) counts on it
    assert len(ECHO_PACKED) == 3
