"""The state file: safetensors with checked metadata, written atomically, refused whole when damaged."""

from __future__ import annotations

import json
import os
import struct

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvlayout
from kvlayout import CacheConfig, LayerConfig, StateError, persist
from kvlayout.mlx.tensors import from_raw, to_raw
from kvlayout.registry import make_plugin_manager

CONFIG = CacheConfig(capacity=16, n_layers=1, layers=[LayerConfig(2, 4)], kv_dtype="float32")


def tensors() -> dict:
    rng = np.random.default_rng(0)
    return {
        "k.0": persist.raw_numpy(rng.normal(size=(1, 2, 3, 4)).astype(np.float32)),
        "half": persist.raw_numpy(rng.normal(size=(5,)).astype(np.float16)),
        "brain": to_raw(mx.array(rng.normal(size=(2, 3)).astype(np.float32)).astype(mx.bfloat16)),
        "ids": persist.raw_numpy(np.arange(4, dtype=np.int64)),
        "bits": persist.raw_numpy(np.array([[1 << 63, 5]], dtype=np.uint64)),
        "empty": persist.raw_numpy(np.zeros((1, 2, 0, 4), dtype=np.float32)),
    }


def write(path, content="cache", layout="mlx:seq", state=None, **kw):
    return persist.save_state(
        path, layout=layout, content=content, config=CONFIG, state=state or {"n": 1}, tensors=tensors(), **kw
    )


def test_a_state_file_round_trips_every_tensor_bit_for_bit_and_its_metadata(tmp_path):
    path = write(tmp_path / "s.safetensors", state={"live": [0, 3], "nested": {"a": [1, 2]}})
    f = persist.read_state(path)
    assert f.layout == "mlx:seq" and f.content == "cache"
    assert f.distribution == "kvlayout-seq" and f.version
    assert f.cache_config() == CONFIG
    assert f.state == {"live": [0, 3], "nested": {"a": [1, 2]}}
    want = tensors()
    assert set(f.tensors) == set(want)
    for name, t in want.items():
        assert (f.tensors[name].dtype, f.tensors[name].shape, bytes(f.tensors[name].data)) == (t.dtype, t.shape, t.data)
    assert mx.array_equal(from_raw(f.tensors["brain"]), from_raw(want["brain"])).item()


def test_the_file_is_plain_safetensors(tmp_path):
    from safetensors import safe_open

    path = write(tmp_path / "s.safetensors")
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["kvlayout"])
        np.testing.assert_array_equal(f.get_tensor("ids"), np.arange(4))
    assert meta["format"] == persist.FORMAT_VERSION and meta["layout"] == "mlx:seq"
    arrays = mx.load(str(path))
    assert arrays["brain"].dtype == mx.bfloat16


def test_a_file_cut_anywhere_is_refused(tmp_path):
    path = write(tmp_path / "s.safetensors")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    rng = np.random.default_rng(1)
    points = sorted({0, 1, 7, 8, 9, len(data) - 1, *rng.integers(0, len(data), 200).tolist()})
    for n in points:
        cut.write_bytes(data[:n])
        with pytest.raises(StateError, match="truncated|corrupted|not a kvlayout"):
            persist.read_state(cut)


def test_a_flipped_byte_anywhere_is_refused(tmp_path):
    path = write(tmp_path / "s.safetensors")
    data = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    rng = np.random.default_rng(2)
    for i in range(len(data)):  # every byte, header and tensors
        flipped = bytearray(data)
        flipped[i] ^= int(rng.integers(1, 256))
        bad.write_bytes(bytes(flipped))
        with pytest.raises(StateError):
            persist.read_state(bad)


def test_a_file_of_another_format_version_is_refused_by_version(tmp_path):
    meta = {"layout": "mlx:seq", "content": "cache", "config": CONFIG.to_mapping(), "state": {}}
    chunks = persist.encode(meta, {})
    header = json.loads(chunks[0][8:])
    inner = json.loads(header["__metadata__"]["kvlayout"])
    inner["format"] = persist.FORMAT_VERSION + 1
    header["__metadata__"]["kvlayout"] = json.dumps(inner)
    head = json.dumps(header).encode()
    (tmp_path / "v2.safetensors").write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(StateError, match="format version 2; this kvlayout reads version 1"):
        persist.read_state(tmp_path / "v2.safetensors")


