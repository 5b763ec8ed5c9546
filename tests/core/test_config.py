"""CacheConfig, LayerConfig, LayerPolicy: validation, mapping round-trips, layer(i)."""

from __future__ import annotations

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import attrs
import pytest

from kvlayout import CacheConfig, ConfigError, KVLayoutError, LayerConfig, LayerPolicy

LAYER = LayerConfig(n_kv_heads=2, head_dim=64)


def cache(**overrides):
    kwargs = dict(capacity=1024, n_layers=2, layers=[LAYER])
    kwargs.update(overrides)
    return CacheConfig(**kwargs)


# (what is built, the field the message must name, the value it must show)
BAD_VALUES = [
    pytest.param(lambda: cache(capacity=0), "capacity", "0", id="capacity-zero"),
    pytest.param(lambda: cache(capacity=-5), "capacity", "-5", id="capacity-negative"),
    pytest.param(lambda: cache(capacity=8.0), "capacity", "8.0", id="capacity-float"),
    pytest.param(lambda: cache(capacity="8"), "capacity", "'8'", id="capacity-str"),
    pytest.param(lambda: cache(capacity=True), "capacity", "True", id="capacity-bool"),
    pytest.param(lambda: cache(n_layers=0), "n_layers", "0", id="n_layers-zero"),
    pytest.param(lambda: cache(n_layers=-1), "n_layers", "-1", id="n_layers-negative"),
    pytest.param(lambda: cache(n_layers=2.5), "n_layers", "2.5", id="n_layers-float"),
    pytest.param(lambda: cache(initial_capacity=-1), "initial_capacity", "-1", id="initial-negative"),
    pytest.param(lambda: cache(initial_capacity=False), "initial_capacity", "False", id="initial-bool"),
    pytest.param(lambda: cache(kv_dtype="fp16"), "kv_dtype", "'fp16'", id="dtype-unknown"),
    pytest.param(lambda: cache(kv_dtype="int8"), "kv_dtype", "'int8'", id="dtype-int8"),
    pytest.param(lambda: cache(kv_dtype=16), "kv_dtype", "16", id="dtype-not-str"),
    pytest.param(lambda: cache(max_seqs=0), "max_seqs", "0", id="max_seqs-zero"),
    pytest.param(lambda: cache(max_seqs=-3), "max_seqs", "-3", id="max_seqs-negative"),
    pytest.param(lambda: cache(max_seqs=True), "max_seqs", "True", id="max_seqs-bool"),
    pytest.param(lambda: cache(max_write=0), "max_write", "0", id="max_write-zero"),
    pytest.param(lambda: cache(max_write=-2), "max_write", "-2", id="max_write-negative"),
    pytest.param(lambda: cache(max_write=1.5), "max_write", "1.5", id="max_write-float"),
    pytest.param(lambda: cache(max_write=True), "max_write", "True", id="max_write-bool"),
    pytest.param(lambda: cache(layers="abc"), "layers", "'abc'", id="layers-not-a-list"),
    pytest.param(lambda: LayerPolicy(kind="ring", window=0), "window", "0", id="ring-window-zero"),
    pytest.param(lambda: LayerPolicy(kind="ring", window=-4), "window", "-4", id="ring-window-negative"),
    pytest.param(lambda: LayerPolicy(kind="ring", window=2.0), "window", "2.0", id="ring-window-float"),
    pytest.param(lambda: LayerPolicy(kind="ring", window=True), "window", "True", id="ring-window-bool"),
    pytest.param(lambda: LayerPolicy(kind="flat", window=16), "window", "16", id="flat-with-window"),
    pytest.param(lambda: LayerPolicy(kind="paged"), "kind", "'paged'", id="policy-kind-unknown"),
    pytest.param(lambda: LayerPolicy(kind="Ring", window=4), "kind", "'Ring'", id="policy-kind-case"),
    pytest.param(lambda: LayerConfig(n_kv_heads=0, head_dim=64), "n_kv_heads", "0", id="heads-zero"),
    pytest.param(lambda: LayerConfig(n_kv_heads=2, head_dim=-64), "head_dim", "-64", id="head_dim-negative"),
    pytest.param(lambda: LayerConfig(n_kv_heads="2", head_dim=64), "n_kv_heads", "'2'", id="heads-str"),
    pytest.param(lambda: LayerConfig(n_kv_heads=True, head_dim=64), "n_kv_heads", "True", id="heads-bool"),
    pytest.param(lambda: LayerConfig(n_kv_heads=2, head_dim=64, policy="ring"), "policy", "'ring'", id="policy-str"),
]


