"""`kvlayout run --trace FILE.html`: the cell map of a run, step by step, as one static page.

Between steps (the runner's `stop` question, asked before every step) a
`Recorder` takes a frame of the table through the CellView face, the same
frame `kvlayout serve` streams (`cellmap.frame`: at most 4096 one-byte
buckets, 5.4 KB of base64, whatever the capacity); `write` puts them into
the package's trace template, which replays them with a scrubber. No server
is needed to look at it.
"""

from __future__ import annotations

import json
import os
from html import escape
import tempfile
from pathlib import Path

from kvlayout.errors import ConfigError
from kvlayout.server import cellmap
from kvlayout.server.monitor import page

PLACEHOLDER = "/*KVLAYOUT_FRAMES*/null"


def check_target(path: str) -> Path:
    """The trace's path, checked before the run (a run must not be lost to a bad path)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--trace {path}: is a directory; expected a file to write, e.g. trace.html")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"--trace {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--trace {path}: the directory {parent} is not writable")
    return target


class Recorder:
    """Frames of the table, one per step, taken through `view` (a CellView face)."""

    def __init__(self, view):
        self.view = view
        self.frames: list[dict] = []

    def record(self) -> None:
        self.frames.append(cellmap.frame(cellmap.take(self.view, ()), len(self.frames)))


def write(target: Path, frames: list[dict], title: str) -> None:
    """The trace page with `frames` in it (and `title` as its title), written whole or not at all."""
    template = page("trace.html")
    if PLACEHOLDER not in template:
        raise RuntimeError("the packaged trace.html lacks its frames placeholder")
    data = json.dumps(frames, separators=(",", ":")).replace("</", "<\\/")  # no "</script>" inside the script
    html = template.replace(PLACEHOLDER, data, 1)
    html = html.replace("<title>", f"<title>{escape(title)} · ", 1)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".html", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary new file would be, not mkstemp's 0600
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
