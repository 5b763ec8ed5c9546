"""What every bench script shares: a timer, the table it prints, the JSON it writes.

Scripts run as `python bench/NAME.py`, which puts this folder on sys.path.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

# A column: header, row key, format spec (the width comes from the header).
Column = tuple[str, str, str]


def time_us(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    """Right-aligned columns, each as wide as its header (at least 6), under a rule."""
    widths = [max(len(head), 6) for head, _, _ in columns]
    head = " ".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, widths))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{r[key]:>{w}{fmt}}" for (_, key, fmt), w in zip(columns, widths)))
    return "\n".join(lines)


def write_json(path: str | None, bench: str, **fields: Any) -> None:
    """The figures plus where they were measured; nothing when no path was given."""
    if not path:
        return
    payload = {"bench": bench, "device": str(mx.default_device()), "mlx": mx.__version__,
               "machine": platform.platform(), **fields}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
