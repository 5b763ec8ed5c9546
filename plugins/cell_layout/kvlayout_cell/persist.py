"""Saving and restoring the cell layout: a whole cache, or one sequence (a llama.cpp slot).

A cache has a table of cells per layer group (`kvlayout_cell.layer_groups`:
the flat layers', then one per window, widest first); group 0's tensors have
the plain names, group g's the suffix `.g{g}`. A whole cache (`content =
"cache"`) keeps only the occupied cells, gathered:

- per group, tensors `cells` (I64 [n], ascending), `pos` (I64 [n]), `owners`
  (U64 [n, words], the owner bitset) and, per layer i, `k.i` / `v.i`
  `[1, H_kv, n, D]` (n: its group's) in the storage dtype (quantized K/V as
  their triples' parts, `k.i.packed` ..., bit for bit: `kvlayout.mlx.tensors`);
- state `{"state_version": 2, "live": [ids], "cuts": [per group, per id:
  where a window group cut the sequence, 0 for none], "pinned": [ids the
  window groups keep whole]}`. Version 1 (one table
  for every layer, nothing cut) is read too.

It comes back at the same cell indices, so the restored table is the saved
one: same ids, free list, `used_end`, and the next placement lands where it
would have. Free cells come back zeroed (their old content was dead).

One sequence (`content = "sequence"`) keeps, per group, `pos` (I64 [n],
ascending) and `k.i` / `v.i` of its cells there, and state `"cuts"` (one per
group); `load_seq` gives it a fresh id and fresh cells
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
from kvlayout.errors import StateError
from kvlayout.mlx.tensors import kv_tensors, read_kv
from kvlayout.persist import StateFile, numpy_of, raw_numpy, read_state, save_state, state_path

LAYOUT = "mlx:cell"
STATE_VERSION = 2
READS = (1, 2)  # version 1: one table for every layer


def _check_not_mid_forward(cache: Any) -> None:
    cache.groups.refuse_mid_forward("save")


def _gather(cache: Any, group: int, cells: np.ndarray) -> dict:
    """`k.i` / `v.i`: the K and V of each layer of `group` at `cells`, `[1, H_kv, n, D]`."""
    out = {}
    idx = mx.array(cells.astype(np.int32))
    for i in cache.groups.layers_of(group):
        for name, pool in (("k", cache.key_pools[i]), ("v", cache.value_pools[i])):
            part = pool.take(idx) if cells.size else pool.read(0, 0)  # [1, H_kv, n, D] (or its triple)
            out.update(kv_tensors(f"{name}.{i}", part))
    return out


def _named(group: int, name: str) -> str:
    return name if group == 0 else f"{name}.g{group}"


def _cuts(stepper: Any) -> np.ndarray:
    keeper = stepper.keeper
    return np.zeros(stepper.table.max_seqs, dtype=np.int64) if keeper is None else keeper.cut


def save_cache(cache: Any, path: str | os.PathLike) -> Path:
    _check_not_mid_forward(cache)
    path = state_path(path, writing=True)  # before gathering anything
    tensors = {}
    for g, stepper in enumerate(cache.groups.steppers):
        cells, pos, owners = stepper.table.occupied()
        for name, a in (("cells", cells), ("pos", pos), ("owners", owners)):
            tensors[_named(g, name)] = raw_numpy(a)
        tensors.update(_gather(cache, g, cells))
    state = {
        "state_version": STATE_VERSION,
        "live": [int(s) for s in cache.groups.primary.table.live_ids()],
        "cuts": [_cuts(st).tolist() for st in cache.groups.steppers],
        "pinned": sorted({s for st in cache.groups.steppers if st.keeper is not None for s in st.keeper.pinned}),
    }
    return save_state(path, layout=LAYOUT, content="cache", config=cache.config, state=state, tensors=tensors)


def save_seq(cache: Any, seq_id: int, path: str | os.PathLike) -> Path:
    held = [st.table.seq_cells(seq_id) for st in cache.groups.steppers]  # SequenceError for an id not live
    _check_not_mid_forward(cache)
    path = state_path(path, writing=True)
    tensors = {}
    for g, (cells, pos) in enumerate(held):
        tensors[_named(g, "pos")] = raw_numpy(pos)
        tensors.update(_gather(cache, g, cells))
    state = {"state_version": STATE_VERSION, "cuts": [int(_cuts(st)[seq_id]) for st in cache.groups.steppers]}
    return save_state(path, layout=LAYOUT, content="sequence", config=cache.config, state=state, tensors=tensors)


def _check_state(f: StateFile, content: str) -> None:
    if f.layout != LAYOUT:
        raise f.refuse(f"saved by layout {f.layout}, expected {LAYOUT}")
    if f.content != content:
        raise f.refuse(f"holds a {f.content}, expected a {content}")
    version = f.state.get("state_version")
    if version not in READS:
        raise f.refuse(f"cell-layout state version {version!r}; this kvlayout-cell reads versions {list(READS)}")


def _group_name(f: StateFile, g: int, name: str) -> str:
    """Group g's tensor `name` in `f` (a version 1 file has one table: every group reads it)."""
    return name if f.state.get("state_version") == 1 else _named(g, name)


