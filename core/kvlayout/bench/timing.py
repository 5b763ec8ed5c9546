"""How every comparison is timed: both sides in one process, interleaved."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved(sides: dict[str, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each side; each callable times its own work and returns it.

    Round r runs every side once, starting at side r mod n, so drift in the
    machine's load hits every side alike. `warmup` rounds are not kept.
    """
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(sides[n]())
    return times


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took; the caller puts any mx.eval it needs inside `fn`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