def test_a_missing_file_and_a_foreign_safetensors_file_are_refused(tmp_path):
    with pytest.raises(StateError, match="no such state file"):
        persist.read_state(tmp_path / "nothing.safetensors")
    mx.save_safetensors(str(tmp_path / "plain.safetensors"), {"w": mx.zeros((2,))})
    with pytest.raises(StateError, match="not a kvlayout state file"):
        persist.read_state(tmp_path / "plain.safetensors")


class Crash(Exception):
    pass


def test_a_crash_mid_save_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = write(tmp_path / "s.safetensors", state={"generation": 1})
    before = path.read_bytes()
    written = []

    def half_then_crash(f, chunk):
        f.write(bytes(chunk)[: max(1, len(chunk) // 2)])
        written.append(len(chunk))
        raise Crash("disk on fire")

    monkeypatch.setattr(persist, "_write_chunk", half_then_crash)
    with pytest.raises(Crash):
        write(path, state={"generation": 2})
    assert written  # it did start writing
    assert path.read_bytes() == before
    assert persist.read_state(path).state == {"generation": 1}
    assert os.listdir(tmp_path) == ["s.safetensors"]  # no temporary file left behind


def test_an_interrupt_mid_save_leaves_the_previous_file_intact(tmp_path, monkeypatch):
    path = write(tmp_path / "s.safetensors")
    before = path.read_bytes()
    calls = iter(range(100))

    def interrupt_on_second(f, chunk):
        if next(calls) == 1:
            raise KeyboardInterrupt
        f.write(chunk)

    monkeypatch.setattr(persist, "_write_chunk", interrupt_on_second)
    with pytest.raises(KeyboardInterrupt):
        write(path, state={"other": 1})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.safetensors"]


# -- kvlayout.load: finding the layout, refusing what does not match ----------------------


def test_load_refuses_a_sequence_file(tmp_path):
    path = write(tmp_path / "s.safetensors", content="sequence", layout="mlx:cell")
    with pytest.raises(StateError, match="holds one sequence"):
        kvlayout.load(path)


def test_load_refuses_a_layout_that_is_not_installed(tmp_path):
    path = write(tmp_path / "s.safetensors")
    pm = make_plugin_manager(entry_points=False)
    with pytest.raises(StateError, match="saved by layout mlx:seq, which cannot be resolved: no layout mlx:seq"):
        kvlayout.load(path, pm=pm)


def test_load_refuses_a_file_another_distribution_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(persist, "_provider", lambda layout, pm: ("someone-elses-seq", "9.9"))
    path = write(tmp_path / "s.safetensors")
    monkeypatch.undo()
    with pytest.raises(StateError, match="from someone-elses-seq 9.9, but mlx:seq is provided by kvlayout-seq"):
        kvlayout.load(path)


def test_load_refuses_a_config_other_than_the_expected_one(tmp_path):
    cache = kvlayout.build("mlx", "seq", CONFIG)
    path = cache.save(tmp_path / "s.safetensors")
    other = attrs.evolve(CONFIG, capacity=32)
    with pytest.raises(StateError, match=r"another config \(capacity: 16 vs 32\)"):
        kvlayout.load(path, config=other)
    assert kvlayout.load(path, config=CONFIG).as_control().capacity == 16


def test_load_refuses_a_layout_whose_builder_cannot_load(tmp_path):
    from kvlayout import Builder, hookimpl

    class NoLoad:
        @staticmethod
        @hookimpl
        def kvlayout_builders():
            return [Builder("mlx", "seq", build=lambda c: None)]

    pm = make_plugin_manager(entry_points=False)
    pm.register(NoLoad, name="noload")
    pm.provenance["noload"] = ("kvlayout-seq", "0")
    path = write(tmp_path / "s.safetensors")
    with pytest.raises(StateError, match="cannot restore a saved cache"):
        kvlayout.load(path, pm=pm)


def test_every_refusal_is_a_kvlayout_error():
    assert issubclass(StateError, kvlayout.KVLayoutError)


def test_both_shipped_layouts_can_load_what_they_save():
    loaders = {b.key: b.load for b in kvlayout.available()}
    assert callable(loaders["mlx:cell"]) and callable(loaders["mlx:seq"])


def test_importing_kvlayout_and_listing_layouts_loads_no_mlx():
    import subprocess
    import sys

    code = "import sys, kvlayout; kvlayout.available(); print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
