"""Entry point of kvlayout-cell: the hooks kvlayout calls."""

from __future__ import annotations

import numpy as np

from kvlayout import Builder, hookimpl
from kvlayout_cell.stepper import lowest_free


def _build(config):
    from kvlayout_cell.cache import CellCache  # MLX is imported only when a cache is built

    return CellCache(config)


def _load(state_file):
    from kvlayout_cell.persist import load_cache

    return load_cache(state_file)


@hookimpl
def kvlayout_builders():
    return [
        Builder(
            backend_id="mlx",
            kind="cell",
            build=_build,
            summary="many sequences over one pool of cells: shared prefixes, explicit masks",
            load=_load,
        )
    ]


@hookimpl(trylast=True)
def kvlayout_choose_cells(free: np.ndarray, count: int) -> np.ndarray:
    """Lowest free first, so a freed cell refills before the table grows; any other policy wins."""
    return lowest_free(free, count)
