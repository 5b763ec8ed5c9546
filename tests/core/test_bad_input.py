"""Bad input to every core entry point: a KVLayoutError naming the argument, nothing changed.

One table per entry point (config records, MLXPool, registry, runner config).
Each row is a call with one wrong argument: a wrong type, shape or dtype, a
negative or huge number, NaN/inf, None, a string. The config records are
frozen values (a refused construction leaves nothing behind); the pool and
the registry are compared before and after.
"""

from __future__ import annotations

import math
import os
import re

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import (
    AttendSpec,
    CacheConfig,
    ConfigError,
    KVLayoutError,
    LayerConfig,
    LayerPolicy,
    LayoutNotFound,
    MaskKind,
    StateError,
)
from kvlayout.config import machine_memory, show_bytes
from kvlayout.mlx import MAX_SLOTS, MLXPool
from kvlayout.registry import available, build, make_plugin_manager, resolve
from kvlayout.runner.config import RunConfig, load_config

H, D = 2, 3
L = LayerConfig(H, D)


def raises_naming(error, name, call):
    """`call()` raises `error` (a KVLayoutError subclass) whose message names `name`."""
    assert issubclass(error, KVLayoutError)
    with pytest.raises(error) as info:
        call()
    assert name in str(info.value), f"{name!r} not named in: {info.value}"
    return info.value


# -- config records ----------------------------------------------------------

GOOD_CACHE = dict(capacity=8, n_layers=2, layers=[L])

CONFIG = {
    "policy kind None": (LayerPolicy, dict(kind=None), "LayerPolicy.kind"),
    "policy kind a list": (LayerPolicy, dict(kind=["ring"]), "LayerPolicy.kind"),
    "policy window a float": (LayerPolicy, dict(kind="ring", window=2.0), "LayerPolicy.window"),
    "policy window NaN": (LayerPolicy, dict(kind="ring", window=math.nan), "LayerPolicy.window"),
    "policy window negative": (LayerPolicy, dict(kind="ring", window=-1), "LayerPolicy.window"),
    "policy window a string": (LayerPolicy, dict(kind="ring", window="4"), "LayerPolicy.window"),
    "flat with a window": (LayerPolicy, dict(kind="flat", window=2**70), "LayerPolicy.window"),
    "heads zero": (LayerConfig, dict(n_kv_heads=0, head_dim=D), "LayerConfig.n_kv_heads"),
    "heads a float": (LayerConfig, dict(n_kv_heads=2.0, head_dim=D), "LayerConfig.n_kv_heads"),
    "head_dim None": (LayerConfig, dict(n_kv_heads=H, head_dim=None), "LayerConfig.head_dim"),
    "head_dim a bool": (LayerConfig, dict(n_kv_heads=H, head_dim=True), "LayerConfig.head_dim"),
    "policy a string": (LayerConfig, dict(n_kv_heads=H, head_dim=D, policy="ring"), "LayerConfig.policy"),
    "policy mapping with an unknown key": (
        LayerConfig, dict(n_kv_heads=H, head_dim=D, policy={"kind": "ring", "window": 2, "size": 3}), "size"),
    "capacity a string": (CacheConfig, {**GOOD_CACHE, "capacity": "8"}, "CacheConfig.capacity"),
    "capacity negative": (CacheConfig, {**GOOD_CACHE, "capacity": -1}, "CacheConfig.capacity"),
    "capacity inf": (CacheConfig, {**GOOD_CACHE, "capacity": math.inf}, "CacheConfig.capacity"),
    "capacity None": (CacheConfig, {**GOOD_CACHE, "capacity": None}, "CacheConfig.capacity"),
    "n_layers zero": (CacheConfig, {**GOOD_CACHE, "n_layers": 0}, "CacheConfig.n_layers"),
    "layers None": (CacheConfig, {**GOOD_CACHE, "layers": None}, "CacheConfig.layers"),
    "layers a string": (CacheConfig, {**GOOD_CACHE, "layers": "flat"}, "CacheConfig.layers"),
    "layers of ints": (CacheConfig, {**GOOD_CACHE, "layers": [2, 3]}, "CacheConfig.layers"),
    "layers miscounted": (CacheConfig, {**GOOD_CACHE, "layers": [L, L, L]}, "CacheConfig.layers"),
    "layers empty": (CacheConfig, {**GOOD_CACHE, "layers": []}, "CacheConfig.layers"),
    "kv_dtype int8": (CacheConfig, {**GOOD_CACHE, "kv_dtype": "int8"}, "CacheConfig.kv_dtype"),
    "kv_dtype an mlx dtype": (CacheConfig, {**GOOD_CACHE, "kv_dtype": mx.float16}, "CacheConfig.kv_dtype"),
    "kv_dtype None": (CacheConfig, {**GOOD_CACHE, "kv_dtype": None}, "CacheConfig.kv_dtype"),
    "initial_capacity negative": (CacheConfig, {**GOOD_CACHE, "initial_capacity": -1}, "CacheConfig.initial_capacity"),
    "max_write zero": (CacheConfig, {**GOOD_CACHE, "max_write": 0}, "CacheConfig.max_write"),
    "max_write a float": (CacheConfig, {**GOOD_CACHE, "max_write": 2.5}, "CacheConfig.max_write"),
    "max_seqs zero": (CacheConfig, {**GOOD_CACHE, "max_seqs": 0}, "CacheConfig.max_seqs"),
    "max_seqs a numpy float": (CacheConfig, {**GOOD_CACHE, "max_seqs": np.float64(4)}, "CacheConfig.max_seqs"),
    "from_mapping unknown key": (CacheConfig.from_mapping, dict(data={**GOOD_CACHE, "capacty": 8}), "capacty"),
    "from_mapping missing key": (
        CacheConfig.from_mapping,
        dict(data={"capacity": 8, "layers": [{"n_kv_heads": 1, "head_dim": 2}]}),
        "n_layers",
    ),
    "from_mapping of a list": (CacheConfig.from_mapping, dict(data=[("capacity", 8)]), "CacheConfig"),
    "from_mapping of None": (CacheConfig.from_mapping, dict(data=None), "CacheConfig"),
    "layer missing head_dim": (
        CacheConfig.from_mapping,
        dict(data={**GOOD_CACHE, "layers": [{"n_kv_heads": 1}]}),
        "head_dim",
    ),
    "layer(i) out of range": (CacheConfig(**GOOD_CACHE).layer, dict(i=2), "layer index=2"),
    "layer(i) negative": (CacheConfig(**GOOD_CACHE).layer, dict(i=-1), "layer index=-1"),
    "layer(i) a float": (CacheConfig(**GOOD_CACHE).layer, dict(i=0.0), "layer index=0.0"),
}


