"""One job per part, kept: no function under core/ or plugins/ over 60 lines, no engine class over
20 methods. A part that grows past these has taken a second job; split it rather than raise the
numbers."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "core" / "kvlayout", ROOT / "plugins" / "seq_layout" / "kvlayout_seq",
           ROOT / "plugins" / "cell_layout" / "kvlayout_cell"]
ENGINES = ROOT / "core" / "kvlayout" / "engines"
MAX_FUNCTION_LINES = 60
MAX_ENGINE_METHODS = 20

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def too_long(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, lines) of each function (a nested one too, on its own) longer than the limit."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, FUNCTIONS) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def too_many_methods(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, methods) of each class with more methods than the limit."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ClassDef):
            methods = sum(isinstance(b, FUNCTIONS) for b in n.body)
            if methods > MAX_ENGINE_METHODS:
                found.append((n.name, methods))
    return found


def modules(*roots: Path):
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def test_no_function_is_over_sixty_lines():
    found = [f"{path.relative_to(ROOT)}: {name} ({n} lines)" for path, tree in modules(*SOURCES)
             for name, n in too_long(tree)]
    assert not found, "split these into parts with one job each:\n" + "\n".join(found)


def test_no_engine_class_has_over_twenty_methods():
    found = [f"{path.relative_to(ROOT)}: {name} ({n} methods)" for path, tree in modules(ENGINES)
             for name, n in too_many_methods(tree)]
    assert not found, "an engine class doing more than one job:\n" + "\n".join(found)


def test_the_measures_catch_what_they_look_for():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # 60 lines of body: 61 in all
    assert too_long(ast.parse(f"def long():\n{body}\n")) == [("long", MAX_FUNCTION_LINES + 1)]
    assert too_long(ast.parse("def short():\n    return 1\n")) == []
    methods = "\n".join(f"    def m{i}(self):\n        pass" for i in range(MAX_ENGINE_METHODS + 1))
    assert too_many_methods(ast.parse(f"class Big:\n{methods}\n")) == [("Big", MAX_ENGINE_METHODS + 1)]
    nested = textwrap.dedent("""
        def outer():
            def inner():
                pass
        """)
    assert too_long(ast.parse(nested)) == []
