"""What a run reports its K/V holds (runner.records.KVBytes), worked out by hand."""

from __future__ import annotations

from kvlayout.config import CacheConfig, LayerConfig, LayerPolicy
from kvlayout.runner.records import KVBytes


def config(kv_dtype="float32"):
    # Layer 0 flat (2 heads x 8), layers 1 and 2 sliding (1 head x 16, window 4).
    layers = [LayerConfig(2, 8, LayerPolicy()), LayerConfig(1, 16, LayerPolicy("ring", 4)),
              LayerConfig(1, 16, LayerPolicy("ring", 4))]
    return CacheConfig(capacity=64, n_layers=3, layers=layers, kv_dtype=kv_dtype)


def test_one_table_holds_every_layer_of_its_cells():
    k = KVBytes.of(config(), 10)
    per_cell = 2 * (2 * 8 + 16 + 16) * 4  # K and V of every layer, float32
    assert (k.per_cell, k.held, k.float16_held) == (per_cell, 10 * per_cell, 10 * per_cell // 2)
    assert "window_cells" not in k.to_json()


def test_window_tables_hold_their_own_cells_in_their_layers_only():
    k = KVBytes.of(config(), 10, window_cells=3)
    flat, window = 2 * 2 * 8 * 4, 2 * 2 * 16 * 4  # per cell: layer 0's K and V; layers 1-2's
    assert (k.per_cell, k.window_per_cell) == (flat + window, window)
    assert k.held == 10 * flat + 3 * window
    assert k.float16_held == (10 * flat + 3 * window) // 2
    assert k.to_json()["window_cells"] == 3 and k.to_json()["held"] == k.held


def test_the_run_report_says_what_each_kind_of_layer_held():
    from kvlayout.runner.report import kv_bytes_line

    line = kv_bytes_line(KVBytes.of(config(), 10, window_cells=3))
    assert line.startswith("K/V held at peak 2 KiB (10 cells x 128 B in the flat layers, 3 x 256 B in the "
                           "sliding-window layers)")  # 10 x 128 + 3 x 256 = 2048
    assert kv_bytes_line(KVBytes.of(config(), 10)).startswith("K/V held at peak 3.75 KiB (384 B a cell)")
