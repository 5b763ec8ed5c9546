"""What `kvlayout run` shows: the text as it is generated, then a table of whole outputs and totals.

On a terminal, a live view redraws each sample's text as it grows (rich
Live, about 8 times a second, cleared when the run ends). When stdout is not
a terminal nothing is drawn on it while the run goes (a progress bar goes to
stderr if that is a terminal), and the table is plain text: no control codes,
wrapped to the console's width (80 columns unless COLUMNS says otherwise).
Either way the table holds every output whole, wrapped, never cut.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence

import attrs
from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvlayout.config import show_bytes
from kvlayout.engines.records import OnProgress
from kvlayout.errors import one_line
from kvlayout.runner.blas import short as short_blas
from kvlayout.runner.records import KVBytes, OnText, RunResult, TextEvent


class TokenRate(ProgressColumn):
    """Tokens per second, worked out when the bar redraws (about 10 Hz), not on every advance:
    rich's `task.speed` walks its samples, ~0.1 ms a call."""

    def render(self, task) -> Text:
        return Text(f"{task.speed:7.1f} tok/s" if task.speed else "")


def printable(text: str) -> str:
    """Text safe to print: line breaks kept, tabs as spaces, other control characters as '·'
    (a model's output must not move a terminal's cursor or ring its bell)."""
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    return "".join(c if c == "\n" or c.isprintable() else "·" for c in text)


def prompt_label(text: str, messages: list[dict] | None) -> str:
    """What a request asked: a chat's last message, else the prompt text."""
    return messages[-1]["content"] if messages else text


@attrs.define
class Watch:
    """What the run reports to while it goes: `progress` (tokens done) and `on_text` (None: no text shown)."""

    progress: OnProgress
    on_text: OnText | None = None


@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[Watch]:
    """A rich bar on stderr (tokens done / planned, tok/s), only when stderr is a terminal."""
    console = Console(stderr=True)
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TokenRate(),
        TimeElapsedColumn(),
    )
    # Off when stderr is not a terminal: a log gets no bar remnants.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(label, total=total)

        def advance(n: int) -> None:
            bar.update(task, advance=n)

        yield Watch(advance)


