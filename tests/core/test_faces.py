"""Faces: recovery on FacesBase, runtime-checkable Protocols, frozen records."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvlayout import faces
from kvlayout.faces import (
    AttendSpec,
    BatchControl,
    CacheControl,
    CellStep,
    CellStepper,
    FacesBase,
    KVCache,
    MaskKind,
    Run,
    SeqStepPlan,
    SequenceControl,
)


class PlainCache(FacesBase):
    """Implements no face beyond the base."""


class ToySeqCache(FacesBase):
    """A one-sequence cache that answers for its own faces."""

    def __init__(self):
        self._length = 0

    @property
    def capacity(self) -> int:
        return 16

    @property
    def length(self) -> int:
        return self._length

    def can_extend(self, n: int = 1) -> bool:
        return self._length + n <= 16

    def clear(self) -> None:
        self._length = 0

    def rewind(self, new_len: int) -> bool:
        if new_len > self._length:
            return False
        self._length = new_len
        return True

    def update_and_fetch(self, layer, positions, k, v):
        return AttendSpec(k, v, MaskKind.CAUSAL)

    def as_control(self):
        return self


class ToyBatchCache(FacesBase):
    capacity = 8
    free_cells = 8
    used_end = 0
    max_seqs = 4

    def can_extend(self, n=1):
        return True

    def clear(self):
        pass

    def declare_step(self, seq_ids):
        return True

    def seq_new(self):
        return 0

    def seq_clone(self, src, upto=None):
        return 1

    def seq_rm(self, seq_id, p0=0, p1=None):
        pass

    def seq_len(self, seq_id):
        return 0

    def next_pos(self, seq_id):
        return 0

    def place_step(self, layer, positions):
        raise NotImplementedError

    def as_batch_control(self):
        return self

    def as_cell_stepper(self):
        return self


def test_faces_base_recovers_no_face_by_default():
    cache = PlainCache()
    assert cache.as_control() is None
    assert cache.as_batch_control() is None
    assert cache.as_cell_stepper() is None


def test_a_layout_overriding_a_recovery_gets_itself_back_and_none_for_the_rest():
    seq = ToySeqCache()
    assert seq.as_control() is seq
    assert seq.as_batch_control() is None and seq.as_cell_stepper() is None
    batch = ToyBatchCache()
    assert batch.as_batch_control() is batch and batch.as_cell_stepper() is batch
    assert batch.as_control() is None


def test_protocols_are_runtime_checkable_against_what_a_cache_implements():
    seq, batch = ToySeqCache(), ToyBatchCache()
    assert isinstance(seq, CacheControl) and isinstance(seq, SequenceControl) and isinstance(seq, KVCache)
    assert not isinstance(seq, BatchControl) and not isinstance(seq, CellStepper)
    assert isinstance(batch, BatchControl) and isinstance(batch, CellStepper) and isinstance(batch, CacheControl)
    assert not isinstance(batch, SequenceControl) and not isinstance(batch, KVCache)
    assert not isinstance(PlainCache(), CacheControl)


def test_a_toy_control_behaves_as_the_face_says():
    seq = ToySeqCache().as_control()
    seq._length = 5
    assert seq.rewind(7) is False and seq.length == 5
    assert seq.rewind(2) is True and seq.length == 2
    assert seq.can_extend(14) and not seq.can_extend(15)


def test_mask_kinds_are_the_three_of_the_design():
    assert {kind.name for kind in MaskKind} == {"NONE", "CAUSAL", "EXPLICIT"}


def test_records_are_frozen():
    cells = np.array([3, 1], dtype=np.int32)
    mask = np.ones((2, 4), dtype=bool)
    records = [
        (Run(slot=4, length=2), "slot"),
        (CellStep(length=2, read_len=4, cells=cells, mask=mask), "cells"),
        (AttendSpec(keys=None, values=None, mask_kind=MaskKind.NONE), "mask"),
        (SeqStepPlan(3, 2, (Run(3, 2),), (Run(0, 5),), 0, MaskKind.CAUSAL), "start"),
    ]
    for record, field in records:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(record, field, 0)


def test_attend_spec_mask_defaults_to_none():
    assert AttendSpec("k", "v", MaskKind.CAUSAL).mask is None


def test_seq_step_plan_end_and_read_len_sum_its_runs():
    plan = SeqStepPlan(
        start=10, length=3, writes=(Run(6, 2), Run(0, 1)), reads=(Run(5, 3), Run(0, 2)),
        read_start=6, mask_kind=MaskKind.EXPLICIT, window=5,
    )
    assert plan.end == 13
    assert plan.read_len == 5
    assert SeqStepPlan(0, 0, (), (), 0, MaskKind.NONE).read_len == 0


def test_faces_module_exports_every_face_of_the_design():
    for name in ("CacheControl", "SequenceControl", "BatchControl", "CellStepper", "KVCache"):
        assert getattr(faces, name)._is_runtime_protocol
