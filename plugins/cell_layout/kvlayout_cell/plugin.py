"""Entry point of kvlayout-cell: the hooks kvlayout calls (its builder, its default placement, whose rule
lives in `kvlayout_cell.placement`), and placement plugins to register instead of it."""

from __future__ import annotations

import numpy as np

from kvlayout import Builder, hookimpl

# The default placement, registered with this module (the rule is placement.choose_cells); the others
# are importable from here too.
from kvlayout_cell.placement import kvlayout_choose_cells, lowest_free, own_pages, page_for  # noqa: F401


def _build(config):
    from kvlayout_cell.cache import CellCache  # MLX is imported only when a cache is built

    return CellCache(config)


def _load(state_file):
    from kvlayout_cell.cache import load_cache  # or loaded

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


class LowestFree:
    """A placement plugin answering the lowest free cells, the cell plugin's default before pages:
    register it (`pm.register(LowestFree())`) to keep or measure that placement."""

    @hookimpl
    def kvlayout_choose_cells(self, free: np.ndarray, count: int) -> np.ndarray:
        return lowest_free(free, count)


class OwnPages:
    """A placement plugin answering the default rule (`own_pages`) over pages of `page` cells instead
    of PLACEMENT_PAGE: register it (`pm.register(OwnPages(32))`) to compare page sizes or to exercise
    pages in a small table."""

    def __init__(self, page: int):
        self.page = page

    @hookimpl
    def kvlayout_choose_cells(self, free: np.ndarray, seq_ids: np.ndarray, prev_cells: np.ndarray,
                              window: int) -> np.ndarray:
        return own_pages(free, seq_ids, prev_cells, self.page, run_on=window == 0)