@pytest.mark.parametrize("make, kwargs, name", CONFIG.values(), ids=CONFIG.keys())
def test_a_bad_config_value_is_refused_naming_the_field(make, kwargs, name):
    raises_naming(ConfigError, name, lambda: make(**kwargs))


# -- MLXPool -----------------------------------------------------------------


def _f32(n, heads=H, dim=D, dtype=mx.float32):
    return mx.ones((1, heads, n, dim), dtype=dtype)


POOL = {
    "write: start negative": ("write", (-1, _f32(1)), "start=-1"),
    "write: start a float": ("write", (1.0, _f32(1)), "start=1.0"),
    "write: start a string": ("write", ("1", _f32(1)), "start='1'"),
    "write: start None": ("write", (None, _f32(1)), "start=None"),
    "write: start a bool": ("write", (True, _f32(1)), "start=True"),
    "write: start 2**62": ("write", (2**62, _f32(1)), f"start={2**62}"),
    "write: start 2**70": ("write", (2**70, _f32(1)), f"start={2**70}"),
    "write: start NaN": ("write", (math.nan, _f32(1)), "start=nan"),
    "write: past max_slots": ("write", (15, _f32(2)), "start=15"),
    "write: int update": ("write", (0, mx.ones((1, H, 1, D), dtype=mx.int32)), "update"),
    "write: bool update": ("write", (0, mx.ones((1, H, 1, D), dtype=mx.bool_)), "update"),
    "write: complex update": ("write", (0, mx.ones((1, H, 1, D), dtype=mx.complex64)), "update"),
    "write: numpy update": ("write", (0, np.ones((1, H, 1, D), np.float32)), "update"),
    "write: None update": ("write", (0, None), "update"),
    "write: 3-d update": ("write", (0, mx.ones((H, 1, D))), "update"),
    "write: wrong heads": ("write", (0, _f32(1, heads=H + 1)), "update"),
    "write: wrong head_dim": ("write", (0, _f32(1, dim=D + 1)), "update"),
    "write: batch of 2": ("write", (0, mx.ones((2, H, 1, D))), "update"),
    "write_cells: float cells": ("write_cells", ([0.0], _f32(1)), "cells"),
    "write_cells: NaN cells": ("write_cells", (np.array([np.nan]), _f32(1)), "cells"),
    "write_cells: inf cells": ("write_cells", ([math.inf], _f32(1)), "cells"),
    "write_cells: bool cells": ("write_cells", ([True], _f32(1)), "cells"),
    "write_cells: negative cell": ("write_cells", ([-1], _f32(1)), "cells"),
    "write_cells: cell 2**62": ("write_cells", ([2**62], _f32(1)), "cells"),
    "write_cells: cell 2**63": ("write_cells", ([2**63], _f32(1)), "cells"),
    "write_cells: cell 2**70": ("write_cells", ([2**70], _f32(1)), "cells"),
    "write_cells: cell past max": ("write_cells", ([16], _f32(1)), "cells"),
    "write_cells: repeated cell": ("write_cells", ([3, 3], _f32(2)), "cells"),
    "write_cells: miscounted": ("write_cells", ([3, 4], _f32(1)), "cells"),
    "write_cells: 2-d cells": ("write_cells", ([[3]], _f32(1)), "cells"),
    "write_cells: a string": ("write_cells", ("3", _f32(1)), "cells"),
    "write_cells: None cells": ("write_cells", (None, _f32(1)), "cells"),
    "write_cells: mlx float cells": ("write_cells", (mx.array([1.5]), _f32(1)), "cells"),
    "write_cells: int update": ("write_cells", ([3], mx.ones((1, H, 1, D), dtype=mx.int32)), "update"),
    "write_cells: wrong heads": ("write_cells", ([3], _f32(1, heads=1)), "update"),
    "write_cells: empty cells, one token": ("write_cells", ([], _f32(1)), "cells"),
    "read: start negative": ("read", (-1, 1), "start=-1"),
    "read: length negative": ("read", (0, -1), "length=-1"),
    "read: start a float": ("read", (0.5, 1), "start=0.5"),
    "read: length None": ("read", (0, None), "length=None"),
    "read: length a string": ("read", (0, "2"), "length='2'"),
    "read: past the allocated slots": ("read", (7, 2), "start=7"),
    "read: length 2**70": ("read", (0, 2**70), f"{2**70}"),
    "read: start NaN": ("read", (math.nan, 1), "start=nan"),
}


