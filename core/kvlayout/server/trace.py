"""`kvlayout run --trace FILE.html`: the cell map of a run, step by step, as one static page.

Between steps (the runner's `stop` question, asked before every step) a
`Recorder` takes a frame of the table through the CellView face, the same
frame `kvlayout serve` streams (`cellmap.frame`: at most 4096 one-byte
buckets, 5.4 KB of base64, whatever the capacity); `write` puts them into
the package's trace template, which replays them with a scrubber. No server
is needed to look at it. At most MAX_FRAMES frames are kept (evenly spaced
over a longer run). Taking a frame happens between steps, so it adds to the
run's wall time (~0.2 ms for 2k cells, ~5 ms for 16k on a 2-core CPU).
"""

from __future__ import annotations

import json
import os
import tempfile
from html import escape
from pathlib import Path

from kvlayout.errors import ConfigError, InstallError
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


MAX_FRAMES = 2048  # ~11 MB of page at most; a longer run is kept every 2nd, 4th, ... step


class Recorder:
    """Frames of the table, one per step, taken through `view` (a CellView face); past
    MAX_FRAMES every other frame is dropped and the stride doubles, so a long run keeps an
    evenly spaced MAX_FRAMES at most (each frame names its step)."""

    def __init__(self, view):
        self.view = view
        self.frames: list[dict] = []
        self.step = 0  # steps seen (the frame before step k is taken at k)
        self.stride = 1

    def record(self) -> None:
        if self.step % self.stride == 0:
            self.frames.append(cellmap.frame(cellmap.take(self.view, ()), self.step))
            if len(self.frames) > MAX_FRAMES:
                self.frames = self.frames[::2]
                self.stride *= 2
        self.step += 1

    def record_last(self) -> None:
        """The table after the last step, whatever the stride."""
        if not self.frames or self.frames[-1]["step"] != self.step:
            self.frames.append(cellmap.frame(cellmap.take(self.view, ()), self.step))


def write(target: Path, frames: list[dict], title: str) -> None:
    """The trace page with `frames` in it (and `title` as its title), written whole or not at all."""
    template = page("trace.html")
    if PLACEHOLDER not in template:
        raise InstallError(
            f"kvlayout's server/static/trace.html lacks its frames placeholder {PLACEHOLDER}; reinstall kvlayout"
        )
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


class Tracing:
    """`kvlayout run --trace FILE.html`: a frame before every step, and after the last, written at the end."""

    def __init__(self, target: Path, view):
        self.target, self.recorder = target, Recorder(view)

    @classmethod
    def start(cls, path: str, cache, layout_key: str) -> Tracing:
        """A trace of `cache` into `path`; ConfigError (before the run) when the layout has no cells
        to draw or the file cannot be written there."""
        target = check_target(path)
        view = cellmap.cell_view(cache)
        if view is None:
            raise ConfigError(
                f"--trace draws the cells of a cell layout; {layout_key} has none (try --layout mlx:cell)"
            )
        return cls(target, view)

    def stop_after(self, stop):
        """A `stop` for Job.generate: asks `stop` (if any), and records a frame before each step that follows."""
        def ask_then_record() -> bool:
            if stop is not None and stop():
                return True  # no step follows: the last frame is taken by finish
            self.recorder.record()
            return False
        return ask_then_record

    def finish(self, title: str) -> str:
        """Write the trace (the table after the last step included) and say what was written;
        OSError when it cannot be."""
        self.recorder.record_last()
        frames = self.recorder.frames
        write(self.target, frames, title)
        return f"wrote the cell map of {frames[-1]['step']} steps ({len(frames)} frames) to {self.target}"
