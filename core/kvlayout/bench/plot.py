"""bench.png: every table line as a bar of its A/B ratio, on a log axis around "equal".

Drawn with matplotlib (the `bench` extra) on an Agg canvas of its own, so no
pyplot state or display is involved. Bar i is table line i, labelled
"row · case"; a column at the right gives its ratio and its two sides.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from kvlayout import persist
from kvlayout.bench import peers
from kvlayout.bench.record import Row

FASTER, SLOWER = "tab:green", "tab:red"  # A faster than B (ratio below 1), A slower


def require() -> None:
    """MissingExtra unless matplotlib is installed: checked before the suite measures anything."""
    peers.require("matplotlib", "kvlayout bench --out (the plot bench.png)")


def label(row: Row) -> str:
    """A bar's label: the row and the case, e.g. "6 grouped · decode step: layout / ideal"."""
    return f"{row.row} · {row.case}"


def figure(rows: list[Row], title: str) -> Any:
    """The figure for `rows` (a matplotlib Figure on an Agg canvas), first row at the top."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    ratios = [r.ratio for r in rows]
    fig = Figure(figsize=(11, 1.5 + 0.28 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ys = range(len(rows))
    # Each bar runs from 1 to its ratio, so on the log axis its length is how many times faster or slower.
    ax.barh(ys, [x - 1 for x in ratios], left=1, height=0.6, color=[FASTER if x < 1 else SLOWER for x in ratios])
    ax.set_yticks(list(ys), [label(r) for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top, as in the table
    ax.set_xscale("log")
    lo, hi = min(ratios + [1.0]), max(ratios + [1.0])
    pad = max(math.log10(hi / lo) * 0.08, 0.1)  # a little room past the longest bars (decades)
    ax.set_xlim(lo / 10**pad, hi * 10**pad)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.grid(axis="x", which="major", color="0.85", lw=0.6)
    ax.set_axisbelow(True)
    ax.axvline(1.0, color="black", lw=1)
    ax.annotate("equal", xy=(1.0, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                textcoords="offset points", ha="center", va="bottom", fontsize=8)
    for y, r in enumerate(rows[1:], start=1):  # a faint rule where the next row of the suite starts
        if r.row != rows[y - 1].row:
            ax.axhline(y - 0.5, color="0.85", lw=0.6)
    for y, (x, r) in enumerate(zip(ratios, rows)):
        ax.annotate(f"{_ratio(x)}  {r.a} / {r.b}", xy=(1.0, y), xycoords=("axes fraction", "data"), xytext=(6, 0),
                    textcoords="offset points", ha="left", va="center", fontsize=7)
    ax.set_xlabel("median time A / median time B (log scale): green, A faster; red, A slower")
    ax.set_title(title, fontsize=9, pad=16)
    return fig


def save(path: Path, rows: list[Row], title: str) -> None:
    """Write `figure(rows, title)` to `path` as a PNG, whole or not at all (the suite rewrites it after each row,
    and a stop part way must leave the last one readable)."""
    png = io.BytesIO()
    figure(rows, title).savefig(png, format="png", dpi=120, bbox_inches="tight")
    persist.write_atomic(path, [png.getvalue()])


def _ratio(x: float) -> str:
    """2.33, 0.38, 0.067, 0.0015: two decimals, or two significant digits below 0.1."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"
