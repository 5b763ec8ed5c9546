"""CellCache: the cell layout's MLX side, composed over the neutral stepper.

A CellCache holds a Stepper (the step protocol), which holds a CellTable
(the cells). It implements the KVCache, StepAbort and Persistent faces
itself and hands out three face objects, the layout's only public verbs:
`as_batch_control()` (BatchControl: the stepper's verbs that change the
table, the table's counts), `as_cell_stepper()` (CellStepper: `place_step`)
and `as_cell_view()` (CellView: the table's owners, read-only), each with
its contract's members and no more, each member implemented once.

Every layer keeps a K and a V MLXPool spanning the whole cell table
(`max_slots` = capacity, rounded up to whole pages of 256 slots), whatever
its window: a ring layer differs only in its mask. A step's tokens are written into their cells
as a slice (`write`) when they lie in one ascending run of cells, as lowest-free placement usually
gives, else scattered (`write_cells`), and the layer attends to `[0, read_len)` under the
step's explicit mask.

When that mask is sparse (many sequences, few shared cells) the spec also
carries `groups`: the step's tokens grouped by sequence, each with only the
cells it may see, so `attend()` does work proportional to what each token
attends. The choice is made once per window per step by the cost rule in
`kvlayout_cell.groups`, which also decides whether a batch of groups gathers
its cells or reads whole pages of the pool in place; `attention_path` forces
a side. A step of one sequence owning every cell below read_len (a lone
sequence) on a flat layer needs no plan: one token sees every cell (no
mask, as the seq layout's decode), a chunk over cells in position order is
causal, and any other chunk's mask is built on the device from the cells'
positions.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.config import CacheConfig, check_up_front, show_bytes
from kvlayout.errors import ConfigError, StepError
from kvlayout.faces import BatchControl, CellStepper, CellView, FacesBase, face_of
from kvlayout.mlx import MAX_SLOTS, Cells, check_kv, check_layer_dims, config_pool_bytes, kv_pool
from kvlayout.mlx.attention import pages_in_place
from kvlayout.persist import StateFile
from kvlayout.positions import step_positions
from kvlayout.registry import plugin_manager
from kvlayout.spec import AttendBatch, AttendGroups, AttendSpec, MaskKind, QuantizedKV
from kvlayout_cell import persist
from kvlayout_cell.continued import Continuation
from kvlayout_cell.groups import PAGE_SIZES, PATHS, plan_cells
from kvlayout_cell.layer_groups import LayerGroups, batch_control
from kvlayout_cell.stepper import checked_layer
from kvlayout_cell.table import CellTable


class CellCache(FacesBase):
    """Many sequences over one pool of cells: KVCache, StepAbort and Persistent, and three face objects.

    `pm` is the plugin manager whose `kvlayout_choose_cells` and
    `kvlayout_step_placed` hooks the cache calls (the process's by default;
    tests pass a fresh one).

    `attention_path`: "auto" (default: grouped attention when the rule in
    `kvlayout_cell.groups` finds it cheaper, each batch gathered or read by
    pages, whichever is cheaper), "dense", "grouped" (every batch gathered)
    or "paged" (pages wherever a page size divides the pool) (forced; results
    are identical either way, up to float rounding). Anything else is
    refused where it is assigned (ConfigError).
    """

    def __init__(self, config: CacheConfig, pm: Any = None):
        self._attention_path = "auto"
        self.config = config = CacheConfig.coerce(config)  # a mapping is built; anything else refused
        self._layers = layers = tuple(config.layer(i) for i in range(config.n_layers))
        # Pools hold whole pages of PAGE_TILE slots (past the last cell: never written, masked when
        # read), so every size they grow through is one that pages of up to PAGE_TILE cells tile.
        max_slots, initial = _check_sizes(config, layers)  # before anything is allocated
        # A table of cells per window (kvlayout_cell.layer_groups): a window's layers keep only the
        # cells some sequence can still see in them.
        self.groups = LayerGroups(
            [lc.policy.window for lc in layers],  # 0 for flat layers
            config.capacity,
            config.max_seqs,
            plugin_manager() if pm is None else pm,
        )
        # The faces are the cache's only public verbs, each implemented once: the groups' where a
        # verb changes the tables (it ends the open step first), the primary table's own counts and reads.
        self._batch_control = batch_control(self.groups)
        self._cell_stepper = face_of(CellStepper, self.groups)
        self._cell_view = face_of(CellView, self.groups.primary.table)

        def pool(lc):  # an MLXPool, or a QuantizedPool for kv_dtype "q8"/"q4"
            return kv_pool(initial, max_slots, lc.n_kv_heads, lc.head_dim, config)

        self.key_pools = [pool(lc) for lc in layers]
        self.value_pools = [pool(lc) for lc in layers]
        # What a step makes once for every layer of a window (`_once`): key -> (step, it).
        self._mx_mask: dict[int, tuple[Any, mx.array]] = {}  # window -> its mask as MLX
        self._mx_groups: dict[tuple[int, str], tuple[Any, AttendGroups | None]] = {}  # (window, path) -> groups
        self._mx_whole: dict[int, tuple[Any, mx.array | None]] = {}  # 0 -> one sequence's flat mask (None: causal)
        # Asked by every layer, made by the first of a window: where the step's K/V go (`_where`), and
        # how its queries read them (`_how_read`).
        self._writes: dict[int, tuple[Any, tuple[int | None, Cells | None]]] = {}  # window -> (run start, cells)
        self._reads: dict[tuple[int, str], tuple[Any, tuple]] = {}  # (window, path) -> (whole, groups)
        # The last decode step's grouping, to continue at the next (kvlayout_cell.continued): (0, path) -> it.
        self._continuations: dict[tuple[int, str], Continuation | None] = {}
        # Step groupings planned whole and continued from the step before, since the cache was made.
        self.grouping_counts = {"planned": 0, "continued": 0}

    @property
    def n_layers(self) -> int:
        return self.groups.n_layers

    @property
    def attention_path(self) -> str:
        """How steps attend: "auto", "dense", "grouped" or "paged" (see the class)."""
        return self._attention_path

    @attention_path.setter
    def attention_path(self, path: str) -> None:
        # Checked here, not at the next update_and_fetch, which would refuse it after placing the step.
        if not isinstance(path, str) or path not in PATHS:
            raise ConfigError(f"attention_path={path!r}: expected one of {', '.join(PATHS)}")
        self._attention_path = path

    def as_batch_control(self) -> BatchControl:
        """The BatchControl face: ids, declarations and counts of the cells."""
        return self._batch_control

    def as_cell_stepper(self) -> CellStepper:
        """The CellStepper face: `place_step`, for a layer that writes its own K/V."""
        return self._cell_stepper

    def as_cell_view(self) -> CellView:
        """The CellView face: who owns each cell, read-only (pictures, stats, traces)."""
        return self._cell_view

    def abort_step(self) -> bool:
        """Undo the open step of a forward that failed part way (see `Stepper.abort_step`)."""
        return self.groups.abort_step()

    # Save and restore (kvlayout_cell.persist has the format).

    def save(self, path) -> Path:
        """Write the whole cache (occupied cells only) to `path`, atomically; `kvlayout.load` reads it."""
        return persist.save_cache(self, path)

    def save_seq(self, seq_id: int, path) -> Path:
        """Write one live sequence's positions and K/V to `path`, atomically (a llama.cpp slot)."""
        return persist.save_seq(self, seq_id, path)

    def load_seq(self, path) -> int | None:
        """A sequence `save_seq` wrote, as a new id in fresh cells; None (nothing changed) when
        the free cells or ids are too few. StateError for a bad file or an incompatible cache
        (layers, policies and kv_dtype must match; capacity and max_seqs may differ)."""
        return persist.load_seq(self, path)

    def update_and_fetch(self, layer: int, positions: Sequence[int], k: mx.array, v: mx.array) -> AttendSpec:
        layer = checked_layer(len(self._layers), layer)  # one per layer, as n_layers counts them
        lc = self._layers[layer]
        pos = step_positions(positions)  # a model's is checked once per forward (kvlayout.positions)
        T = check_kv(layer, k, v, lc.n_kv_heads, lc.head_dim, pos.size)  # before placing: a refusal claims no cell

        # A later layer of the forward (the model's one StepPositions) finds its step served at once.
        step = self.groups.serve_again(layer, pos) or self.groups.place_step(layer, pos)
        window = self.groups.layer_windows[layer]
        k_pool, v_pool = self.key_pools[layer], self.value_pools[layer]
        # K/V checked above, the cells placed within capacity: the pools' own checks are skipped.
        start, cells = self._once(self._writes, window, step, lambda: _where(step))
        if cells is None:  # one ascending run (lowest-free placement, usually): a slice write, no scatter
            k_pool.write_run(start, k)
            v_pool.write_run(start, v)
        else:  # cells of one step are distinct (placement checks it), as write_cells requires
            k_pool.write_placed(cells, k)
            v_pool.write_placed(cells, v)
        read_len = step.read_len  # every cell below it was written by every layer: within the pools' slots
        if read_len > k_pool.slots:
            k_pool.read(0, read_len)  # it says what is wrong
        path = self.attention_path
        # After the write: a plan reads the pools' slots, which it may have grown.
        whole, groups = self._once(self._reads, (window, path), step, lambda: self._how_read(layer, step))
        if whole is not None:  # one sequence owning every cell below read_len: no plan, no host mask
            keys, values = k_pool.read_run(0, read_len), v_pool.read_run(0, read_len)  # [1, H_kv, read_len, D] each
            return AttendSpec(keys, values, whole[0], whole[1], queries=T)
        if groups is None:
            keys, values = k_pool.read_run(0, read_len), v_pool.read_run(0, read_len)
            return AttendSpec(keys, values, MaskKind.EXPLICIT, self._step_mask(layer, step), queries=T)
        # The whole pool buffer (a row-contiguous view): the grouped gather then copies only the rows it
        # takes. Dropped with the spec. The dense fields, which attend() does not read beside the groups,
        # are made from these views (the pools as this step wrote them) only for a consumer that asks:
        # two slices a layer fewer; so is the mask.
        k_all, v_all = k_pool.read_run(0, k_pool.slots), v_pool.read_run(0, v_pool.slots)  # [1, H_kv, slots, D] each
        return AttendSpec(functools.partial(_first_slots, k_all, read_len),
                          functools.partial(_first_slots, v_all, read_len), MaskKind.EXPLICIT,
                          functools.partial(self._step_mask, layer, step), groups.over(k_all, v_all), queries=T)

    def step_groups(self, layer: int, step) -> AttendGroups | None:
        """The step's grouping for this layer's window (None: dense), planned once per window per step.

        `step` is what `place_step(layer, ...)` answered for the open step; StepError for a layer
        out of range or any other step (a grouping is planned from the open step's tokens)."""
        return self._step_groups(layer, self._check_step(layer, step))

    def step_mask(self, layer: int, step) -> mx.array:
        """The step's mask as bool [1, 1, T, read_len], converted once per window per step.

        `step` is what `place_step(layer, ...)` answered for the open step; StepError otherwise."""
        return self._step_mask(layer, self._check_step(layer, step))

    def _check_step(self, layer: Any, step: Any) -> Any:
        served = self.groups.served_step(layer)  # StepError for a bad layer
        if step is None or step is not served:
            what = "no step is open or it has not served this layer" if served is None else "another step"
            raise StepError(
                f"step={step!r:.80}: expected the CellStep place_step answered for layer {layer} in the open "
                f"step ({what})"
            )
        return step

    @staticmethod
    def _once(memo: dict, key: Any, step, make: Any) -> Any:
        """`make()` once per step for `key` (its window): every layer of the window shares it. The memo
        holds the step weakly: a step nobody else holds needs no copy of the table kept for a late
        reader of its mask (`Stepper._keep_masks`)."""
        held = memo.get(key)
        if held is None or held[0]() is not step:
            held = memo[key] = (weakref.ref(step), make())
        return held[1]

    def _how_read(self, layer: int, step) -> tuple[tuple | None, AttendGroups | None]:
        """(`_whole_sequence`'s answer, the step's grouping when there is none) for layer's window and path."""
        whole = self._whole_sequence(layer, step)
        return whole, None if whole is not None else self._step_groups(layer, step)

    def _whole_sequence(self, layer: int, step) -> tuple[MaskKind, mx.array | None] | None:
        """(mask kind, mask) when every token of the step is one sequence's, on a flat layer, and it
        owns every cell below read_len (O(1): its cell count); else None (auto only). Asked once per
        window per step: every layer of the window shares the answer.

        Its tokens are its newest, so token i sees cell c iff pos_c <= positions[i]: one token
        sees them all (NONE, as the seq layout's decode); a chunk over cells in position order
        ending at its own is CAUSAL (MLX's lower-right alignment); else the mask is built on the
        device from the cells' positions (O(read_len) to it, not O(T * read_len) on the host),
        once per step."""
        stepper = self.groups.layer_steppers[layer]
        if self.groups.layer_windows[layer] != 0 or self.attention_path != "auto":
            return None
        seq_ids, positions = stepper.step_tokens()
        if int(stepper.table.held(seq_ids[:1])[0]) != step.read_len:
            return None
        if step.length == 1:
            return MaskKind.NONE, None
        if not (seq_ids == seq_ids[0]).all():
            return None

        def mask() -> mx.array | None:  # [1, 1, T, S], or None: causal
            cell_pos = stepper.table.snapshot(copy=False)[0][: step.read_len]  # [S]: each cell's position
            first = step.read_len - step.length
            if (positions == np.arange(first, step.read_len)).all() and (cell_pos == np.arange(step.read_len)).all():
                return None
            return (
                mx.array(cell_pos.astype(np.int32))[None, :] <= mx.array(positions.astype(np.int32))[:, None]
            )[None, None]

        m = self._once(self._mx_whole, 0, step, mask)
        return (MaskKind.CAUSAL, None) if m is None else (MaskKind.EXPLICIT, m)

    def _step_groups(self, layer: int, step) -> AttendGroups | None:
        window, path, stepper = self.groups.layer_windows[layer], self.attention_path, self.groups.layer_steppers[layer]

        def plan() -> AttendGroups | None:
            table, slots = stepper.table, self.key_pools[layer].slots
            held = self._continuations.get((window, path))
            # The step place_step just served, as Python ints: compared with the last one's every step.
            if held is not None and held.follows(*stepper.step_token_lists(), table.epoch, slots):
                self.grouping_counts["continued"] += 1
                return held.advance(step.cells, table.epoch)  # a decode step after the last: its new cells added
            seq_ids, positions = stepper.step_tokens()
            lc = self.config.layer(layer)
            # Every layer's pool holds as many slots (they take the same cells); the row is this
            # layer's, for every layer of this window (models give them one shape).
            pool = (slots, lc.n_kv_heads * lc.head_dim)
            if path == "auto" and (self.config.kv_bits or not pages_in_place(self.key_pools[layer].dtype)):
                pool = None  # attend() would gather the pages' cells (always, when quantized): plan gathered batches
            groups = plan_cells(seq_ids, positions, window, step.read_len, table.seq_keys, path, table.held, pool)
            self.grouping_counts["planned"] += 1
            planned = None if groups is None else _as_mx(groups)
            if not window:  # a flat layer's decode step may be continued at the next step
                self._continuations[window, path] = None if groups is None else Continuation.of(
                    planned, groups, seq_ids, positions, table.epoch, slots)
            return planned

        return self._once(self._mx_groups, (window, path), step, plan)

    def _step_mask(self, layer: int, step) -> mx.array:
        """A lazy spec's mask may be read after the step ended: the step's own (`CellStep.mask`)."""
        window = self.groups.layer_windows[layer]
        return self._once(self._mx_mask, window, step, lambda: mx.array(step.mask)[None, None])


