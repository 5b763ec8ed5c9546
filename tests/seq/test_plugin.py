"""The layout is found through its real entry point, not by importing it."""

from __future__ import annotations

import importlib.metadata

import kvlayout
from kvlayout import CacheConfig, LayerConfig


def test_the_seq_entry_point_is_declared_in_the_kvlayout_group():
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(group="kvlayout")}
    assert eps["seq"].value == "kvlayout_seq.plugin"
    assert eps["seq"].dist.name == "kvlayout-seq"


def test_resolve_mlx_seq_gives_the_builder_from_kvlayout_seq():
    builder = kvlayout.resolve("mlx", "seq")
    assert (builder.backend_id, builder.kind, builder.distribution) == ("mlx", "seq", "kvlayout-seq")
    assert builder.summary


def test_build_through_the_registry_gives_a_cache_with_a_sequence_control():
    config = CacheConfig(capacity=16, n_layers=2, layers=[LayerConfig(2, 4)])
    cache = kvlayout.build("mlx", "seq", config)
    control = cache.as_control()
    assert (control.capacity, control.length) == (16, 0)