def pool_state(pool: MLXPool) -> dict:
    data = pool.read(0, pool.slots)
    return dict(slots=pool.slots, max_slots=pool.max_slots, dtype=pool.dtype, bits=np.array(data.view(mx.uint16)))


@pytest.mark.parametrize("method, args, name", POOL.values(), ids=POOL.keys())
def test_a_bad_pool_call_is_refused_naming_the_argument_and_leaves_the_pool_as_it_was(method, args, name):
    pool = MLXPool(8, 16, H, D, "float16")
    pool.write(0, mx.array(np.random.default_rng(0).normal(size=(1, H, 8, D)).astype(np.float16)))
    before = pool_state(pool)
    raises_naming(KVLayoutError, name, lambda: getattr(pool, method)(*args))
    after = pool_state(pool)
    kept = ("slots", "max_slots", "dtype")
    assert {k: before[k] for k in kept} == {k: after[k] for k in kept}
    np.testing.assert_array_equal(before["bits"], after["bits"])


POOL_NEW = {
    "max_slots zero": ((0, 0, H, D), "max_slots=0"),
    "max_slots a float": ((0, 4.0, H, D), "max_slots=4.0"),
    "initial_slots negative": ((-1, 4, H, D), "initial_slots=-1"),
    "n_heads None": ((0, 4, None, D), "n_heads=None"),
    "head_dim a string": ((0, 4, H, "3"), "head_dim='3'"),
    "dtype int32": ((0, 4, H, D, "int32"), "dtype 'int32'"),
    "dtype an mlx int": ((0, 4, H, D, mx.int32), "dtype"),
}


