"""The package's folders are its layers, and no layer imports one above it.

From the top: the public API (the package's names, the callbacks, the
TensorBoard plugin, the cluster launcher and connection), the adapter
(`strategy`, `scope_watch`), the engine (`engine/`, with the cluster's
fault handling, input and evaluation that run inside it), the updates (`updates/`), the
store (`store/`), and the foundations (`devices`, `_tf_internal`). A module
may import its own layer and those below, and no module imports itself
again through others (A imports B, and B, or a module B imports, imports
A): such a circle is cut by moving what both need where it belongs. Imports
inside functions count, since they run; imports made only for type
checking (`if TYPE_CHECKING:`) are left out: they run nowhere.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tf_diffmap"

# Highest first. A module's layer is that of the longest prefix naming it.
LAYERS = {
    "public": [
        "tf_diffmap",
        "tf_diffmap.callbacks",
        "tf_diffmap.testing",
        "tf_diffmap.tensorboard_plugin",
        "tf_diffmap.cluster",
    ],
    "adapter": ["tf_diffmap.strategy", "tf_diffmap.extended", "tf_diffmap.scope_watch"],
    "engine": [
        "tf_diffmap.engine",
        "tf_diffmap.cluster.faults",
        "tf_diffmap.cluster.inputs",
        "tf_diffmap.cluster.inference",
        "tf_diffmap.cluster.shard_run",
    ],
    "updates": ["tf_diffmap.updates"],
    "store": ["tf_diffmap.store"],
    "foundations": ["tf_diffmap.devices", "tf_diffmap._tf_internal"],
}
RANK = {layer: rank for rank, layer in enumerate(LAYERS)}


def layer_of(module: str) -> str:
    best, found = -1, None
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), layer
    assert found, f"{module} is in no layer: add it to LAYERS"
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def imports_of(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every tf_diffmap import that runs in `path` (or in
    `source`, read as if it were `path`)."""
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    skipped = type_checking_nodes(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("tf_diffmap")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tf_diffmap"):
            for alias in node.names:
                # `from tf_diffmap.x import y`: y may be a module or a name in x.
                candidate = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(
                    ".py"
                ).exists() or (PACKAGE.parent / Path(*candidate.split("."))).is_dir()
                found.append((node.lineno, candidate if is_module else node.module))
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_is_in_a_layer_and_the_tree_is_folders_of_layers():
    for path in MODULES:
        layer_of(module_name(path))
    top_level = sorted(p.stem for p in PACKAGE.glob("*.py"))
    # The top of the package holds the public API, the adapter and the
    # foundations' one module; the rest is in folders named for their layer.
    assert top_level == [
        "__init__",
        "callbacks",
        "devices",
        "extended",
        "scope_watch",
        "strategy",
        "testing",
    ]
    for folder in ("engine", "updates", "store"):
        assert (PACKAGE / folder / "__init__.py").read_text().strip(), folder


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_no_module_imports_a_layer_above_its_own(path):
    module = module_name(path)
    own = RANK[layer_of(module)]
    upward = [
        f"line {line}: {imported} ({layer_of(imported)})"
        for line, imported in imports_of(path)
        if RANK[layer_of(imported)] < own
    ]
    assert not upward, f"{module} ({layer_of(module)}) imports a higher layer: {upward}"


def test_the_check_sees_an_upward_import():
    """The check itself: the store's module with an import of the engine
    added is caught, and one under `if TYPE_CHECKING:` is not."""
    path = PACKAGE / "store" / "parameter_store.py"
    source = path.read_text(encoding="utf-8")
    added = source + "\nfrom tf_diffmap.engine import runtime\n"
    assert "tf_diffmap.engine.runtime" in [m for _, m in imports_of(path, added)]
    assert RANK[layer_of("tf_diffmap.engine.runtime")] < RANK[layer_of("tf_diffmap.store")]
    typing_only = source + "\nif TYPE_CHECKING:\n    from tf_diffmap.engine import runtime\n"
    assert "tf_diffmap.engine.runtime" not in [m for _, m in imports_of(path, typing_only)]


def import_graph(sources: dict[Path, str] | None = None) -> dict[str, dict[str, int]]:
    """Per module, each tf_diffmap module it imports and the line of the first
    such import; `sources` replaces the text of some modules."""
    sources = sources or {}
    graph: dict[str, dict[str, int]] = {}
    for path in MODULES:
        edges = graph.setdefault(module_name(path), {})
        for line, imported in imports_of(path, sources.get(path)):
            edges.setdefault(imported, line)
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The circles of `graph`, one per set of modules, each as the path
    `[a, b, ..., a]` that closes it."""
    circles: dict[frozenset[str], list[str]] = {}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph.get(module, {})):
            if imported in path:
                circle = path[path.index(imported) :] + [imported]
                circles.setdefault(frozenset(circle), circle)
            elif imported not in done:
                visit(imported, path + [imported])
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    return list(circles.values())


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    described = [
        " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:], strict=False))
        + f" -> {circle[-1]}"
        for circle in import_circles(graph)
    ]
    assert not described, (
        "Import circles (move what the modules share to where it belongs, or to a module "
        "of its own that both import):\n" + "\n".join(described)
    )


def test_the_check_sees_an_import_circle():
    """The check itself: a circle of two modules, one of three, and one made
    by an import inside a function are caught; a chain and an import under
    `if TYPE_CHECKING:` are not."""
    assert import_circles({"a": {"b": 1}, "b": {"a": 1}}) == [["a", "b", "a"]]
    assert import_circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c", "a"]
    ]
    assert import_circles({"a": {"b": 1, "c": 1}, "b": {"c": 1}, "c": {}}) == []

    path = PACKAGE / "store" / "staleness.py"
    source = path.read_text(encoding="utf-8")
    # parameter_store imports staleness; staleness importing it back, even
    # late, closes a circle.
    assert "tf_diffmap.store.staleness" in import_graph()["tf_diffmap.store.parameter_store"]
    pair = ["tf_diffmap.store.parameter_store", "tf_diffmap.store.staleness"]
    assert pair not in [sorted(set(c)) for c in import_circles(import_graph())]
    late = source + "\n\ndef _late():\n    from tf_diffmap.store import parameter_store\n"
    assert pair in [sorted(set(c)) for c in import_circles(import_graph({path: late}))]
    typing_only = source + "\nif TYPE_CHECKING:\n    from tf_diffmap.store import parameter_store\n"
    assert pair not in [sorted(set(c)) for c in import_circles(import_graph({path: typing_only}))]
