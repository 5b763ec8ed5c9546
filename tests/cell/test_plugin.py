"""The plugin is found through its real entry point and builds the cache."""

from __future__ import annotations

import kvlayout
from kvlayout import CacheConfig, LayerConfig
from kvlayout.registry import make_plugin_manager


def test_the_cell_layout_is_discovered_through_its_entry_point():
    builder = kvlayout.resolve("mlx", "cell", make_plugin_manager())
    assert builder.distribution == "kvlayout-cell"
    assert kvlayout.resolve("mlx", "cell").distribution == "kvlayout-cell"


def test_the_builder_makes_a_cache_with_pools_spanning_the_table():
    config = CacheConfig(capacity=100, n_layers=2, layers=[LayerConfig(2, 8)], initial_capacity=512, max_seqs=3)
    cache = kvlayout.build("mlx", "cell", config)
    bc = cache.as_batch_control()
    assert (bc.capacity, bc.max_seqs, bc.free_cells, bc.used_end) == (100, 3, 100, 0)
    assert cache.key_pools[1].slots == 100 and cache.value_pools[1].max_slots == 100


def test_the_plugins_own_placement_is_the_last_resort():
    pm = make_plugin_manager()
    impls = [i for i in pm.hook.kvlayout_choose_cells.get_hookimpls() if i.plugin_name.startswith("kvlayout-cell")]
    assert len(impls) == 1 and impls[0].trylast