@pytest.mark.parametrize("make, field, shown", BAD_VALUES)
def test_each_invalid_value_raises_config_error_naming_field_and_value(make, field, shown):
    with pytest.raises(ConfigError) as info:
        make()
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVLayoutError)
    message = str(info.value)
    assert field in message
    assert shown in message


@pytest.mark.parametrize("n_layers, count", [(3, 2), (2, 3), (4, 0)])
def test_layers_of_neither_one_nor_n_layers_entries_is_refused(n_layers, count):
    with pytest.raises(ConfigError, match="layers") as info:
        cache(n_layers=n_layers, layers=[LAYER] * count)
    message = str(info.value)
    assert f"{count} entries" in message
    assert f"n_layers={n_layers}" in message


def test_messages_say_what_is_allowed():
    with pytest.raises(ConfigError) as info:
        cache(kv_dtype="fp8")
    assert all(name in str(info.value) for name in ("float16", "bfloat16", "float32"))
    with pytest.raises(ConfigError) as info:
        LayerPolicy(kind="paged")
    assert "flat" in str(info.value) and "ring" in str(info.value)
    with pytest.raises(ConfigError, match=">= 1"):
        cache(capacity=0)


def test_valid_values_are_accepted_with_the_designed_defaults():
    c = cache()
    assert (c.kv_dtype, c.initial_capacity, c.max_write, c.max_seqs) == ("float16", 512, None, 64)
    assert c.layers == (LAYER,)
    assert LAYER.policy == LayerPolicy("flat", 0)
    for dtype in ("float16", "bfloat16", "float32"):
        assert cache(kv_dtype=dtype).kv_dtype == dtype
    assert cache(initial_capacity=0, max_write=1, max_seqs=1, capacity=1).initial_capacity == 0
    assert LayerPolicy(kind="ring", window=1).window == 1


def test_layer_broadcasts_a_single_entry_to_every_layer():
    c = cache(n_layers=4, layers=[LAYER])
    assert [c.layer(i) for i in range(4)] == [LAYER] * 4


def test_layer_returns_each_entry_when_one_per_layer():
    per = [LayerConfig(2, 64), LayerConfig(4, 32, LayerPolicy("ring", 8)), LayerConfig(1, 16)]
    c = cache(n_layers=3, layers=per)
    assert c.layer(0) is per[0]
    assert c.layer(1).policy.window == 8 and c.layer(1).n_kv_heads == 4
    assert c.layer(2).head_dim == 16


@pytest.mark.parametrize("index", [-1, 2, 1.0, True])
def test_layer_index_outside_the_model_is_refused(index):
    with pytest.raises(ConfigError, match="layer index"):
        cache(n_layers=2).layer(index)


def test_configs_are_frozen():
    c = cache()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.capacity = 7
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.layers[0].head_dim = 7
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.layers[0].policy.window = 7
    with pytest.raises(TypeError):  # layers is a tuple, not a list anyone can append to
        c.layers[0] = LAYER
    assert c.capacity == 1024 and hash(c) == hash(cache())


TOML = """
capacity = 4096
n_layers = 3
kv_dtype = "bfloat16"
initial_capacity = 0
max_write = 16
max_seqs = 8

[[layers]]
n_kv_heads = 2
head_dim = 64

[[layers]]
n_kv_heads = 2
head_dim = 64
policy = { kind = "ring", window = 128 }

[[layers]]
n_kv_heads = 4
head_dim = 32
[layers.policy]
kind = "flat"
window = 0
"""

