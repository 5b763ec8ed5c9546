"""The faces a cache may implement, and the records that cross them.

A runtime programs against these Protocols, never against a layout class: it
asks a cache for a face (`as_control()`, `as_batch_control()`,
`as_cell_stepper()`) and gets the cache back or None.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, Sequence, runtime_checkable

import attrs
import numpy as np


class MaskKind(enum.Enum):
    """What `attend()` must apply: nothing, lower-right causal, or `AttendSpec.mask`."""

    NONE = "none"
    CAUSAL = "causal"
    EXPLICIT = "explicit"


@attrs.frozen
class Run:
    """A contiguous range of pool slots: `length` slots from `slot`."""

    slot: int
    length: int


@attrs.frozen
class SeqStepPlan:
    """Where one layer of a seq-layout step writes and what it reads.

    `writes` receive the step's tokens in order; `reads` hold the keys visible
    to the step, oldest first, starting at logical position `read_start`.
    `mirror` (> 0) asks for every write run to be written again `mirror` slots
    further (a ring kept twice over, so that its window, wrapped or not, is
    one run of `reads`). Planning is pure: a plan changes nothing until it is
    committed.
    """

    start: int
    length: int
    writes: tuple[Run, ...]
    reads: tuple[Run, ...]
    read_start: int
    mask_kind: MaskKind
    window: int = 0
    mirror: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def read_len(self) -> int:
        return sum(run.length for run in self.reads)


@attrs.frozen(eq=False)
class CellStep:
    """One placed step of the cell layout, shared by every layer with the same window.

    `cells` (int32 `[length]`) are the cells the step's tokens go to; `mask`
    (bool `[length, read_len]`, True = attend) says which cells of
    `[0, read_len)` each token sees.

    `mask` may be given as the array or as a function of no argument that
    computes it: a layout that attends by groups never needs the dense mask,
    so it is built on first access only (then kept: every access returns
    the same array).
    """

    length: int
    read_len: int
    cells: np.ndarray
    _mask: Any = attrs.field(alias="mask", repr=False)

    @property
    def mask(self) -> np.ndarray:
        mask = self._mask
        if callable(mask):
            mask = mask()
            object.__setattr__(self, "_mask", mask)  # computed once; the record stays frozen otherwise
        return mask


@attrs.frozen(eq=False)
class AttendGroups:
    """A sparse step's tokens in G groups, each with the only cells it may attend.

    Prepared once per window per step (the index arrays are shared by every
    layer with that window); `keys`/`values` are the layer's own.

    - `tokens` int32 `[G, Qg]`: the step's token indices of each group; a
      group with fewer tokens repeats its last one (its output is dropped).
    - `cells` int32 `[G, Kg]`: the cells (indices on the cell axis of `keys`)
      each group may attend; a shorter group pads with any valid cell, masked.
    - `mask` bool `[G, 1, Qg, Kg]` (True = attend), or None when every slot
      is visible (no key padding and no query sees less than its group).
    - `out` int32 `[T]`: where token t's output sits among the `G * Qg`
      grouped query slots (group-major).
    - `keys`/`values` `[1, H_kv, S, D]`, S > every cell: what the cells index.
      Row-contiguous arrays (a layout passes its whole pool buffer) let the
      gather read them as `[H_kv * S, D]` rows with no copy.
    - `page` (optional, 0 = off): B > 0 makes `cells` int32 `[G, P]` page
      indices instead, page p being cells `[p * B, (p + 1) * B)`, read in
      place (S must be a multiple of B: the pages are a view of the pool,
      where gathering would copy the rows); `tail` (optional) int32
      `[G, Kt]` are cells gathered beside them. The group attends the
      `P * B` slots of its pages, in page order, then its tail, under `mask`
      `[G, 1, Qg, P * B + Kt]`.
    - `more` (optional): further batches of groups, each an `AttendBatch`
      shaped like the fields above, each run apart so it is padded only to
      its own longest group; `out` then indexes the grouped query slots of
      all batches, concatenated in order (the fields first).
    """

    tokens: Any
    cells: Any
    mask: Any
    out: Any
    keys: Any = None
    values: Any = None
    more: tuple[AttendBatch, ...] = ()
    page: int = 0
    tail: Any = None

    def batches(self) -> tuple[AttendBatch, ...]:
        """Every batch, the fields' first, as AttendBatch records."""
        head = AttendBatch(self.tokens, self.cells, self.mask, self.page, self.tail)
        return (head, *self.more)


