"""SeqCache: the seq layout's MLX face.

Each layer keeps K and V in one MLXPool each, `[1, H_kv, slots, D]`. A step
is planned by the neutral SeqBook, which says which slot runs to write and
which to read back; this module only moves bytes and builds the band mask.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.config import CacheConfig, check_up_front, show_bytes
from kvlayout.errors import ConfigError, StepError
from kvlayout.faces import FacesBase, SequenceControl, face_of
from kvlayout.mlx import MAX_SLOTS, check_kv, check_layer_dims, config_pool_bytes, kv_pool
from kvlayout.persist import StateFile
from kvlayout.pool import Pool
from kvlayout.positions import StepPositions
from kvlayout.spec import AttendSpec, MaskKind
from kvlayout_seq import persist
from kvlayout_seq.bookkeeping import SeqBook, SeqStepPlan, band_mask


def _positions(positions: Any) -> StepPositions:
    """`positions` as StepPositions (a model's, checked once per forward, as it is); anything but a
    sequence or array of integers is refused, naming the argument. An mx.array of positions is
    evaluated here: checking them needs their values."""
    if isinstance(positions, StepPositions):
        return positions
    if not isinstance(positions, (list, tuple, range, np.ndarray, mx.array)):
        raise StepError(f"positions: expected a list or array of integers, got {type(positions).__name__}")
    return StepPositions(positions)


class SeqCache(FacesBase):
    """One sequence over per-layer flat or ring pools: KVCache, StepAbort and Persistent, and the
    SequenceControl face (`as_control()`), the book's verbs.

    Every refused call raises before any pool is written or any count moves,
    so a refusal changes nothing.
    """

    def __init__(self, config: Any):
        self.config = config = CacheConfig.coerce(config)
        layers = [config.layer(i) for i in range(config.n_layers)]
        self._book = SeqBook(
            config.capacity,
            [(lc.policy.kind, lc.policy.window) for lc in layers],
            config.max_write,
        )
        self._shapes = [(lc.n_kv_heads, lc.head_dim) for lc in layers]
        initial = _check_sizes(config, self._book)  # the book allocates nothing: check before the pools do
        self.key_pools: list[Pool] = []  # MLXPools, or QuantizedPools for kv_dtype "q8"/"q4"
        self.value_pools: list[Pool] = []
        for (heads, dim), policy, slots in zip(self._shapes, self._book.layers, initial):
            self.key_pools.append(kv_pool(slots, policy.storage, heads, dim, config))
            self.value_pools.append(kv_pool(slots, policy.storage, heads, dim, config))
        self._control = face_of(SequenceControl, self._book)  # the layout's only public verbs, the book's own

    def as_control(self) -> SequenceControl:
        """The SequenceControl face: the book's capacity, length, max_step, can_extend, clear, rewind.

        Rewinding truncates the length; the pools keep their bytes: what lies past the length is
        overwritten before it is read again."""
        return self._control

    @property
    def n_layers(self) -> int:
        return self._book.n_layers

    @property
    def book(self) -> SeqBook:
        """The neutral bookkeeping (length, policies, rewind floor): read it; it changes through the
        SequenceControl face (its own verbs) and the steps this cache writes."""
        return self._book

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.key_pools + self.value_pools)

    def save(self, path) -> Path:
        """Write the cache to `path`, atomically; `kvlayout.load(path)` reads it back."""
        return persist.save_cache(self, path)

    def abort_step(self) -> bool:
        """Undo the open step (a forward that failed part way); False when none is open.

        The length returns to the step's start; see `SeqBook.abort_step` for
        what a step that overwrote below the length, or a ring, keeps.
        """
        return self._book.abort_step()

    # KVCache

    def update_and_fetch(self, layer: int, positions: Sequence[int], k: mx.array, v: mx.array) -> AttendSpec:
        """Store `k`, `v` (`[1, H_kv, T, D]`) at `positions`; return what the step attends.

        `positions` are T consecutive integers starting at or below the length
        (below overwrites: every layer of a forward writes the same ones).
        Keys/values come back oldest first, `[1, H_kv, S, D]`.

        The pools hold the only reference to their buffers, so the write is in
        place, provided the caller drops the returned spec (a view of the
        pool) before the next step; holding it makes that write copy the pool.
        """
        # A later layer of the forward, handed the StepPositions its first layer was checked with,
        # finds the step planned (SeqBook.serve_again): only its own K/V are checked.
        again = self._book.serve_again(layer, positions)
        if again is not None:
            plan = again
            heads, dim = self._shapes[layer]
            check_kv(layer, k, v, heads, dim, plan.length)
        else:
            positions = _positions(positions)
            layer, plan = self._plan(layer, positions, k, v)
        k_pool, v_pool = self.key_pools[layer], self.value_pools[layer]
        # Nothing below may raise: the plan was checked whole (K/V too), pools were sized by the policy,
        # so the pools' own checks are skipped (Pool.write_run, read_run).
        writes = plan.writes
        if len(writes) == 1 and not plan.mirror:  # one run (a flat layer's, always)
            k_pool.write_run(writes[0].slot, k)
            v_pool.write_run(writes[0].slot, v)
        else:
            _scatter(k_pool, plan, k)
            _scatter(v_pool, plan, v)
        if again is not None:
            self._book.served_again(layer)  # nothing changed the book since serve_again answered
        else:
            self._book.commit(plan, layer, positions)
        (run,) = plan.reads  # one run, always (flat, or a ring's window in its mirror)
        keys = k_pool.read_run(run.slot, run.length)  # [1, H_kv, S, D]
        values = v_pool.read_run(run.slot, run.length)
        mask = None
        if plan.mask_kind is MaskKind.EXPLICIT:
            mask = _band_mask(plan.length, plan.read_len, plan.window)  # [1, 1, T, S]
        return AttendSpec(keys, values, plan.mask_kind, mask, queries=plan.length)

    def _plan(self, layer: Any, pos: StepPositions, k: Any, v: Any) -> tuple[int, SeqStepPlan]:
        """Check the whole step (layer, K/V shapes, positions) and plan it; changes nothing."""
        layer = self._book.check_layer(layer)
        check_kv(layer, k, v, *self._shapes[layer], pos.size)
        if pos.size == 0:
            raise StepError(f"positions is empty: a step of 0 token(s) at layer {layer}: expected at least 1")
        if not pos.consecutive:
            raise StepError(
                f"positions {_show(pos.host)}: expected {pos.size} consecutive integers starting at {pos.first}"
            )
        return layer, self._book.plan(layer, pos.first, pos.size)


def load_cache(f: StateFile) -> SeqCache:
    """The Builder's `load`: the SeqCache `SeqCache.save` wrote to `f` (kvlayout_seq.persist has the format)."""
    cache = SeqCache(persist.saved_config(f))
    persist.restore_cache(cache, f)
    return cache


def _check_sizes(config: CacheConfig, book: SeqBook) -> list[int]:
    """Each layer's initial pool slots; ConfigError, stating the bytes, for a layer no MLX pool can
    span or pools whose up-front allocation exceeds the machine's memory.

    A flat layer's pools start at `initial_capacity` and grow lazily, by doubling, up to capacity;
    a ring is recycled from its first lap, so it is allocated whole (its slots, twice when
    mirrored). The bookkeeping is a few integers.
    """
    shapes = [(config.layer(i).n_kv_heads, config.layer(i).head_dim) for i in range(config.n_layers)]
    initial = [min(config.initial_capacity, p.storage) if p.kind == "flat" else p.storage for p in book.layers]

    def pools(slots: list[int]) -> int:  # bytes of every layer's K and V pools at these slots
        return sum(2 * config_pool_bytes(n, heads, dim, config) for n, (heads, dim) in zip(slots, shapes))

    what = f"an mlx:seq cache of capacity={config.capacity}"
    check_layer_dims(config)
    for i, policy in enumerate(book.layers):
        if policy.storage > MAX_SLOTS:
            if policy.kind == "flat":
                why, fix = "a flat layer spans its capacity", "lower capacity"
            else:
                twice = ", twice over (mirrored)" if policy.mirror else ""
                why = f"a ring of window={policy.window} and max_write={policy.max_write} keeps {policy.slots}{twice}"
                fix = "lower capacity or the window"
            at_capacity = show_bytes(pools([p.storage for p in book.layers]))
            raise ConfigError(
                f"{what}: layer {i}'s pools would span {policy.storage} slots ({why}), past the {MAX_SLOTS} "
                f"an MLX array dimension holds (int32); {fix} (at capacity the pools would hold {at_capacity})"
            )
    rings = " (rings whole)" if any(p.kind == "ring" for p in book.layers) else ""
    check_up_front(
        what, {f"K/V pools at build{rings}": pools(initial)}, "lower capacity, initial_capacity or the ring windows"
    )
    return initial


def _scatter(pool: Pool, plan: SeqStepPlan, x: mx.array) -> None:
    """Write the step's tokens `x` `[1, H_kv, T, D]` into the plan's write runs, in order
    (and each again `plan.mirror` slots further, for a mirrored ring)."""
    first = 0  # a ring write that wraps: the head of the step, then the rest from slot 0
    for run in plan.writes:
        part = x if len(plan.writes) == 1 else x[:, :, first : first + run.length, :]
        pool.write_run(run.slot, part)
        if plan.mirror:
            pool.write_run(run.slot + plan.mirror, part)
        first += run.length


@functools.lru_cache(maxsize=4)  # a few windows per step; masks of long prefill steps are large
def _band_mask(length: int, read_len: int, window: int) -> mx.array:
    """`band_mask` as an MLX `[1, 1, T, S]`, built once per step shape: every ring layer
    of a window gets the same one (arrays are values, so sharing it is safe)."""
    return mx.array(band_mask(length, read_len, window))[None, None]


def _show(pos: np.ndarray) -> str:
    if pos.size <= 8:
        return str(pos.tolist())
    return f"[{', '.join(map(str, pos[:4].tolist()))}, ..., {pos[-1]}]"