@pytest.mark.parametrize("args, name", POOL_NEW.values(), ids=POOL_NEW.keys())
def test_a_bad_pool_construction_is_refused_naming_the_argument(args, name):
    raises_naming(KVLayoutError, name, lambda: MLXPool(*args))


# -- registry ----------------------------------------------------------------

GOOD_CONFIG = CacheConfig(capacity=8, n_layers=1, layers=[L], kv_dtype="float32")

REGISTRY = {
    "resolve: unknown kind": (resolve, ("mlx", "paged"), LayoutNotFound, "mlx:paged"),
    "resolve: backend None": (resolve, (None, "cell"), ConfigError, "backend_id"),
    "resolve: backend an int": (resolve, (3, "cell"), ConfigError, "backend_id"),
    "resolve: kind empty": (resolve, ("mlx", ""), ConfigError, "kind"),
    "resolve: kind a list": (resolve, ("mlx", ["cell"]), ConfigError, "kind"),
    "resolve: key in one string": (resolve, ("mlx:cell", "cell"), LayoutNotFound, "mlx:cell:cell"),
    "build: unknown layout": (build, ("mlx", "paged", GOOD_CONFIG), LayoutNotFound, "mlx:paged"),
    "build: cell config None": (build, ("mlx", "cell", None), ConfigError, "config"),
    "build: cell config a string": (build, ("mlx", "cell", "capacity=8"), ConfigError, "config"),
    "build: cell config a bad mapping": (build, ("mlx", "cell", {"capacity": 8}), ConfigError, "n_layers"),
    "build: seq config None": (build, ("mlx", "seq", None), ConfigError, "config"),
    "build: seq config a bad mapping": (
        build,
        ("mlx", "seq", {"capacity": -8, "n_layers": 1, "layers": [{"n_kv_heads": 1, "head_dim": 2}]}),
        ConfigError,
        "capacity",
    ),
}


@pytest.mark.parametrize("call, args, error, name", REGISTRY.values(), ids=REGISTRY.keys())
def test_a_bad_registry_call_is_refused_naming_the_argument(call, args, error, name):
    pm = make_plugin_manager()
    before = [(b.key, b.distribution) for b in available(pm)]
    raises_naming(error, name, lambda: call(*args, pm=pm))
    assert [(b.key, b.distribution) for b in available(pm)] == before


# -- runner config -----------------------------------------------------------


def _run(**sections):
    data = {"model": {"preset": "tiny"}, "requests": [{"prompt": "hi", "max_tokens": 4}]}
    data.update(sections)
    return data


