"""Every hookspec is documented in its docstring and the README, and exercised by a test.

Modelled on datasette's test that fails when a plugin hook lacks docs or tests.
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

from kvlayout import hookspecs

ROOT = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve()


def hook_names(module: types.ModuleType) -> list[str]:
    return sorted(
        name for name, fn in inspect.getmembers(module, inspect.isfunction) if name.startswith("kvlayout_")
    )


def hook_gaps(module: types.ModuleType, readme: str, tests_text: str) -> list[str]:
    """One line per missing piece: docstring, README mention, test that names the hook."""
    gaps = []
    for name in hook_names(module):
        doc = inspect.getdoc(getattr(module, name)) or ""
        if len(doc.split()) < 5:
            gaps.append(f"{name}: no docstring")
        if name not in readme:
            gaps.append(f"{name}: not documented in README.md")
        if name not in tests_text:
            gaps.append(f"{name}: no test exercises it")
    return gaps


def other_tests_text() -> str:
    files = sorted(p for p in (ROOT / "tests").rglob("*.py") if p.resolve() != THIS_FILE)
    return "\n".join(p.read_text() for p in files)


def test_every_hookspec_has_a_docstring_a_readme_entry_and_a_test():
    names = hook_names(hookspecs)
    assert {"kvlayout_builders", "kvlayout_choose_cells", "kvlayout_step_placed"} <= set(names)
    for name in names:  # each is a real pluggy hookspec
        assert hasattr(getattr(hookspecs, name), "kvlayout_spec"), name
    assert hook_gaps(hookspecs, (ROOT / "README.md").read_text(), other_tests_text()) == []


def test_the_check_catches_a_hook_missing_each_piece():
    fake = types.ModuleType("fake_hookspecs")

    def kvlayout_documented():
        """Called when something happens; returns nothing at all."""

    def kvlayout_bare():
        pass

    fake.kvlayout_documented, fake.kvlayout_bare = kvlayout_documented, kvlayout_bare
    readme = "kvlayout_documented does things"
    tests_text = "def test_it(): kvlayout_documented()"
    assert hook_gaps(fake, readme, tests_text) == [
        "kvlayout_bare: no docstring",
        "kvlayout_bare: not documented in README.md",
        "kvlayout_bare: no test exercises it",
    ]
