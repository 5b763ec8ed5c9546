"""Saving and restoring the seq layout.

One file (`content = "cache"`) holds, per layer i, `k.i` / `v.i`: a flat
layer's slots `[0, length)`, `[1, H_kv, length, D]`; a ring layer's whole
ring, `[1, H_kv, slots, D]` (quantized K/V as their triples' parts,
`k.i.packed` ..., bit for bit: `kvlayout.mlx.tensors`) (a ring is allocated whole and its slots are
recycled, so all of it is kept). The state is
`{"state_version": 1, "length": L, "retained": [per distinct policy]}`:
the length and each ring's record of what it still holds, so `floor`, and
with it `rewind`, comes back as it was.

Saving refuses (StepError) while a forward is half done (a step some layers
have not written yet).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvlayout.checks import int_scalar
from kvlayout.errors import StepError
from kvlayout.mlx.tensors import kv_tensors, read_kv
from kvlayout.persist import StateFile, save_state, state_path

LAYOUT = "mlx:seq"
STATE_VERSION = 1


def _kept(policy: Any, length: int) -> int:
    """Slots of a layer's pool the file keeps."""
    return policy.slots if policy.kind == "ring" else length


def save_cache(cache: Any, path: str | os.PathLike) -> Path:
    book = cache.book
    step = book.open_step()  # open until its last layer commits
    if step is not None:
        start, missing = step
        raise StepError(
            f"save during a forward: layer(s) {missing} have not written the step at {start}; "
            "finish the forward or abort_step() first"
        )
    path = state_path(path, writing=True)  # before gathering anything
    tensors = {}
    for i, policy in enumerate(book.layers):
        n = _kept(policy, book.length)
        tensors.update(kv_tensors(f"k.{i}", cache.key_pools[i].read(0, n)))  # [1, H_kv, n, D]
        tensors.update(kv_tensors(f"v.{i}", cache.value_pools[i].read(0, n)))
    state = {
        "state_version": STATE_VERSION,
        "length": book.length,
        "retained": [int(getattr(p, "retained", 0)) for p in book.policies],
    }
    return save_state(path, layout=LAYOUT, content="cache", config=cache.config, state=state, tensors=tensors)


def _int(f: StateFile, key: str, value: Any, low: int, high: int) -> int:
    return int_scalar(f"state.{key}", value, f.refuse, low, high, numpy=False)


def saved_config(f: StateFile) -> Any:
    """The CacheConfig of the cache `save_cache` wrote: what to build before `restore_cache`."""
    if f.layout != LAYOUT or f.content != "cache":
        raise f.refuse(f"holds a {f.content} of {f.layout}, expected a cache of {LAYOUT}")
    version = f.state.get("state_version")
    if version != STATE_VERSION:
        raise f.refuse(f"seq-layout state version {version!r}; this kvlayout-seq reads version {STATE_VERSION}")
    return f.cache_config()


def restore_cache(cache: Any, f: StateFile) -> None:
    """Make `cache`, just built from `saved_config(f)`, the cache `save_cache` wrote to `f`; StateError
    for a file whose state does not fit it."""
    config = cache.config
    book = cache.book
    length = _int(f, "length", f.state.get("length"), 0, book.capacity)
    retained = f.state.get("retained")
    if not isinstance(retained, list) or len(retained) != len(book.policies):
        raise f.refuse(
            f"state.retained={retained!r}: expected one entry per distinct layer policy ({len(book.policies)})"
        )
    retained = [_int(f, "retained", r, 0, length if p.kind == "ring" else 0) for r, p in zip(retained, book.policies)]
    layers = read_kv(f, config, [_kept(policy, length) for policy in book.layers])
    for policy, r in zip(book.policies, retained):
        if policy.kind == "ring":
            policy.retained = r
    book.length = length
    if book.floor > length:
        raise f.refuse(f"state: a ring floor of {book.floor} above the length {length}")
    for i, (k, v) in enumerate(layers):
        if k.shape[2]:
            for start in {0, book.layers[i].mirror}:  # a mirrored ring holds its slots twice
                cache.key_pools[i].write(start, k)
                cache.value_pools[i].write(start, v)