TOML_CONFIG = CacheConfig(
    capacity=4096,
    n_layers=3,
    layers=[
        LayerConfig(2, 64),
        LayerConfig(2, 64, LayerPolicy("ring", 128)),
        LayerConfig(4, 32, LayerPolicy("flat", 0)),
    ],
    kv_dtype="bfloat16",
    initial_capacity=0,
    max_write=16,
    max_seqs=8,
)

TOML_MAPPING = {
    "capacity": 4096,
    "n_layers": 3,
    "layers": [
        {"n_kv_heads": 2, "head_dim": 64, "policy": {"kind": "flat", "window": 0}},
        {"n_kv_heads": 2, "head_dim": 64, "policy": {"kind": "ring", "window": 128}},
        {"n_kv_heads": 4, "head_dim": 32, "policy": {"kind": "flat", "window": 0}},
    ],
    "kv_dtype": "bfloat16",
    "initial_capacity": 0,
    "max_seqs": 8,
    "max_write": 16,
}


def test_from_mapping_reads_what_tomllib_gives():
    assert CacheConfig.from_mapping(tomllib.loads(TOML)) == TOML_CONFIG


def test_to_mapping_writes_plain_dicts_and_round_trips():
    assert TOML_CONFIG.to_mapping() == TOML_MAPPING
    assert CacheConfig.from_mapping(TOML_CONFIG.to_mapping()) == TOML_CONFIG
    assert CacheConfig.from_mapping(TOML_MAPPING).to_mapping() == TOML_MAPPING


def test_round_trip_of_a_broadcast_config_keeps_one_entry_and_omits_unset_max_write():
    c = cache(n_layers=5)
    data = c.to_mapping()
    assert "max_write" not in data  # TOML has no null
    assert len(data["layers"]) == 1
    back = CacheConfig.from_mapping(data)
    assert back == c and back.max_write is None and back.layer(4) == LAYER


def test_from_mapping_accepts_a_single_layer_table():
    c = CacheConfig.from_mapping(
        tomllib.loads("capacity = 64\nn_layers = 2\n[layers]\nn_kv_heads = 1\nhead_dim = 8\n")
    )
    assert c.layers == (LayerConfig(1, 8),) and c.layer(1) == LayerConfig(1, 8)


@pytest.mark.parametrize(
    "data, cls_name, key, valid",
    [
        ({"capacity": 8, "n_layers": 1, "layers": [{"n_kv_heads": 1, "head_dim": 8}], "capacty": 9},
         "CacheConfig", "capacty", ["capacity", "n_layers", "layers", "kv_dtype", "initial_capacity",
                                    "max_write", "max_seqs"]),
        ({"capacity": 8, "n_layers": 1, "layers": [{"n_kv_heads": 1, "head_dim": 8, "heads": 2}]},
         "LayerConfig", "heads", ["n_kv_heads", "head_dim", "policy"]),
        ({"capacity": 8, "n_layers": 1,
          "layers": [{"n_kv_heads": 1, "head_dim": 8, "policy": {"kind": "ring", "size": 4}}]},
         "LayerPolicy", "size", ["kind", "window"]),
    ],
    ids=["cache", "layer", "policy"],
)
def test_unknown_keys_are_refused_by_name_listing_the_valid_ones(data, cls_name, key, valid):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_mapping(data)
    message = str(info.value)
    assert cls_name in message and repr(key) in message
    assert all(name in message for name in valid)


def test_missing_required_keys_are_a_config_error_naming_them():
    with pytest.raises(ConfigError, match="'n_layers'.*'layers'"):
        CacheConfig.from_mapping({"capacity": 8})
    with pytest.raises(ConfigError, match="'head_dim'"):
        CacheConfig.from_mapping({"capacity": 8, "n_layers": 1, "layers": [{"n_kv_heads": 1}]})


def test_from_mapping_of_something_else_than_a_mapping_is_refused():
    with pytest.raises(ConfigError, match="mapping"):
        CacheConfig.from_mapping([("capacity", 8)])
