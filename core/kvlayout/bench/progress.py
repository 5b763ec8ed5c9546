"""The suite's progress on stderr: which row is running, how many are done, how long each took.

On a terminal a rich bar names the row running (rows done / all, time
taken); elsewhere (a log, a pipe) there is no bar, only a line as each row
finishes, so a run stopped part way still says how far it got.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RowProgress:
    """A context manager the suite tells `running(key)` and `finished(key, seconds)` of each row."""

    def __init__(self, keys: list[str]):
        self.total = len(keys)
        self.console = Console(stderr=True)
        self.bar: Progress | None = None
        self.task = None

    def __enter__(self) -> RowProgress:
        if self.console.is_terminal:
            # stdout goes through the bar's console (drawn above it) only when it is this terminal too:
            # a table piped to a file must not land on stderr.
            self.bar = Progress(
                TextColumn("[bold]kvlayout bench[/] row {task.fields[row]}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("rows"), TimeElapsedColumn(), console=self.console, transient=True,
                redirect_stdout=sys.stdout.isatty(),
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("rows", total=self.total, row="")
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def running(self, key: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, row=key)

    def finished(self, key: str, seconds: float) -> None:
        line = f"[{key}: {seconds:.0f}s]"
        if self.bar is None:
            print(line, file=sys.stderr, flush=True)
            return
        self.bar.console.print(line, markup=False, highlight=False)  # above the bar, which moves on
        self.bar.update(self.task, advance=1)
