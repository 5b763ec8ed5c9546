"""The caches the rows measure, and the few things about them that no face offers.

The rows drive the caches through their faces (`as_batch_control()`,
`as_cell_stepper()`, `as_control()`) and `update_and_fetch`, and use the
public attributes a layout offers for measuring (`key_pools`/`value_pools`,
`step_groups`, `step_mask`, `attention_path`). Building a cache and reading
the cell table are here, one small function each, so a layout reshaped under
the bench is a one-line fix in this module.
"""

from __future__ import annotations

from typing import Any

from kvlayout import CacheConfig
from kvlayout.registry import make_plugin_manager


def cell_cache(config: CacheConfig, lowest_free: bool = True) -> Any:
    """A CellCache under a fresh plugin manager, placing by lowest free cells (`lowest_free`): rows 5
    and 6 build their interleaved tables (sequence s in cells s, s + n, ...) with one step, which
    only that placement lays out so; else by the cell plugin's default (pages of their own)."""
    from kvlayout_cell.cache import CellCache
    from kvlayout_cell.plugin import LowestFree

    pm = make_plugin_manager()
    if lowest_free:
        pm.register(LowestFree())
    return CellCache(config, pm)


def seq_cache(config: CacheConfig) -> Any:
    from kvlayout_seq.mlx_cache import SeqCache

    return SeqCache(config)


def cell_table(cache: Any) -> Any:
    """The cell cache's table of cells, for reading it: `seq_cells(s)`, `free_list()`.

    Every access the bench makes to the table goes through here.
    """
    return cache.groups.primary.table

