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
    Planning is pure: a plan changes nothing until it is committed.
    """

    start: int
    length: int
    writes: tuple[Run, ...]
    reads: tuple[Run, ...]
    read_start: int
    mask_kind: MaskKind
    window: int = 0

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
    """

    length: int
    read_len: int
    cells: np.ndarray
    mask: np.ndarray


@attrs.frozen(eq=False)
class AttendSpec:
    """Keys and values a layer attends to, and how to mask them.

    `keys`/`values` are `[1, H_kv, S, D]`; `mask` is a bool `[1, 1, T, S]`
    array for EXPLICIT only, None otherwise.
    """

    keys: Any
    values: Any
    mask_kind: MaskKind
    mask: Any = None


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


class FacesBase:
    """Face recovery without isinstance chains: a layout overrides the faces it has."""

    def as_control(self) -> SequenceControl | None:
        return None

    def as_batch_control(self) -> BatchControl | None:
        return None

    def as_cell_stepper(self) -> CellStepper | None:
        return None