@attrs.frozen(eq=False)
class AttendBatch:
    """One batch of groups of an AttendGroups: its fields of the same names, for one batch."""

    tokens: Any
    cells: Any
    mask: Any
    page: int = 0
    tail: Any = None


@attrs.frozen(eq=False)
class AttendSpec:
    """Keys and values a layer attends to, and how to mask them.

    `keys`/`values` are `[1, H_kv, S, D]`; `mask` is a bool `[1, 1, T, S]`
    array for EXPLICIT only, None otherwise.

    `groups` (optional, additive): when a layout sets it, `attend()` computes
    the same result as the dense EXPLICIT mask by attending each group of
    tokens to its own cells only (one batched SDPA over the groups); the
    dense fields stay valid, so any consumer may ignore `groups`.

    `mask` may be given as a function of no argument that computes it: a
    layout whose `groups` carry the work builds the dense mask only for a
    consumer that reads it (on first access, then kept).
    """

    keys: Any
    values: Any
    mask_kind: MaskKind
    _mask: Any = attrs.field(default=None, alias="mask", repr=False)
    groups: AttendGroups | None = None

    @property
    def mask(self) -> Any:
        mask = self._mask
        if callable(mask):
            mask = mask()
            object.__setattr__(self, "_mask", mask)  # computed once; the record stays frozen otherwise
        return mask


@runtime_checkable
class CacheControl(Protocol):
    @property
    def capacity(self) -> int: ...

    def can_extend(self, n: int = 1) -> bool: ...

    def clear(self) -> None: ...


@runtime_checkable
class SequenceControl(CacheControl, Protocol):
    """One sequence: a single logical length for the whole model."""

    @property
    def length(self) -> int: ...

    def rewind(self, new_len: int) -> bool: ...


@runtime_checkable
class BatchControl(CacheControl, Protocol):
    """Many sequences over one pool of cells."""

    @property
    def free_cells(self) -> int: ...

    @property
    def used_end(self) -> int: ...

    @property
    def max_seqs(self) -> int: ...

    def declare_step(self, seq_ids: Sequence[int]) -> bool: ...

    def seq_new(self) -> int | None: ...

    def seq_clone(self, src: int, upto: int | None = None) -> int | None: ...

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None) -> None: ...

    def seq_len(self, seq_id: int) -> int: ...

    def next_pos(self, seq_id: int) -> int: ...


@runtime_checkable
class CellStepper(Protocol):
    def place_step(self, layer: int, positions: Sequence[int]) -> CellStep: ...


@runtime_checkable
class KVCache(Protocol):
    """The op face every MLX layout implements; `k`, `v` are `[1, H_kv, T, D]`."""

    def update_and_fetch(self, layer: int, positions: Sequence[int], k: Any, v: Any) -> AttendSpec: ...


@runtime_checkable
class StepAbort(Protocol):
    """Atomic steps: `abort_step()` undoes the open step of a forward that failed part way.

    True: the state is what it was before the step's first layer (see each
    layout for what an overwrite below the length keeps); False: no step was
    open, nothing changed. Both shipped layouts implement it.
    """

    def abort_step(self) -> bool: ...


@runtime_checkable
class Persistent(Protocol):
    """Save and restore: `save(path)` writes the cache atomically; `kvlayout.load(path)` reads it back."""

    def save(self, path: Any) -> Any: ...


class FacesBase:
    """Face recovery without isinstance chains: a layout overrides the faces it has."""

    def as_control(self) -> SequenceControl | None:
        return None

    def as_batch_control(self) -> BatchControl | None:
        return None

    def as_cell_stepper(self) -> CellStepper | None:
        return None