RUNNER = {
    "top level None": (None, "config"),
    "top level a list": ([], "config"),
    "layout a string": (_run(layout="mlx:cell"), "layout"),
    "layout.kind an int": (_run(layout={"kind": 3}), "layout.kind"),
    "layout.backend empty": (_run(layout={"backend": ""}), "layout.backend"),
    "cache.capacity a string": (_run(cache={"capacity": "2048"}), "cache.capacity"),
    "cache.capacity a float": (_run(cache={"capacity": 2048.0}), "cache.capacity"),
    "cache.capacity negative": (_run(cache={"capacity": -1}), "cache.capacity"),
    "cache.capacity inf": (_run(cache={"capacity": math.inf}), "cache.capacity"),
    "cache.max_seqs None": (_run(cache={"max_seqs": None}), "cache.max_seqs"),
    "cache.max_write zero": (_run(cache={"max_write": 0}), "cache.max_write"),
    "cache.kv_dtype int8": (_run(cache={"kv_dtype": "int8"}), "cache.kv_dtype"),
    "cache.kv_dtype a list": (_run(cache={"kv_dtype": ["float16"]}), "cache.kv_dtype"),
    "model both path and preset": (_run(model={"preset": "tiny", "path": "x"}), "model.path"),
    "model.preset an int": (_run(model={"preset": 1}), "model.preset"),
    "model.dtype int8": (_run(model={"preset": "tiny", "dtype": "int8"}), "model.dtype"),
    "model.seed negative": (_run(model={"preset": "tiny", "seed": -1}), "model.seed"),
    "sampling.temperature a string": (_run(sampling={"temperature": "hot"}), "sampling.temperature"),
    "sampling.temperature negative": (_run(sampling={"temperature": -0.5}), "sampling.temperature"),
    "sampling.temperature NaN": (_run(sampling={"temperature": math.nan}), "sampling.temperature"),
    "sampling.temperature inf": (_run(sampling={"temperature": math.inf}), "sampling.temperature"),
    "sampling.temperature past float range": (_run(sampling={"temperature": 10**400}), "sampling.temperature"),
    "sampling.top_p NaN": (_run(sampling={"top_p": math.nan}), "sampling.top_p"),
    "sampling.top_p zero": (_run(sampling={"top_p": 0}), "sampling.top_p"),
    "sampling.top_p a bool": (_run(sampling={"top_p": True}), "sampling.top_p"),
    "sampling.seed a float": (_run(sampling={"seed": 1.0}), "sampling.seed"),
    "engine.prefill_chunk zero": (_run(engine={"prefill_chunk": 0}), "engine.prefill_chunk"),
    "engine None": (_run(engine=None), "engine"),
    "requests a table": (_run(requests={"prompt": "hi"}), "requests"),
    "requests empty": (_run(requests=[]), "requests"),
    "request None": (_run(requests=[None]), "requests[0]"),
    "request prompt empty": (_run(requests=[{"prompt": ""}]), "requests[0].prompt"),
    "request prompt an int": (_run(requests=[{"prompt": 5}]), "requests[0].prompt"),
    "request prompt_ids a string": (_run(requests=[{"prompt_ids": "123"}]), "requests[0].prompt_ids"),
    "request prompt_ids floats": (_run(requests=[{"prompt_ids": [1.0]}]), "requests[0].prompt_ids"),
    "request prompt_ids negative": (_run(requests=[{"prompt_ids": [-1]}]), "requests[0].prompt_ids"),
    "request prompt_ids empty": (_run(requests=[{"prompt_ids": []}]), "requests[0].prompt_ids"),
    "request max_tokens zero": (_run(requests=[{"prompt": "hi", "max_tokens": 0}]), "requests[0].max_tokens"),
    "request n a string": (_run(requests=[{"prompt": "hi", "n": "2"}]), "requests[0].n"),
}


@pytest.mark.parametrize("data, name", RUNNER.values(), ids=RUNNER.keys())
def test_a_bad_runner_mapping_is_refused_naming_the_dotted_key(data, name):
    raises_naming(ConfigError, name, lambda: RunConfig.from_mapping(data, source="x.toml"))


TOML = {
    "not TOML": ("[cache\ncapacity = 1", "x.toml"),
    "a string capacity": (
        '[cache]\ncapacity = "big"\n[model]\npreset = "tiny"\n[[requests]]\nprompt = "hi"\n',
        "cache.capacity",
    ),
    "a float capacity": (
        '[cache]\ncapacity = 1e3\n[model]\npreset = "tiny"\n[[requests]]\nprompt = "hi"\n',
        "cache.capacity",
    ),
    "a nan temperature": (
        '[sampling]\ntemperature = nan\n[model]\npreset = "tiny"\n[[requests]]\nprompt = "hi"\n',
        "sampling.temperature",
    ),
    "an inf temperature": (
        '[sampling]\ntemperature = inf\n[model]\npreset = "tiny"\n[[requests]]\nprompt = "hi"\n',
        "sampling.temperature",
    ),
    "requests as a table": ('[model]\npreset = "tiny"\n[requests]\nprompt = "hi"\n', "requests"),
    "a huge prompt id": (
        '[model]\npreset = "tiny"\n[[requests]]\nprompt_ids = [1, -9223372036854775808]\n',
        "requests[0].prompt_ids",
    ),
}


