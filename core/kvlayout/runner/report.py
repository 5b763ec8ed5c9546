"""What `kvlayout run` shows: progress on stderr, then a table and totals (or JSON on stdout)."""

from __future__ import annotations

import contextlib
import json
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvlayout.engines.records import OnProgress
from kvlayout.runner.records import RunResult


class TokenRate(ProgressColumn):
    """Tokens per second, worked out when the bar redraws (about 10 Hz), not on every advance:
    rich's `task.speed` walks its samples, ~0.1 ms a call."""

    def render(self, task) -> Text:
        return Text(f"{task.speed:7.1f} tok/s" if task.speed else "")


@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[OnProgress]:
    """A rich bar on stderr (tokens done / planned, tok/s); yields the advance callback."""
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

        yield advance


def _preview(text: str, width: int = 40, tail: bool = False) -> str:
    """One printable line; `tail` keeps the end (prompts sharing a system prompt differ there)."""
    flat = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text.replace("\n", " "))
    if len(flat) <= width:
        return flat
    return "…" + flat[-(width - 1) :] if tail else flat[: width - 1] + "…"


def print_report(result: RunResult, console: Console | None = None) -> None:
    console = console or Console()
    st = result.stats
    table = Table(title=f"kvlayout run · {st.layout} · kv_dtype {st.kv_dtype} · {st.model}")
    for col, kw in (
        ("req", {"justify": "right"}),
        ("prompt", {"no_wrap": True, "overflow": "ellipsis", "max_width": 30}),
        ("sample", {"justify": "right"}),
        ("tokens", {"justify": "right", "min_width": 6}),
        ("stop", {"min_width": 6}),
        ("output", {"no_wrap": True, "overflow": "ellipsis", "max_width": 24}),
    ):
        table.add_column(col, **kw)
    for r in result.requests:
        for j, s in enumerate(result.outputs[r.index]):
            table.add_row(
                str(r.index) if j == 0 else "",
                _preview(result.prompts[r.index], 30, tail=True) if j == 0 else "",
                str(j),
                str(len(s.token_ids)),
                s.finish_reason,
                _preview(s.text, 32),
            )
    console.print(table)
    saving = f" ({st.peak_tokens / st.peak_cells:.2f}x shared)" if st.peak_cells else ""
    console.print(
        f"prefill {st.prefill_tokens} tok at {st.prefill_tok_s:,.0f} tok/s · "
        f"decode {st.decode_tokens} tok at {st.decode_tok_s:,.0f} tok/s · "
        f"{st.generated_tokens} generated in {st.wall_s:.2f} s · {st.steps} steps (max batch {st.max_batch})",
        highlight=False,
    )
    console.print(
        f"peak cells held {st.peak_cells} vs tokens held {st.peak_tokens}{saving} · "
        f"preemptions {st.preemptions} · kv_dtype {st.kv_dtype}",
        highlight=False,
    )


def print_json(result: RunResult) -> None:
    print(json.dumps(result.to_json(), indent=2))
