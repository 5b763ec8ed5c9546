"""The server's observer plugin: hears every placed and aborted cell step through the layout's hooks.

Registered with the process's plugin manager while a server runs (the cell
layout announces steps through `kvlayout_step_placed` and
`kvlayout_step_aborted`, the hooks meant for "metrics, tracing, pictures").
It counts aborted steps and marks the cell map stale; the worker redraws a
stale map between steps (the verbs that free or share cells, which have no
hook, run between steps too, and mark it stale themselves). One server per
process is the intended use: a second cell cache stepping in the same
process would be counted too.
"""

from __future__ import annotations

import itertools
import threading

from kvlayout.hookspecs import hookimpl

_names = itertools.count()


class CellObserver:
    """Counts aborted steps; `stale` when the table changed."""

    def __init__(self) -> None:
        self.name = f"kvlayout-serve-observer-{next(_names)}"
        self.lock = threading.Lock()
        self.aborted_steps = 0
        self.stale = True
        # A step is announced once per distinct window of the model's layers, the same windows
        # every step: the first window ever heard stands for the step.
        self.counted_window: int | None = None

    @hookimpl
    def kvlayout_step_placed(self, step, window) -> None:
        with self.lock:
            if self.counted_window is None:
                self.counted_window = window
            self.stale = True

    @hookimpl
    def kvlayout_step_aborted(self, step, window) -> None:
        with self.lock:
            if window == self.counted_window:
                self.aborted_steps += 1
            self.stale = True

    def take_stale(self) -> bool:
        """Whether the table changed since the last call (and reset it)."""
        with self.lock:
            stale, self.stale = self.stale, False
            return stale

    def mark_stale(self) -> None:
        with self.lock:
            self.stale = True
