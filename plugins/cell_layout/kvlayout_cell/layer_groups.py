"""A cell cache's layers by window: one table of cells per window, driven as one.

A cell of a table is one token in every layer that table serves. The flat
layers need every token a sequence holds; a sliding-window layer of window w
needs only its last w (`kvlayout_cell.window`). So, as llama.cpp's iSWA cache
does, the layers of each distinct window get a table (and pools) of their own:
the flat layers' table holds the whole context, a window's table only the cells
some live sequence or kept prefix can still see, retired as the window moves
on and reused. A model without windows has one table, exactly as before; one
whose every layer has the same window has one table too, which retires.

Every sequence has the same id in every table; the verbs of the BatchControl
face go to each table in turn, each refusal decided in all of them before any
changes (a refused call changes nothing). The *primary* table, the flat
layers' (else the widest window's), answers the counts (`capacity`,
`free_cells`, `seq_len`, ...) and the CellView: it holds every token any
other table holds (each of their cells is one of its tokens). A window's
table never releases an id on its own: an id is live while the primary
holds it.

Neutral: integers and numpy only, as the tables and steppers it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlayout.checks import int_scalar
from kvlayout.errors import SequenceError, StepError
from kvlayout.faces import BatchControl, CellStep, face_of
from kvlayout.positions import step_positions
from kvlayout_cell.stepper import Stepper, checked_layer
from kvlayout_cell.table import CellTable
from kvlayout_cell.window import WindowKeeper


class LayerGroups:
    """One Stepper (over a CellTable of its own) per distinct window of `windows` (one per layer)."""

    def __init__(self, windows: Sequence[int], capacity: int, max_seqs: int, pm: Any):
        windows = [int(w) for w in windows]
        order = sorted(set(windows), key=lambda w: (w != 0, -w))  # flat first, else the widest: the primary
        self.windows = tuple(order)  # the groups' windows, primary first
        self.steppers = tuple(
            Stepper(CellTable(capacity, max_seqs), [w] * windows.count(w), pm,
                    None if w == 0 else WindowKeeper(w, max_seqs))
            for w in order
        )
        self.primary = self.steppers[0]
        seen = dict.fromkeys(order, 0)
        self._where = []  # per layer: (its group, its index among the group's layers)
        for w in windows:
            self._where.append((order.index(w), seen[w]))
            seen[w] += 1
        # Per layer, read on every layer's update_and_fetch (the cache checks the layer once).
        self.layer_windows = tuple(windows)
        self.layer_steppers = tuple(self.steppers[g] for g, _ in self._where)

    @property
    def n_layers(self) -> int:
        return len(self._where)

    def group_of(self, layer: int) -> int:
        """The group serving `layer` (StepError for a layer out of range)."""
        return self._where[checked_layer(self.n_layers, layer)][0]

    def stepper_of(self, layer: int) -> Stepper:
        return self.layer_steppers[checked_layer(self.n_layers, layer)]

    def window(self, layer: int) -> int:
        return self.layer_windows[checked_layer(self.n_layers, layer)]

    def layers_of(self, group: int) -> list[int]:
        """The layers group `group` serves, ascending."""
        return [i for i, (g, _) in enumerate(self._where) if g == group]

    # -- the step protocol, routed per layer --------------------------------------------

    def place_step(self, layer: int, positions: Sequence[int]) -> CellStep:
        """The step for `layer` (see `Stepper.place_step`), placed in its group's table by the group's
        first layer served; StepError, nothing changed, for positions another group placed otherwise."""
        if len(self.steppers) == 1:
            return self.primary.place_step(layer, positions)
        g, local = self._where[checked_layer(self.n_layers, layer)]
        stepper = self.steppers[g]
        positions = step_positions(positions)  # checked once for every group
        if not stepper.placing:
            for other in self.steppers:
                if other.placing and not np.array_equal(positions.host, other.step_tokens()[1]):
                    raise StepError(
                        f"layer {layer}: positions {positions.host.tolist()!r:.80} differ from the step's "
                        f"{other.step_tokens()[1].tolist()!r:.80}, placed by an earlier layer"
                    )
        return stepper.place_step(local, positions)

    def serve_again(self, layer: Any, positions: Any) -> CellStep | None:
        """`Stepper.serve_again` of `layer`'s group (None, nothing changed, for a layer out of range)."""
        if len(self.steppers) == 1:
            return self.primary.serve_again(layer, positions)
        if type(layer) is not int or not 0 <= layer < len(self._where):
            return None
        g, local = self._where[layer]
        return self.steppers[g].serve_again(local, positions)

    def served_step(self, layer: int) -> CellStep | None:
        g, local = self._where[checked_layer(self.n_layers, layer)]
        return self.steppers[g].served_step(local)

    def unserved_layers(self) -> list[int]:
        """The layers the open step has not served yet (none open: []): once any group placed it, every
        layer of a group that has not placed it yet too."""
        if not any(st.placing for st in self.steppers):
            return []
        out = []
        for g, st in enumerate(self.steppers):
            layers = self.layers_of(g)
            out += [layers[i] for i in st.unserved_layers()] if st.placing else layers
        return sorted(out)

    def abort_step(self) -> bool:
        """Undo the open step in every group (see `Stepper.abort_step`); False when none was open.
        Every group is aborted even when an observer raises; the first failure is raised after."""
        failed, any_open = [], False
        for st in self.steppers:
            try:
                any_open |= st.abort_step()
            except Exception as exc:
                failed.append(exc)
        if failed:
            raise failed[0]
        return any_open

    # -- the BatchControl verbs: refused in any group, changed in none -----------------

    def declare_step(self, seq_ids: Sequence[int]) -> bool:
        """Name the next forward's tokens' sequences in every group (see `Stepper.declare_step`):
        False, nothing changed, when any group lacks the cells even after retiring."""
        if len(self.steppers) == 1:
            return self.primary.declare_step(seq_ids)
        self.refuse_mid_forward("declare_step")
        ids = self.primary.declarable(seq_ids)
        due = [st.room_for(ids) for st in self.steppers]
        if any(d is None for d in due):
            return False
        for st, d in zip(self.steppers, due):
            st.commit_declare(ids, d)
        return True

    def seq_new(self) -> int | None:
        self.refuse_mid_forward("seq_new")
        ids = {st.seq_new() for st in self.steppers}  # live ids agree in every table
        (seq_id,) = ids
        return seq_id

    def seq_clone(self, src: int, upto: int | None = None) -> int | None:
        """A new id sharing src's cells below upto in every group (a window's: its last window of
        them); SequenceError, nothing changed, when a window group no longer holds that window."""
        if len(self.steppers) == 1 and self.windows[0] == 0:
            return self.primary.seq_clone(src, upto)
        self.refuse_mid_forward("seq_clone")
        end = self.primary.table.next_pos(self.primary.table.live_id("src", src))  # its next position in every layer
        if upto is not None:
            upto = int_scalar("upto", upto, SequenceError, minimum=0)  # as check_clone refuses it
            if upto < end:
                end = self._continues_at(src, upto)  # the clone's: one past src's newest below upto
        for st in self.steppers:
            st.check_clone(src, upto, end)
        if self.primary.table.next_id() is None:
            return None
        ids = {st.seq_clone(src, upto, end) for st in self.steppers}
        (dst,) = ids
        return dst

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int | None = None) -> None:
        """Drop seq_id's claim on positions [p0, p1) in every group; SequenceError, nothing changed,
        for a cut whose continuation would need keys a window group retired."""
        if len(self.steppers) == 1 and self.windows[0] == 0:
            return self.primary.seq_rm(seq_id, p0, p1)
        self.refuse_mid_forward("seq_rm")
        end = self.primary.table.next_pos(self.primary.table.live_id("seq_id", seq_id))
        p0 = int_scalar("p0", p0, SequenceError, minimum=0)  # as check_rm refuses it
        at = self._continues_at(seq_id, p0)
        for st in self.steppers:
            st.check_rm(seq_id, p0, p1, end, at)
        self.primary.seq_rm(seq_id, p0, p1, end=end, at=at)
        released = not self.primary.table.live_mask(np.array([int(seq_id)]))[0]
        for st in self.steppers[1:]:
            st.seq_rm(seq_id, p0, p1, keep_live=not released, end=end, at=at)

    def _continues_at(self, seq_id: int, position: int) -> int:
        """Where live `seq_id` continues once its positions from `position` on are gone (or a clone of it
        up to there): one past its newest below `position`. A flat group holds every position; in a cache
        of window groups only, the primary (widest) holds every one from its cut on, so a position it holds
        below `position` is that newest, and holding none there, the newest lies below its cut, retired:
        the sequence continues at the cut at most (refused wherever a window needs what went)."""
        below = self.primary.table.newest_below(seq_id, position)
        if self.windows[0] != 0 and below < 0:
            return min(int(self.primary.keeper.cut[seq_id]), position)
        return below + 1

    def clear(self) -> None:
        for st in self.steppers:
            st.clear()

    def seq_pin(self, seq_id: int, pinned: bool = True) -> None:
        """Keep (True) or stop keeping (False) every position live `seq_id` holds in the sliding-window
        groups too (kvlayout_cell.window); a flat group keeps them anyway. No cell changes now."""
        s = self.primary.table.live_id("seq_id", seq_id)
        for st in self.steppers:
            if st.keeper is not None:
                st.keeper.pin(s, bool(pinned))

    def seq_floor(self, seq_id: int) -> int:
        """The least position but 0 at which `seq_id` can be continued (one past its newest position below
        a clone's `upto` or a truncating seq_rm's `p0`, see `_continues_at`): 0 when every group holds all
        it needs anywhere."""
        s = self.primary.table.live_id("seq_id", seq_id)
        return max([st.keeper.floor(s) for st in self.steppers if st.keeper is not None], default=0)

    def cells_by_window(self) -> dict[int, int]:
        """Cells in use per group, by window (0: the flat layers): what each group's layers hold."""
        return {w: st.table.capacity - st.table.free_cells for w, st in zip(self.windows, self.steppers)}

    # -- restoring ------------------------------------------------------------------------

    def place_sequence(self, positions: Sequence[Sequence[int]], cuts: Sequence[int]) -> tuple[int, list] | None:
        """A new sequence holding `positions[g]` in group g (see `Stepper.place_sequence`), cut at
        `cuts[g]` in a window group: `(seq_id, cells per group)`; None, nothing changed, when some
        group lacks the cells or ids."""
        self.refuse_mid_forward("place_sequence")
        for st, pos in zip(self.steppers, positions):
            if len(pos) > st.table.free_cells or st.table.next_id() is None:
                return None
        placed: list = []  # each group's (seq_id, cells), its step left open until every group placed
        try:
            for st, pos, cut in zip(self.steppers, positions, cuts):
                got = st.place_sequence(pos, cut, close=False)
                if got is None:
                    raise StepError("a layer group refused a sequence the others took")
                placed.append(got)
        except BaseException:  # taken back where it was placed (observers hear it aborted): nothing left
            for st, (seq_id, _) in zip(self.steppers, placed):
                st.abort_step()
                st.seq_rm(seq_id)
            raise
        for st in self.steppers:
            st.close_step()
        ids = {seq_id for seq_id, _ in placed}
        (seq_id,) = ids
        return seq_id, [cells for _, cells in placed]

    def refuse_mid_forward(self, verb: str) -> None:
        """StepError, nothing changed, while the open step is half served, naming the layers (as the
        cache numbers them) not served yet."""
        missing = self.unserved_layers()
        if missing:
            raise StepError(
                f"{verb} during a forward: layer(s) {missing} of the placed step were not served; "
                "finish the forward, or abort_step() (or clear()) first"
            )



def batch_control(groups: LayerGroups) -> BatchControl:
    """The BatchControl face over `groups`: its verbs that change the tables (each ends the open
    step first) and the primary table's own counts, read straight; every verb implemented once."""
    return face_of(BatchControl, groups, groups.primary.table)
