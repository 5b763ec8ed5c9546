"""The `bench` extra: mlx-lm, which the suite measures against, and matplotlib, which plots it.

Neither is a dependency of kvlayout. Each is imported only by the code that
needs it; `require` lets the suite refuse with one line before it measures
anything.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from kvlayout.errors import MissingExtra

INSTALL = "pip install -e '.[bench]' in the kvlayout checkout"  # kvlayout is not on a package index


def require(module: str, needed_by: str, package: str | None = None) -> None:
    """MissingExtra unless `module` imports; the message says `needed_by` needs `package` (default: module)."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{needed_by} needs {package or module}, which is not installed: {INSTALL}") from None


def mlx_lm(part: str) -> ModuleType:
    """`mlx_lm.<part>`, e.g. "generate" or "models.cache"."""
    return importlib.import_module(f"mlx_lm.{part}")


def mlx_lm_version() -> str:
    """mlx-lm's version, or "not installed" (the suite's heading names it either way)."""
    try:
        return importlib.import_module("mlx_lm").__version__
    except ImportError:
        return "not installed"