@pytest.mark.parametrize("text, name", TOML.values(), ids=TOML.keys())
def test_a_bad_toml_file_is_refused_naming_the_key(tmp_path, text, name):
    path = tmp_path / "x.toml"
    path.write_text(text)
    raises_naming(ConfigError, name, lambda: load_config(path))


@pytest.mark.parametrize("path", [5, 1.5, ["x.toml"], b"\xff.toml"], ids=["int", "float", "list", "undecodable bytes"])
def test_a_config_path_that_is_not_a_path_is_refused_by_name(path):
    raises_naming(ConfigError, "path", lambda: load_config(path))


def test_a_missing_config_file_is_refused_naming_it(tmp_path):
    raises_naming(ConfigError, "nothere.toml", lambda: load_config(tmp_path / "nothere.toml"))


# -- sizes: what is allocated up front, against the machine ------------------------------------


def test_machine_memory_is_the_physical_memory_the_os_reports():
    assert machine_memory() == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("n, shown", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (8 * 10**12, "7.28 TiB"),
                                      (455 * 2**50, "455 PiB"), (10**24, "8.882e+08 PiB")])
def test_bytes_are_shown_in_binary_units(n, shown):
    assert show_bytes(n) == shown


def test_a_pool_past_what_an_mlx_array_can_index_is_refused_naming_max_slots():
    raises_naming(ConfigError, f"max_slots={2**31}", lambda: MLXPool(0, 2**31, H, D))
    raises_naming(ConfigError, f"n_heads={2**31}", lambda: MLXPool(0, 4, 2**31, D))  # was OverflowError
    raises_naming(ConfigError, f"head_dim={2**40}", lambda: MLXPool(0, 4, H, 2**40))
    assert MLXPool(0, MAX_SLOTS, H, D).max_slots == MAX_SLOTS  # lazily allocated: nothing yet


def test_a_pool_whose_initial_slots_exceed_the_machine_is_refused_stating_its_bytes(monkeypatch):
    import kvlayout.config

    need = 100 * H * D * 4  # float32
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: need)
    assert MLXPool(100, 200, H, D, "float32").nbytes == need
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: need - 1)
    error = raises_naming(ConfigError, "initial_slots=100", lambda: MLXPool(100, 200, H, D, "float32"))
    assert f"({need} bytes) up front" in str(error)


@pytest.mark.parametrize("layout", ["mlx:cell", "mlx:seq"])
@pytest.mark.parametrize("sizes", ["capacity = 1000000000000", "capacity = 9223372036854775807",
                                   "capacity = 4096\nmax_seqs = 1000000000000000"])
def test_kvlayout_run_refuses_a_cache_larger_than_the_machine_in_one_line(tmp_path, capsys, layout, sizes):
    from kvlayout.cli import main

    path = tmp_path / "run.toml"
    path.write_text(f'[cache]\n{sizes}\n[model]\npreset = "tiny"\n[[requests]]\nprompt = "hi"\nmax_tokens = 2\n')
    code = main(["run", str(path), "--layout", layout])
    err = capsys.readouterr().err.strip().splitlines()
    if layout == "mlx:seq" and "max_seqs" in sizes:  # one sequence at a time: max_seqs holds nothing
        assert code == 0
        return
    assert code == 2 and len(err) == 1 and err[0].startswith("kvlayout: error:"), err
    assert "capacity=" in err[0] and re.search(r"\d (TiB|PiB|GiB)", err[0]), err[0]


# -- saving and loading: the path ----------------------------------------------------------------

SMALL = CacheConfig(capacity=8, n_layers=2, layers=[L], kv_dtype="float32")