def load_cache(f: StateFile) -> CellCache:
    """The Builder's `load`: the CellCache `CellCache.save` wrote to `f` (kvlayout_cell.persist has the format)."""
    cache = CellCache(persist.saved_config(f))
    persist.restore_cache(cache, f)
    return cache


PAGE_TILE = max(PAGE_SIZES)
MAX_CAPACITY = MAX_SLOTS // PAGE_TILE * PAGE_TILE  # the most cells whose tiled pools MLX can index


def _tiled(n: int) -> int:
    """`n` slots rounded up to whole PAGE_TILE pages; small pools (<= one page) stay as asked."""
    return n if n <= PAGE_TILE else -(-n // PAGE_TILE) * PAGE_TILE


def _check_sizes(config: CacheConfig, layers: list) -> tuple[int, int]:
    """(max_slots, initial slots) of every pool; ConfigError, stating the bytes, for a capacity no
    MLX pool can span or a cache whose up-front allocations exceed the machine's memory.

    Up front: the cell table's arrays (`CellTable.footprint`: 16 B a cell plus 8 B a cell per 64
    ids, 25 B an id) and every layer's K and V pool at its initial slots. The pools grow lazily
    past that, by doubling, up to capacity (their size there is stated, not refused: a cache
    need not fill).
    """
    capacity, max_seqs = config.capacity, config.max_seqs
    max_slots = _tiled(capacity)
    initial = min(_tiled(config.initial_capacity), max_slots)

    def pools(slots: int) -> int:  # bytes of every layer's K and V pools at `slots` slots
        return sum(2 * config_pool_bytes(slots, lc.n_kv_heads, lc.head_dim, config) for lc in layers)

    what = f"an mlx:cell cache of capacity={capacity} and max_seqs={max_seqs}"
    check_layer_dims(config)
    groups = len({lc.policy.window for lc in layers})  # a table per window (kvlayout_cell.layer_groups)
    table = {f"{k} x {groups} layer groups" if groups > 1 else k: v * groups
             for k, v in CellTable.footprint(capacity, max_seqs).items()}
    check_up_front(what, {**table, f"K/V pools of {initial} slots": pools(initial)}, "lower capacity or max_seqs")
    if max_slots > MAX_SLOTS:
        raise ConfigError(
            f"{what}: its pools would span {max_slots} slots (capacity in whole pages of {PAGE_TILE}), past "
            f"the {MAX_SLOTS} an MLX array dimension holds (int32); expected capacity <= {MAX_CAPACITY} "
            f"(at capacity the pools alone would hold {show_bytes(pools(max_slots))})"
        )
    return max_slots, initial


def _as_mx(plan: AttendGroups) -> AttendGroups:
    """A numpy plan (`kvlayout_cell.groups`) as MLX: every batch's int32 tokens [G, Qg], cells
    [G, Kg], mask bool [G, 1, Qg, Kg] (None: all visible) and tail [G, Kt] (None: none), and `out`."""

    def arrays(b: AttendBatch | AttendGroups) -> dict:
        return dict(
            tokens=mx.array(b.tokens),
            cells=mx.array(b.cells),
            mask=None if b.mask is None else mx.array(b.mask),
            tail=None if b.tail is None else mx.array(b.tail),
        )

    more = tuple(attrs.evolve(b, **arrays(b)) for b in plan.more)
    return attrs.evolve(plan, **arrays(plan), out=mx.array(plan.out), more=more)


def _first_slots(pool: Any, n: int) -> Any:
    """`[1, H, n, D]`: the first `n` slots of a pool's read `[1, H, S, D]` (float, or a QuantizedKV's parts)."""
    return pool.map(lambda a: a[:, :, :n, :]) if isinstance(pool, QuantizedKV) else pool[:, :, :n, :]


def _where(step) -> tuple[int | None, Cells | None]:
    """Where a step's K/V go in every pool of its window's layers: (the first cell, None) when its cells
    are one ascending run, else (None, its cells checked and on the device: distinct, the placement's,
    as the plugin manager's referee checked them)."""
    start = _run_start(step.cells)
    return (start, None) if start is not None else (None, Cells(step.cells, distinct=True))


def _run_start(cells: np.ndarray) -> int | None:
    """The first cell when `cells` are one ascending run c, c + 1, ...; else None.

    MLX updates a slice in place several times faster than it scatters the
    same rows (a one-token write at 8k cells: ~0.1 ms vs ~0.4 ms on the CPU).
    """
    first = int(cells[0])
    if int(cells[-1]) - first != cells.size - 1:
        return None
    return first if cells.size <= 2 or bool((np.diff(cells) == 1).all()) else None