def _saved_cuts(f: StateFile, groups: int, per: int | None) -> list:
    """State `cuts`: per group, a list of `per` ints >= 0 (None: one int); zeros for version 1."""
    if f.state.get("state_version") == 1:
        return [np.zeros(per, dtype=np.int64) if per is not None else 0] * groups
    cuts = f.state.get("cuts")
    if not isinstance(cuts, list) or len(cuts) != groups:
        raise f.refuse(f"state.cuts: expected a list of {groups} (one per layer group)")
    out = [int_array(f"state.cuts[{g}]", [c] if per is None else c, f.refuse) for g, c in enumerate(cuts)]
    if any(c.shape != (1 if per is None else per,) or (c < 0).any() for c in out):
        raise f.refuse(f"state.cuts: expected {'one' if per is None else per} position(s) >= 0 per layer group")
    return [int(c[0]) for c in out] if per is None else out


def _claims(pos: np.ndarray, owners: np.ndarray) -> np.ndarray:
    """One int64 per (owner, position) a table's occupied cells hold: owner << 40 | position."""
    bits = np.unpackbits(owners.astype("<u8").view(np.uint8), axis=1, bitorder="little")  # [n, 64 * words]
    cell, owner = np.nonzero(bits)
    return (owner.astype(np.int64) << 40) | pos[cell]


def _scatter(cache: Any, cells: list[np.ndarray], layers: list[tuple[mx.array, mx.array]]) -> None:
    """Write each layer's saved K and V (`read_kv`) into its group's `cells`; nothing for no cell."""
    for i, (k, v) in enumerate(layers):
        at = cells[cache.groups.group_of(i)]
        if at.size:
            cache.key_pools[i].write_cells(at, k)
            cache.value_pools[i].write_cells(at, v)


def saved_config(f: StateFile) -> Any:
    """The CacheConfig of a whole cache `save_cache` wrote: what to build before `restore_cache`."""
    _check_state(f, "cache")
    return f.cache_config()


def restore_cache(cache: Any, f: StateFile) -> None:
    """Make `cache`, just built from `saved_config(f)`, the cache `save_cache` wrote to `f`; StateError
    for a file whose contents do not fit (nothing restored: the cache stays as built)."""
    config, groups = cache.config, cache.groups
    live = int_array("state.live", f.state.get("live"), f.refuse)  # the live ids
    cuts = _saved_cuts(f, len(groups.steppers), config.max_seqs)
    tables = []
    for g, stepper in enumerate(groups.steppers):
        cells = numpy_of(f.tensor(_group_name(f, g, "cells"), "I64", (None,)))
        n = cells.size
        pos = numpy_of(f.tensor(_group_name(f, g, "pos"), "I64", (n,)))
        owners = numpy_of(f.tensor(_group_name(f, g, "owners"), "U64", (n, stepper.table.owner_words)))
        tables.append((cells, pos, owners))
    primary = _claims(*tables[0][1:])
    for g, (_, pos, owners) in enumerate(tables[1:], start=1):  # a window's table holds a subset of the primary's
        if not np.isin(_claims(pos, owners), primary).all():
            raise f.refuse(f"{_group_name(f, g, 'owners')}: a sequence holds a position in the window-"
                           f"{groups.windows[g]} layers' table that it does not hold in the primary table")
    layers = read_kv(f, config, [tables[groups.group_of(i)][0].size for i in range(config.n_layers)])
    pinned = int_array("state.pinned", f.state.get("pinned", []), f.refuse)
    if not np.isin(pinned, live).all():
        raise f.refuse("state.pinned: expected live ids")
    for stepper, (cells, pos, owners), cut in zip(groups.steppers, tables, cuts):
        stepper.restore(cells, pos, owners, live, StateError, cut if stepper.keeper is not None else None)
    for s in pinned.tolist():
        groups.seq_pin(s)
    _scatter(cache, [cells for cells, _, _ in tables], layers)


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
    groups = cache.groups
    held = []  # per group, its positions
    for g in range(len(groups.steppers)):
        pos = numpy_of(f.tensor(_group_name(f, g, "pos"), "I64", (None,)))
        if pos.size and (pos.min() < 0 or (np.diff(pos) <= 0).any()):
            raise f.refuse(f"{_group_name(f, g, 'pos')}: expected ascending distinct positions >= 0")
        if g and not np.isin(pos, held[0]).all():  # a window's table holds a subset of the primary's
            raise f.refuse(f"{_group_name(f, g, 'pos')}: a position the primary table's pos does not hold")
        held.append(pos)
    cuts = _saved_cuts(f, len(groups.steppers), None)
    layers = read_kv(f, cache.config, [held[groups.group_of(i)].size for i in range(cache.config.n_layers)])
    # Placed as a step would be: through the placement hook, announced to observers. Pressure is an
    # answer: not enough free cells or no free id gives None, nothing changed.
    placed = groups.place_sequence(held, cuts)
    if placed is None:
        return None
    seq_id, cells = placed
    _scatter(cache, cells, layers)
    return seq_id
