"""The cell map: who owns each cell, drawn small enough to send a few times a second.

A frame classes every cell (`CLASS_*`): free; held only by the prefix cache
(a kept prefix no live sequence reads); owned by two or more live sequences
(a shared prompt, forks); or owned by one live sequence, `CLASS_SEQ0 + id`.
Pools larger than `MAX_BUCKETS` cells are downsampled into buckets of
`bucket` consecutive cells, each drawn as the class most of its occupied
cells have (free only when all of its cells are), so occupancy stays visible
however large the pool. The classes travel as base64 bytes: at most
`MAX_BUCKETS` bytes (5.4 KB of base64) per frame, whatever the capacity.

Read through the CellView face between steps, on the engine thread.
"""

from __future__ import annotations

import base64
from collections.abc import Collection

import attrs
import numpy as np

CLASS_FREE, CLASS_CACHED, CLASS_SHARED, CLASS_SEQ0 = 0, 1, 2, 3
MAX_BUCKETS = 4096
SEQ_CLASSES = 256 - CLASS_SEQ0  # ids past this share colors (cycled)


def cell_view(cache):
    """`cache`'s CellView face, or None: a layout without cells (mlx:seq), or one predating the
    face (no `as_cell_view` of its own nor FacesBase's)."""
    as_cell_view = getattr(cache, "as_cell_view", None)
    return as_cell_view() if as_cell_view is not None else None


@attrs.frozen(eq=False)
class Snapshot:
    """The table as the CellView face showed it between two steps (copies: safe to read from
    any thread), and the ids the prefix cache held then."""

    capacity: int
    cells: np.ndarray  # [n] occupied cells, ascending
    positions: np.ndarray  # [n]
    owners: np.ndarray  # bool [n, max_seqs]
    kept: frozenset[int]


def take(view, kept: Collection[int]) -> Snapshot:
    cells, pos, owners = view.cell_owners()
    return Snapshot(int(view.capacity), cells, pos, owners, frozenset(kept))


def cell_classes(snap: Snapshot) -> tuple[np.ndarray, dict]:
    """(class of every cell [capacity] uint8, counts)."""
    live = snap.owners.copy()
    kept_ids = [i for i in snap.kept if 0 <= i < live.shape[1]]
    live[:, kept_ids] = False
    n_live = live.sum(axis=1)
    one = CLASS_SEQ0 + (np.argmax(live, axis=1) % SEQ_CLASSES) if live.size else np.zeros(0, np.int64)
    cls = np.where(n_live >= 2, CLASS_SHARED, np.where(n_live == 1, one, CLASS_CACHED)).astype(np.uint8)
    out = np.zeros(snap.capacity, np.uint8)
    out[snap.cells] = cls
    counts = {
        "used": int(snap.cells.size),
        "free": int(snap.capacity - snap.cells.size),
        "live": [int(i) for i in np.flatnonzero(live.any(axis=0))],
        "cached": int(np.count_nonzero(n_live == 0)),
        # Held once for several owners, kept prefixes included: what sharing saves. The map's
        # dark shade is narrower, the cells of 2+ live sequences (`shared_live`).
        "shared": int(np.count_nonzero(snap.owners.sum(axis=1) >= 2)),
        "shared_live": int(np.count_nonzero(n_live >= 2)),
    }
    return out, counts


def downsample(classes: np.ndarray, max_buckets: int = MAX_BUCKETS) -> tuple[np.ndarray, int]:
    """(class per bucket, cells per bucket): the most common non-free class of each bucket
    (the lowest on a tie), free only when all its cells are. One bincount over the occupied cells."""
    bucket = max(1, -(-classes.size // max_buckets))
    if bucket == 1:
        return classes, 1
    n = -(-classes.size // bucket)
    occupied = np.flatnonzero(classes)
    counts = np.bincount((occupied // bucket) * 256 + classes[occupied], minlength=n * 256).reshape(n, 256)
    out = np.argmax(counts, axis=1).astype(np.uint8)  # the first maximum: the lowest class on a tie
    out[counts.max(axis=1) == 0] = CLASS_FREE
    return out, bucket


def frame(snap: Snapshot, step: int, max_buckets: int = MAX_BUCKETS) -> dict:
    """One frame of the map: the step it follows, the buckets' classes (base64), the counts."""
    classes, counts = cell_classes(snap)
    buckets, bucket = downsample(classes, max_buckets)
    return {
        "step": step,
        "capacity": snap.capacity,
        "bucket": bucket,
        "buckets": int(buckets.size),
        "classes": base64.b64encode(buckets.tobytes()).decode("ascii"),
        **counts,
    }


def cell_info(snap: Snapshot, cell: int) -> dict:
    """What one cell holds: its position and owners (None and [] when free), and whether only
    kept prefixes own it."""
    at = int(np.searchsorted(snap.cells, cell))
    if at == snap.cells.size or snap.cells[at] != cell:
        return {"cell": cell, "position": None, "owners": [], "cached": False}
    ids = [int(i) for i in np.flatnonzero(snap.owners[at])]
    return {"cell": cell, "position": int(snap.positions[at]), "owners": ids,
            "cached": bool(ids) and all(i in snap.kept for i in ids)}
