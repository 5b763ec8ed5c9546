"""The tree's architecture, checked: who may import whom (docs/design.md, "Parts").

Every module of the three distributions is parsed (not imported) and its
imports, top-level or inside functions, are checked against the layering:
the neutral core and the layouts' bookkeeping never import MLX; engines
never import the runner, the bench or a layout package; nothing but the
bench imports a layout package by name (layouts are reached through the
registry); no module imports another's underscored name; and no modules
import each other in a circle, however deep, so an import moved inside a
function (where it runs late enough not to fail) cannot hide one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {
    "kvlayout": ROOT / "core" / "kvlayout",
    "kvlayout_seq": ROOT / "plugins" / "seq_layout" / "kvlayout_seq",
    "kvlayout_cell": ROOT / "plugins" / "cell_layout" / "kvlayout_cell",
}

# Modules that must not import MLX: the contracts and the integer/numpy bookkeeping.
NEUTRAL = [
    "kvlayout.builder", "kvlayout.checks", "kvlayout.config", "kvlayout.errors", "kvlayout.faces",
    "kvlayout.hookspecs", "kvlayout.persist", "kvlayout.pool", "kvlayout.registry", "kvlayout.spec",
    "kvlayout_seq.bookkeeping", "kvlayout_cell.table", "kvlayout_cell.stepper", "kvlayout_cell.groups",
    "kvlayout_cell.window", "kvlayout_cell.layer_groups",
]
LAYOUTS = ("kvlayout_seq", "kvlayout_cell")
# (importer prefix, forbidden prefixes): each part imports downward only.
FORBIDDEN = [
    ("kvlayout.mlx", ("kvlayout.runner", "kvlayout.server", "kvlayout.engines", "kvlayout.bench", "kvlayout.cli",
                      *LAYOUTS)),
    ("kvlayout.models", ("kvlayout.runner", "kvlayout.server", "kvlayout.engines", "kvlayout.bench", "kvlayout.cli",
                         *LAYOUTS)),
    ("kvlayout.engines", ("kvlayout.runner", "kvlayout.server", "kvlayout.models", "kvlayout.bench", "kvlayout.cli",
                          *LAYOUTS)),
    ("kvlayout.distributed", ("kvlayout.runner", "kvlayout.server", "kvlayout.models", "kvlayout.engines",
                              "kvlayout.bench", "kvlayout.cli", *LAYOUTS)),
    ("kvlayout.runner", ("kvlayout.server", "kvlayout.bench", "kvlayout.cli", *LAYOUTS)),
    ("kvlayout.server", ("kvlayout.bench", "kvlayout.cli", *LAYOUTS)),
    ("kvlayout_seq", ("kvlayout.runner", "kvlayout.server", "kvlayout.engines", "kvlayout.bench", "kvlayout.cli",
                      "kvlayout_cell")),
    ("kvlayout_cell", ("kvlayout.runner", "kvlayout.server", "kvlayout.engines", "kvlayout.bench", "kvlayout.cli",
                       "kvlayout_seq")),
]
for core in ("builder", "checks", "config", "errors", "faces", "hookspecs", "persist", "pool", "registry", "spec"):
    FORBIDDEN.append((f"kvlayout.{core}", ("kvlayout.runner", "kvlayout.server", "kvlayout.engines", "kvlayout.bench",
                                           "kvlayout.cli", "kvlayout.mlx", *LAYOUTS)))


def modules() -> dict[str, Path]:
    found = {}
    for package, root in SOURCES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import statement, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, [alias.name for alias in node.names]))
    return out


MODULES = modules()


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(name: str, path: Path) -> list[str]:
    """Every import of module `name` (at `path`) that breaks a rule above, as "rule: module"."""
    found = imports(name, path)
    out = []
    if name in NEUTRAL:
        out += [f"mlx in neutral code: {m}" for m, _ in found if within(m, "mlx") or within(m, "kvlayout.mlx")]
    for prefix, forbidden in FORBIDDEN:
        if within(name, prefix):
            out += [f"upward: {m}" for m, _ in found if any(within(m, f) for f in forbidden)]
    out += [
        f"underscored: {m}.{n}"
        for m, names in found
        for n in names
        if n.startswith("_") and not n.startswith("__") and m != name
    ]
    out += [f"underscored attribute: {a}" for a in private_reaches(path)]
    return out


# Underscored by their library's convention, public and documented all the same.
DOCUMENTED = {"os._exit"}  # the exit that does not wait for a thread stuck in a collective


def private_reaches(path: Path) -> list[str]:
    """`x._name` where x is not `self` or `cls`: reading what another object keeps to itself."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        and ast.unparse(node) not in DOCUMENTED
    ]


def test_the_layering_covers_the_tree():
    assert {"kvlayout.faces", "kvlayout.spec", "kvlayout_cell.stepper", "kvlayout.runner"} <= set(MODULES)
    assert all(name in MODULES for name in NEUTRAL)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_each_module_keeps_the_layering(name):
    assert violations(name, MODULES[name]) == []


def test_a_module_breaking_each_rule_is_caught(tmp_path):
    path = tmp_path / "stepper.py"
    path.write_text(
        "import mlx.core as mx\n"
        "def late():\n    from kvlayout.runner import job\n"
        "from .table import _owns\n"
        "def peek(table):\n    return table._pos, self._mine\n"
    )
    assert violations("kvlayout_cell.stepper", path) == [
        "mlx in neutral code: mlx.core",
        "upward: kvlayout.runner",
        "underscored: kvlayout_cell.table._owns",
        "underscored attribute: table._pos",
    ]


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `found` it imports, top-level or inside functions: `from a import b`
    is an import of module a.b when that is a module, else of a."""
    graph = {}
    for name, path in found.items():
        targets = set()
        for module, names in imports(name, path):
            submodules = {f"{module}.{n}" for n in names} & found.keys()
            targets |= submodules
            if module in found and (not names or len(submodules) < len(names)):
                targets.add(module)
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a circle (strongly connected, more than one), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph(MODULES)) == []


def test_a_circle_hidden_by_an_import_inside_a_function_is_caught(tmp_path):
    (tmp_path / "cache.py").write_text("from kvlayout_cell import persist\n")
    (tmp_path / "persist.py").write_text("def load_cache(f):\n    from kvlayout_cell.cache import CellCache\n")
    (tmp_path / "plugin.py").write_text("def _build(config):\n    from kvlayout_cell.cache import CellCache\n")
    found = {f"kvlayout_cell.{p.stem}": p for p in tmp_path.iterdir()}
    assert circles(import_graph(found)) == [["kvlayout_cell.cache", "kvlayout_cell.persist"]]
