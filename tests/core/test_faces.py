"""Faces: recovery on FacesBase, runtime-checkable Protocols, frozen records."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvlayout import faces
from kvlayout.faces import (
    BatchControl,
    CacheControl,
    CellStep,
    CellStepper,
    CellView,
    FacesBase,
    KVCache,
    SequenceControl,
    contract,
    face_of,
)
from kvlayout.spec import AttendSpec, MaskKind


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

    @property
    def max_step(self) -> int:
        return 4

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
        return face_of(SequenceControl, self)


class Verbs:
    """The verbs that change the cells (as the cell layout's stepper does, ending the open step)."""

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

    def seq_pin(self, seq_id, pinned=True):
        pass

    # What the cell layout's layer groups answer beside its verbs: no sliding-window tables here.
    def seq_floor(self, seq_id):
        return 0

    def cells_by_window(self):
        return {0: 0}


class ToyBatchCache(Verbs, FacesBase):
    capacity = 8
    free_cells = 8
    used_end = 0
    max_seqs = 4

    def can_extend(self, n=1):
        return True

    def seq_len(self, seq_id):
        return 0

    def next_pos(self, seq_id):
        return 0

    def place_step(self, layer, positions):
        raise NotImplementedError

    def as_batch_control(self):
        return face_of(BatchControl, self)

    def as_cell_stepper(self):
        return face_of(CellStepper, self)


def test_faces_base_recovers_no_face_by_default():
    cache = PlainCache()
    assert cache.as_control() is None
    assert cache.as_batch_control() is None
    assert cache.as_cell_stepper() is None
    assert cache.as_cell_view() is None


def test_a_layout_overriding_a_recovery_gets_its_face_back_and_none_for_the_rest():
    seq = ToySeqCache()
    assert isinstance(seq.as_control(), SequenceControl)
    assert seq.as_batch_control() is None and seq.as_cell_stepper() is None
    batch = ToyBatchCache()
    assert isinstance(batch.as_batch_control(), BatchControl) and isinstance(batch.as_cell_stepper(), CellStepper)
    assert batch.as_control() is None


def public(obj) -> list[str]:
    return sorted(name for name in dir(obj) if not name.startswith("_"))


CONTROL = ["can_extend", "capacity", "clear"]
SEQUENCE = sorted(CONTROL + ["length", "max_step", "rewind"])
BATCH = sorted(CONTROL + ["cells_by_window", "declare_step", "free_cells", "max_seqs", "next_pos", "seq_clone",
                          "seq_floor", "seq_len", "seq_new", "seq_pin", "seq_rm", "used_end"])


def test_each_contract_names_the_members_the_design_lists():
    assert list(contract(CacheControl)) == CONTROL
    assert list(contract(SequenceControl)) == SEQUENCE
    assert list(contract(BatchControl)) == BATCH
    assert list(contract(CellStepper)) == ["place_step"]
    assert list(contract(CellView)) == ["capacity", "cell_owners", "max_seqs"]


def test_a_face_object_exposes_its_contract_and_nothing_else():
    seq, batch = ToySeqCache(), ToyBatchCache()
    assert public(seq.as_control()) == SEQUENCE  # not update_and_fetch, though the toy has it
    assert public(batch.as_batch_control()) == BATCH  # not place_step
    assert public(batch.as_cell_stepper()) == ["place_step"]
    with pytest.raises(AttributeError):
        _ = seq.as_control().update_and_fetch


def test_a_face_object_forwards_calls_and_reads_properties_live():
    seq = ToySeqCache()
    control = seq.as_control()
    seq._length = 5
    assert control.length == 5  # a property is read through, not copied when the face was made
    assert control.rewind(3) is True and seq.length == 3 and control.length == 3
    assert control.max_step == 4


def test_a_face_over_an_object_lacking_a_member_is_refused_naming_it():
    with pytest.raises(TypeError, match="PlainCache lacks .*rewind.* of the SequenceControl face"):
        face_of(SequenceControl, PlainCache())


class Counts:
    """The reads of a batch layout, kept apart from its verbs (as the cell layout's table is)."""

    capacity, free_cells, used_end, max_seqs = 8, 6, 2, 4

    def can_extend(self, n=1):
        return n <= self.free_cells

    def seq_len(self, seq_id):
        return 2

    def next_pos(self, seq_id):
        return 2

    def seq_new(self):  # the table's own primitive: the face takes the verbs' part's instead
        return 99


def test_a_face_over_several_parts_takes_each_member_from_the_first_part_that_has_it():
    verbs, counts = Verbs(), Counts()
    bc = face_of(BatchControl, verbs, counts)
    assert isinstance(bc, BatchControl) and public(bc) == BATCH
    assert bc.seq_new() == 0 and bc.seq_len(0) == 2 and bc.can_extend(6)  # the verbs' seq_new, the counts' reads
    counts.free_cells = 3
    assert bc.free_cells == 3  # read through, from the part that has it
    with pytest.raises(
        TypeError, match=r"^Verbs \+ PlainCache lacks can_extend, capacity, .* of the BatchControl face$"
    ):
        face_of(BatchControl, verbs, PlainCache())


def test_protocols_are_runtime_checkable_against_what_a_cache_implements():
    seq, batch = ToySeqCache(), ToyBatchCache()
    assert isinstance(seq, CacheControl) and isinstance(seq, SequenceControl) and isinstance(seq, KVCache)
    assert not isinstance(seq, BatchControl) and not isinstance(seq, CellStepper)
    assert isinstance(batch, BatchControl) and isinstance(batch, CellStepper) and isinstance(batch, CacheControl)
    assert not isinstance(batch, SequenceControl) and not isinstance(batch, KVCache)
    assert not isinstance(PlainCache(), CacheControl)


def test_a_toy_control_behaves_as_the_face_says():
    toy = ToySeqCache()
    seq = toy.as_control()
    toy._length = 5
    assert seq.rewind(7) is False and seq.length == 5
    assert seq.rewind(2) is True and seq.length == 2
    assert seq.can_extend(14) and not seq.can_extend(15)


def test_mask_kinds_are_the_three_of_the_design():
    assert {kind.name for kind in MaskKind} == {"NONE", "CAUSAL", "EXPLICIT"}


def test_records_are_frozen():
    cells = np.array([3, 1], dtype=np.int32)
    mask = np.ones((2, 4), dtype=bool)
    records = [
        (CellStep(length=2, read_len=4, cells=cells, mask=mask), "cells"),
        (AttendSpec(keys=None, values=None, mask_kind=MaskKind.NONE), "mask"),
    ]
    for record, field in records:
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(record, field, 0)


def test_attend_spec_mask_defaults_to_none():
    assert AttendSpec("k", "v", MaskKind.CAUSAL).mask is None


def test_faces_module_exports_every_face_of_the_design():
    for name in ("CacheControl", "SequenceControl", "BatchControl", "CellStepper", "KVCache"):
        assert getattr(faces, name)._is_runtime_protocol