PATHS = {  # (path under tmp_path, or a value; what the message says)
    "None": (None, "path=None: expected a file path"),
    "an int": (5, "path=5: expected a file path"),
    "a float": (1.5, "path=1.5: expected a file path"),
    "a list": (["x.kv"], r"path=\['x.kv'\]: expected a file path"),
    "bytes": (b"x.kv", "path=b'x.kv': expected a file path"),
    "empty": ("", "path='': expected a file path"),
    "a directory": ("adir", "is a directory"),
    "the current directory": (".", "path='.': is a directory"),
}
WRITE_ONLY = {  # a file can be read from neither, but these say more when writing
    "in a missing directory": ("nodir/x.kv", "its directory .*nodir' does not exist"),
    "under a file": ("afile/x.kv", "its directory .*afile' does not exist"),
}


def at(tmp_path, path):
    (tmp_path / "adir").mkdir(exist_ok=True)
    (tmp_path / "afile").write_bytes(b"x")
    return tmp_path / path if isinstance(path, str) and path not in ("", ".") else path


def files(tmp_path):
    return sorted(p.name for p in tmp_path.rglob("*"))


def saved_caches():
    cell, seq = build("mlx", "cell", SMALL), build("mlx", "seq", SMALL)
    s = cell.as_batch_control().seq_new()
    assert cell.as_batch_control().declare_step([s])
    for layer in range(2):
        cell.update_and_fetch(layer, [0], mx.ones((1, H, 1, D)), mx.ones((1, H, 1, D)))
        seq.update_and_fetch(layer, [0], mx.ones((1, H, 1, D)), mx.ones((1, H, 1, D)))
    return {"cell save": cell.save, "cell save_seq": lambda p: cell.save_seq(s, p), "seq save": seq.save}


@pytest.mark.parametrize("path, message", [*PATHS.values(), *WRITE_ONLY.values()], ids=[*PATHS, *WRITE_ONLY])
@pytest.mark.parametrize("save", ["cell save", "cell save_seq", "seq save"])
def test_a_save_to_something_that_is_no_file_path_is_refused_naming_it_and_writes_nothing(
    tmp_path, save, path, message
):
    # Was: TypeError (None), IsADirectoryError, FileNotFoundError, OSError from os.replace ('').
    path = at(tmp_path, path)
    before = files(tmp_path)
    with pytest.raises(StateError, match=message):
        saved_caches()[save](path)
    assert files(tmp_path) == before


@pytest.mark.parametrize("path, message", PATHS.values(), ids=PATHS.keys())
@pytest.mark.parametrize("load", ["kvlayout.load", "load_seq"])
def test_a_load_from_something_that_is_no_file_path_is_refused_naming_it(tmp_path, load, path, message):
    import kvlayout

    cell = build("mlx", "cell", SMALL)
    call = kvlayout.load if load == "kvlayout.load" else cell.load_seq
    with pytest.raises(StateError, match=message):
        call(at(tmp_path, path))
    control = cell.as_batch_control()
    assert (control.free_cells, control.used_end, cell.groups.primary.table.live_ids().tolist()) == (8, 0, [])


def test_a_write_the_os_refuses_is_a_state_error_naming_the_path_and_keeps_the_previous_file(tmp_path, monkeypatch):
    import errno

    from kvlayout import persist

    path = tmp_path / "c.kv"
    saves = saved_caches()
    saves["cell save"](path)
    before = path.read_bytes()

    def full(f, chunk):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist, "_write_chunk", full)
    with pytest.raises(StateError, match=r"path='.*c.kv': cannot write the state file \(No space left on device\)"):
        saves["seq save"](path)
    assert path.read_bytes() == before and files(tmp_path) == ["c.kv"]


@pytest.mark.parametrize("config", [{"capacity": 8}, "capacity=8", 8], ids=["a bad mapping", "a string", "an int"])
def test_load_with_a_config_that_is_not_one_is_refused_naming_it(tmp_path, config):
    import kvlayout

    saved_caches()["cell save"](tmp_path / "c.kv")
    with pytest.raises(ConfigError, match="config|n_layers"):
        kvlayout.load(tmp_path / "c.kv", config=config)
    # a mapping of it is one
    assert kvlayout.load(tmp_path / "c.kv", config=SMALL.to_mapping()).as_batch_control().capacity == 8


# -- attend ----------------------------------------------------------------------------------


