"""Saving and restoring the cell layout: a whole cache, or one sequence (a llama.cpp slot).

A whole cache (`content = "cache"`) keeps only the occupied cells, gathered:

- tensors `cells` (I64 [n], ascending), `pos` (I64 [n]), `owners` (U64
  [n, words], the owner bitset) and, per layer i, `k.i` / `v.i`
  `[1, H_kv, n, D]` in the storage dtype (quantized K/V as their triples'
  parts, `k.i.packed` ..., bit for bit: `kvlayout.mlx.tensors`);
- state `{"state_version": 1, "live": [ids]}`.

It comes back at the same cell indices, so the restored table is the saved
one: same ids, free list, `used_end`, and the next placement lands where it
would have. Free cells come back zeroed (their old content was dead).

One sequence (`content = "sequence"`) keeps `pos` (I64 [n], ascending) and
`k.i` / `v.i` of its cells; `load_seq` gives it a fresh id and fresh cells
(chosen by the `kvlayout_choose_cells` hook) in any cache whose per-layer
shapes, policies and storage dtype match (capacity and max_seqs may differ).

Saving refuses (StepError) while a forward is half done: a placed step that
not every layer has served would save K/V some layers never wrote.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.checks import int_array
from kvlayout.errors import StateError, StepError
from kvlayout.mlx.tensors import kv_tensors, read_kv
from kvlayout.persist import StateFile, numpy_of, raw_numpy, read_state, save_state, state_path

LAYOUT = "mlx:cell"
STATE_VERSION = 1


def _check_not_mid_forward(cache: Any) -> None:
    missing = cache.stepper.unserved_layers()
    if missing:
        raise StepError(
            f"save during a forward: layer(s) {missing} of the placed step were not served; "
            "finish the forward or abort_step() first"
        )


def _gather(cache: Any, cells: np.ndarray) -> dict:
    """`k.i` / `v.i`: each layer's K and V at `cells`, `[1, H_kv, n, D]`."""
    out = {}
    idx = mx.array(cells.astype(np.int32))
    for i in range(cache.n_layers):
        for name, pool in (("k", cache.key_pools[i]), ("v", cache.value_pools[i])):
            part = pool.take(idx) if cells.size else pool.read(0, 0)  # [1, H_kv, n, D] (or its triple)
            out.update(kv_tensors(f"{name}.{i}", part))
    return out


def save_cache(cache: Any, path: str | os.PathLike) -> Path:
    _check_not_mid_forward(cache)
    path = state_path(path, writing=True)  # before gathering anything
    table = cache.stepper.table
    cells, pos, owners = table.occupied()
    tensors = {"cells": raw_numpy(cells), "pos": raw_numpy(pos), "owners": raw_numpy(owners)}
    tensors.update(_gather(cache, cells))
    state = {"state_version": STATE_VERSION, "live": [int(s) for s in table.live_ids()]}
    return save_state(path, layout=LAYOUT, content="cache", config=cache.config, state=state, tensors=tensors)


def save_seq(cache: Any, seq_id: int, path: str | os.PathLike) -> Path:
    cells, pos = cache.stepper.table.seq_cells(seq_id)  # SequenceError for an id not live
    _check_not_mid_forward(cache)
    path = state_path(path, writing=True)
    tensors = {"pos": raw_numpy(pos)}
    tensors.update(_gather(cache, cells))
    state = {"state_version": STATE_VERSION}
    return save_state(path, layout=LAYOUT, content="sequence", config=cache.config, state=state, tensors=tensors)


def _check_state(f: StateFile, content: str) -> None:
    if f.layout != LAYOUT:
        raise f.refuse(f"saved by layout {f.layout}, expected {LAYOUT}")
    if f.content != content:
        raise f.refuse(f"holds a {f.content}, expected a {content}")
    version = f.state.get("state_version")
    if version != STATE_VERSION:
        raise f.refuse(f"cell-layout state version {version!r}; this kvlayout-cell reads version {STATE_VERSION}")


def _scatter(cache: Any, cells: np.ndarray, layers: list[tuple[mx.array, mx.array]]) -> None:
    """Write each layer's saved K and V (`read_kv`) into `cells`; nothing for no cell."""
    if not cells.size:
        return
    for i, (k, v) in enumerate(layers):
        cache.key_pools[i].write_cells(cells, k)
        cache.value_pools[i].write_cells(cells, v)


def saved_config(f: StateFile) -> Any:
    """The CacheConfig of a whole cache `save_cache` wrote: what to build before `restore_cache`."""
    _check_state(f, "cache")
    return f.cache_config()


def restore_cache(cache: Any, f: StateFile) -> None:
    """Make `cache`, just built from `saved_config(f)`, the cache `save_cache` wrote to `f`; StateError
    for a file whose contents do not fit (nothing restored: the cache stays as built)."""
    config = cache.config
    cells = numpy_of(f.tensor("cells", "I64", (None,)))
    n = cells.size
    pos = numpy_of(f.tensor("pos", "I64", (n,)))
    owners = numpy_of(f.tensor("owners", "U64", (n, cache.stepper.table.owner_words)))
    live = int_array("state.live", f.state.get("live"), f.refuse)  # the live ids
    layers = read_kv(f, config, [n] * config.n_layers)
    cache.stepper.restore(cells, pos, owners, live, StateError)
    _scatter(cache, cells, layers)


def _compatible(f: StateFile, saved: Any, config: Any) -> None:
    """One sequence moves between caches whose layers and storage dtype agree."""
    why = []
    if saved.n_layers != config.n_layers:
        why.append(f"n_layers {saved.n_layers} vs {config.n_layers}")
    else:
        for i in range(config.n_layers):
            if saved.layer(i) != config.layer(i):
                why.append(f"layer {i}: {saved.layer(i).to_mapping()} vs {config.layer(i).to_mapping()}")
    if saved.kv_dtype != config.kv_dtype:
        why.append(f"kv_dtype {saved.kv_dtype!r} vs {config.kv_dtype!r}")
    elif saved.kv_group_size != config.kv_group_size:
        why.append(f"kv_group_size {saved.kv_group_size} vs {config.kv_group_size}")
    if why:
        raise f.refuse(f"saved from a cache this one cannot take (saved vs this: {'; '.join(why)})")


def load_seq(cache: Any, path: str | os.PathLike) -> int | None:
    f = read_state(path)
    _check_state(f, "sequence")
    _compatible(f, f.cache_config(), cache.config)
    pos = numpy_of(f.tensor("pos", "I64", (None,)))
    n = pos.size
    if n and (pos.min() < 0 or (np.diff(pos) <= 0).any()):
        raise f.refuse("pos: expected ascending distinct positions >= 0")
    layers = read_kv(f, cache.config, [n] * cache.config.n_layers)
    # Placed as a step would be: through the placement hook, announced to observers. Pressure is an
    # answer: not enough free cells or no free id gives None, nothing changed.
    placed = cache.stepper.place_sequence(pos)
    if placed is None:
        return None
    seq_id, cells = placed
    _scatter(cache, cells, layers)
    return seq_id
