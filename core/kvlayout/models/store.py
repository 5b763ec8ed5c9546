"""Where fetched and converted models live, and how a directory appears there whole.

The root is `$KVLAYOUT_CACHE`, else `$XDG_CACHE_HOME/kvlayout`, else
`~/.cache/kvlayout`. A directory is built under a temporary name beside its
final one and renamed into place, so an interrupted build never leaves a
directory that looks done.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """kvlayout's cache directory (not created)."""
    if os.environ.get("KVLAYOUT_CACHE"):
        return Path(os.environ["KVLAYOUT_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvlayout"


def publish_dir(final: Path, build: Callable[[Path], object]) -> Path:
    """Run `build(tmp)` on an empty directory beside `final`, then move it to `final`.

    An existing `final` is replaced. If `build` raises, `final` is as it was and
    the temporary directory is gone.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        build(tmp)
        if final.exists():
            # rename() cannot replace a non-empty directory: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            final.rename(old / final.name)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