def layout_spec(layout: str, T: int):
    """What layer 0 of a real step of T tokens hands attend(): [1, H, S, D] keys, queries=T."""
    cache = build(*layout.split(":"), SMALL)
    if layout == "mlx:cell":
        s = cache.as_batch_control().seq_new()
        assert cache.as_batch_control().declare_step([s] * T)
    return cache.update_and_fetch(0, list(range(T)), mx.ones((1, H, T, D)), mx.ones((1, H, T, D)))


def _q(T, heads=2 * H, dim=D, dtype=mx.float32):
    return mx.ones((1, heads, T, dim), dtype=dtype)


ATTEND = {  # (q, spec as (layout, T), scale, what the message names)
    "q None": (None, ("mlx:seq", 1), 0.5, "q: expected a floating mlx array"),
    "q numpy": (np.ones((1, 2 * H, 1, D), np.float32), ("mlx:seq", 1), 0.5, "q: expected .* got ndarray"),
    "q 3-d": (mx.ones((2 * H, 1, D)), ("mlx:seq", 1), 0.5, r"q: expected .* got array \(4, 1, 3\)"),
    "q int32": (_q(1, dtype=mx.int32), ("mlx:seq", 1), 0.5, "q: expected a floating .*int32"),
    "q batch of 2": (mx.ones((2, 2 * H, 1, D)), ("mlx:seq", 1), 0.5, r"q of shape \(2, 4, 1, 3\)"),
    "q head_dim differs": (_q(1, dim=D + 1), ("mlx:seq", 1), 0.5, r"q of shape \(1, 4, 1, 4\).*\b3\]"),
    "q heads not a multiple": (_q(1, heads=3), ("mlx:cell", 1), 0.5, "a multiple of H_kv=2"),
    "q fewer heads than keys": (_q(1, heads=1), ("mlx:cell", 1), 0.5, "a multiple of H_kv=2"),
    # MLX broadcast these and answered: T rows for a step of another length.
    "q T=5, a seq step of 1 (NONE)": (_q(5), ("mlx:seq", 1), 0.5, "T=5 queries for a step of 1 token"),
    "q T=1, a seq step of 3 (CAUSAL)": (_q(1), ("mlx:seq", 3), 0.5, "T=1 queries for a step of 3 token"),
    "q T=5, a cell step of 1 (EXPLICIT)": (_q(5), ("mlx:cell", 1), 0.5, "T=5 queries for a step of 1 token"),
    "q T=1, a cell step of 2 (EXPLICIT)": (_q(1), ("mlx:cell", 2), 0.5, "T=1 queries for a step of 2 token"),
    "spec None": (_q(1), None, 0.5, "spec: expected an AttendSpec"),
    "spec a dict": (_q(1), {"keys": 1}, 0.5, "spec: expected an AttendSpec"),
    "scale None": (_q(1), ("mlx:seq", 1), None, "scale=None"),
    "scale a string": (_q(1), ("mlx:seq", 1), "0.5", "scale='0.5'"),
    "scale NaN": (_q(1), ("mlx:seq", 1), math.nan, "scale=nan"),
    "scale inf": (_q(1), ("mlx:seq", 1), math.inf, "scale=inf"),
    "scale a bool": (_q(1), ("mlx:seq", 1), True, "scale=True"),
}


@pytest.mark.parametrize("q, spec, scale, message", ATTEND.values(), ids=ATTEND.keys())
def test_a_bad_attend_call_is_refused_naming_the_argument(q, spec, scale, message):
    from kvlayout.errors import StepError
    from kvlayout.mlx import attend

    if isinstance(spec, tuple):
        spec = layout_spec(*spec)
    with pytest.raises(StepError, match=message):
        attend(q, spec, scale)


def test_a_causal_spec_with_no_stated_length_still_refuses_more_queries_than_keys():
    from kvlayout.errors import StepError
    from kvlayout.mlx import attend

    spec = AttendSpec(mx.ones((1, H, 3, D)), mx.ones((1, H, 3, D)), MaskKind.CAUSAL)  # a third party's spec
    assert attend(_q(3), spec, 0.5).shape == (1, 2 * H, 3, D)
    with pytest.raises(StepError, match="T=4 queries, more than the 3 keys"):
        attend(_q(4), spec, 0.5)