class LiveText:
    """The state a live view draws: each sample's text so far, tokens done, time taken."""

    def __init__(self, title: str, labels: Sequence[str], samples: Sequence[int], total: int, console: Console):
        self.title, self.labels, self.total, self.console = title, list(labels), total, console
        self.texts = {(i, j): "" for i, n in enumerate(samples) for j in range(n)}
        self.finished: dict[tuple[int, int], str] = {}
        self.done = 0
        self.t0 = time.perf_counter()

    def advance(self, n: int) -> None:
        self.done += n

    def on_text(self, event: TextEvent) -> None:
        key = (event.request, event.sample)
        self.texts[key] += event.text
        if event.finish_reason is not None:
            self.finished[key] = event.finish_reason

    def __rich__(self) -> Group:
        seconds = time.perf_counter() - self.t0
        rate = self.done / seconds if seconds > 0 else 0.0
        width = max(20, self.console.width)
        # Each sample shows the end of its text, at most `lines` lines of it, so the view fits the screen.
        rows = len(self.labels) + len(self.texts) + 2
        lines = max(1, min(3, (self.console.height - rows) // max(1, len(self.texts)) + 1))
        keep = lines * (width - 8)
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", width=3, no_wrap=True)
        grid.add_column(ratio=1, overflow="fold")
        for i, label in enumerate(self.labels):
            grid.add_row(Text("▸", style="bold"), Text(printable(label).replace("\n", " "), style="bold"))
            for (r, j), text in self.texts.items():
                if r != i:
                    continue
                flat = printable(text).replace("\n", " ⏎ ")
                shown = flat if len(flat) <= keep else "…" + flat[-(keep - 1) :]
                mark = f" [{self.finished[r, j]}]" if (r, j) in self.finished else " ▌"
                grid.add_row(Text(str(j), style="dim"), Text(shown) + Text(mark, style="dim"))
        status = Text(
            f"{self.title} · {self.done}/{self.total} tokens · {rate:.1f} tok/s · {seconds:.1f} s", style="dim"
        )
        return Group(grid, status)


@contextlib.contextmanager
def live_view(
    title: str, labels: Sequence[str], samples: Sequence[int], total: int, console: Console
) -> Iterator[Watch]:
    """Each sample's text as it is generated, redrawn in place on `console` (a terminal) and
    cleared at the end, when the table takes its place."""
    state = LiveText(title, labels, samples, total, console)
    with Live(state, console=console, refresh_per_second=8, transient=True, redirect_stderr=False):
        yield Watch(state.advance, state.on_text)


def print_report(result: RunResult, console: Console | None = None) -> None:
    """The outputs, whole and wrapped, one row per sample under its request's prompt; then the totals."""
    console = console or Console()
    st = result.stats
    blas = f" · {short_blas(result.blas)}" if result.blas else ""
    table = Table(title=f"kvlayout run · {st.layout} · kv_dtype {st.kv_dtype} · {st.model}{blas}", box=box.SQUARE)
    table.add_column("req", justify="right", no_wrap=True)
    table.add_column("sample", justify="right", no_wrap=True)
    table.add_column("tokens", justify="right", no_wrap=True)
    table.add_column("stop", no_wrap=True)
    table.add_column("text", overflow="fold", ratio=1)
    messages = result.messages or [None] * len(result.prompts)
    for r in result.requests:
        label = prompt_label(result.prompts[r.index], messages[r.index])
        table.add_row(str(r.index), "prompt", str(len(r.prompt)), "", Text(printable(label), style="bold"))
        for j, s in enumerate(result.outputs[r.index]):
            table.add_row("", str(j), str(len(s.token_ids)), s.finish_reason, Text(printable(s.text)))
        table.add_section()
    console.print(table)
    saving = f" ({st.peak_tokens / st.peak_cells:.2f}x shared)" if st.peak_cells else ""
    # Three short lines, each within 80 columns for any plausible numbers.
    for line in (
        f"prefill {st.prefill_tokens} tok at {st.prefill_tok_s:,.0f} tok/s · "
        f"decode {st.decode_tokens} tok at {st.decode_tok_s:,.0f} tok/s",
        f"{st.generated_tokens} generated in {st.wall_s:.2f} s · {st.steps} steps (max batch {st.max_batch}) · "
        f"preemptions {st.preemptions}",
        f"peak cells held {st.peak_cells} vs tokens held {st.peak_tokens}{saving} · kv_dtype {st.kv_dtype}",
        *([kv_bytes_line(result.kv_bytes)] if result.kv_bytes is not None else []),
        *([drafts_line(st)] if st.drafted_tokens else []),
    ):
        console.print(line, highlight=False)


def drafts_line(st) -> str:
    """What speculation did ([engine] speculate): drafts verified, kept, and steps per generated token."""
    kept = st.accepted_tokens / st.drafted_tokens
    per = st.steps / st.generated_tokens if st.generated_tokens else 0.0
    return (f"drafted {st.drafted_tokens} tok, kept {st.accepted_tokens} ({kept:.0%}) · "
            f"{per:.2f} steps a generated token")


def kv_bytes_line(sizes: KVBytes) -> str:
    """The K/V the peak held, next to what float16 would hold for the same cells."""
    line = f"K/V held at peak {show_bytes(sizes.held)} ({show_bytes(sizes.per_cell)} a cell)"
    if sizes.window_cells is not None:  # the sliding-window layers' own table held fewer cells
        line = (f"K/V held at peak {show_bytes(sizes.held)} ({sizes.cells} cells x "
                f"{show_bytes(sizes.per_cell - sizes.window_per_cell)} in the flat layers, {sizes.window_cells} x "
                f"{show_bytes(sizes.window_per_cell)} in the sliding-window layers)")
    if sizes.kv_dtype != "float16":
        ratio = f", {sizes.float16_per_cell / sizes.per_cell:.2f}x" if sizes.per_cell else ""
        line += f" · as float16 {show_bytes(sizes.float16_held)}{ratio}"
    return line


def ranks_line(figures: list[dict]) -> str:
    """A tensor-parallel run's ranks: what each holds of the model and a cell's K/V."""
    each = ", ".join(f"{show_bytes(f['model_bytes'])} model + {show_bytes(f['kv_bytes_per_cell'])}/cell K/V"
                     for f in figures)
    return f"tensor parallel over {len(figures)} ranks: {each}"


def failure_line(result: RunResult) -> str | None:
    """One line saying how many samples failed and why (the first reason; how many others), or None.

    `kvlayout run` prints it once on stderr, whatever else it shows, and
    exits 1: a plugin's fault fails every sample its steps carried, and its
    reason (the plugin and the hook) must not be left to `--json` alone.
    """
    failed = [s for samples in result.outputs for s in samples if s.finish_reason == "error"]
    if not failed:
        return None
    total = sum(len(samples) for samples in result.outputs)
    reasons = list(dict.fromkeys(one_line(s.error or "no reason given") for s in failed))
    more = f" (and {len(reasons) - 1} other reason(s); --json has each sample's)" if len(reasons) > 1 else ""
    return f"{len(failed)} of {total} samples failed: {reasons[0]}{more}"


def print_json(result: RunResult, extra: dict | None = None) -> None:
    """The result as JSON on stdout; `extra` keys (how a stopped run was saved) after its own."""
    print(json.dumps({**result.to_json(), **(extra or {})}, indent=2))
