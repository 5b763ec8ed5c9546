"""The step protocol of the cell layout: declare, place once, reuse per layer.

Still neutral (numpy and the plugin manager, no tensor type). One forward is
one step:

1. `declare_step(seq_ids)` names the sequence of each token (the admission
   gate: False when the free cells are too few);
2. the first layer served calls `place_step(layer, positions)`: the cells come
   from the `kvlayout_choose_cells` hook and are claimed all together;
3. every later layer reuses that placement; the CellStep (cells + mask) is
   built once per distinct window and announced through
   `kvlayout_step_placed`, then shared by every layer with that window.

A step stays valid while the table's epoch is the one placement left: any verb
(seq_new, seq_clone, seq_rm, clear) ends it, and so does a new declaration.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import numpy as np

from kvlayout.errors import ConfigError, SequenceError, StepError
from kvlayout.faces import CellStep
from kvlayout.args import int_array, int_scalar
from kvlayout_cell.table import CellTable


@attrs.define(eq=False)
class _Placed:
    """A placed step: its tokens, their cells and which layers have been served."""

    seq_ids: np.ndarray
    positions: np.ndarray
    cells: np.ndarray
    read_len: int
    epoch: int
    served: set[int]
    steps: dict[int, CellStep]  # window -> memoized step
    before: tuple = ()  # the table's summaries from before the placement, for abort_step
    built: set[int] = attrs.Factory(set)  # windows whose (lazy) mask has been built
    frozen: tuple | None = None  # the table's cells as the step saw them, kept once it moves on


@attrs.define(eq=False)
class _Declared:
    seq_ids: np.ndarray
    epoch: int


class CellStepper(CellTable):
    """A cell table that places steps for `len(windows)` layers (window 0 = flat)."""

    def __init__(self, capacity: int, max_seqs: int, windows: Sequence[int], pm: Any):
        super().__init__(capacity, max_seqs)
        self._windows = tuple(int_scalar("window", w, ConfigError, minimum=0) for w in windows)
        self._pm = pm
        self._declared: _Declared | None = None
        self._placed: _Placed | None = None

    @property
    def n_layers(self) -> int:
        return len(self._windows)

    def declare_step(self, seq_ids: Sequence[int]) -> bool:
        """Name the sequence of each token of the next forward.

        False (nothing changed, any previous step still standing) when fewer
        than len(seq_ids) cells are free. Raises for an empty list
        (StepError) or an id out of range or not live (SequenceError).
        On True the previous step ends, whether or not every layer was served.
        """
        ids = int_array("seq_ids", seq_ids, SequenceError)
        if ids.size == 0:
            raise StepError("declare_step: seq_ids is empty: expected at least one token's sequence id")
        self.check_live_ids(ids)
        if ids.size > self.free_cells:
            return False
        self._keep_masks()
        self._declared = _Declared(ids.copy(), self.epoch)
        self._placed = None
        return True

    def _before_change(self) -> None:
        self._keep_masks()

    def _open_step(self) -> _Placed | None:
        """The open step (see `abort_step`): placed, and no verb or declaration since; else None."""
        placed = self._placed
        return placed if placed is not None and placed.epoch == self.epoch else None

    def _keep_masks(self) -> None:
        """The open step ends: if a mask of it was never built, keep what building it reads.

        A copy of positions and owner words up to the step's read_len (O(used_end) memcpy, far
        less than a [T, used_end] mask), so a consumer that reads `step.mask` late still gets the
        step's mask, not one of the table as it is by then.
        """
        placed = getattr(self, "_placed", None)  # CellTable.clear touches before __init__ sets it
        if placed is None or placed.frozen is not None or placed.epoch != self.epoch:
            return
        if len(placed.built) < len(placed.steps):
            placed.frozen = self.snapshot()

    def place_step(self, layer: int, positions: Sequence[int]) -> CellStep:
        """The step for `layer`: placed by the first layer served, reused by the others.

        StepError (nothing changed; a standing declaration stays for a
        corrected retry) for a layer out of range or already served, a step
        with no declaration, a token count differing from it, a position not
        newer than its sequence holds, or a bad `kvlayout_choose_cells` answer.
        """
        layer = int_scalar("layer", layer, StepError, minimum=0)
        if layer >= self.n_layers:
            raise StepError(f"layer={layer}: expected a layer in [0, {self.n_layers})")
        pos = int_array("positions", positions, StepError)
        placed = self._open_step()
        if placed is not None:
            if layer in placed.served:
                raise StepError(
                    f"layer {layer} was already served in this step: expected each layer once "
                    "per step; declare_step the next forward first"
                )
            if not np.array_equal(pos, placed.positions):
                raise StepError(
                    f"layer {layer}: positions {pos.tolist()!r:.80} differ from the step's "
                    f"{placed.positions.tolist()!r:.80}, placed by an earlier layer"
                )
            placed.served.add(layer)
            return self._step(placed, self._windows[layer])
        declared = self._declared if self._declared is not None and self._declared.epoch == self.epoch else None
        if declared is None:
            why = " (a verb since the last declaration ended that step)" if self._declared or self._placed else ""
            raise StepError(f"layer {layer}: no step declared{why}; expected declare_step(seq_ids) first")
        if pos.size != declared.seq_ids.size:
            raise StepError(
                f"layer {layer}: {pos.size} position(s) for a step declared with "
                f"{declared.seq_ids.size} token(s)"
            )
        self.check_tokens(declared.seq_ids, pos)
        cells = self._choose(pos.size)
        before = self.before_occupy(declared.seq_ids)
        self.occupy(cells, declared.seq_ids, pos)  # the only mutation; everything above may refuse
        placed = _Placed(declared.seq_ids, pos.copy(), cells, self.used_end, self.epoch, {layer}, {}, before)
        self._placed, self._declared = placed, None
        return self._step(placed, self._windows[layer])

    def abort_step(self) -> bool:
        """Undo the open step, as if it had never been placed; False when none is open.

        The open step is the one the first `place_step` after a declaration
        placed, served on every layer or not, until a new declaration or any
        verb (`seq_new`, `seq_clone`, `seq_rm`, `clear`, `load_seq`) ends it.
        Aborting it releases exactly the cells it claimed and puts back every
        sequence's `seq_len` and `next_pos`, the free count, `used_end` and
        the free list. Afterwards no declaration stands: declare the next
        forward again. With no open step nothing changes (a standing
        declaration that was never placed stays) and the answer is False.

        The pools are not rolled back: the layers that ran before a failure
        wrote K/V into the released cells, which are free again, so their
        content is dead, overwritten before any mask lets it be read.
        Every window announced through `kvlayout_step_placed` is then
        announced through `kvlayout_step_aborted`.
        """
        placed = self._open_step()
        if placed is None:
            return False
        self._keep_masks()
        self._placed = self._declared = None
        self.release(placed.cells, placed.seq_ids, placed.before)
        for window, step in placed.steps.items():  # those announced by kvlayout_step_placed
            self._pm.hook.kvlayout_step_aborted(step=step, window=window)
        return True

    def _choose(self, count: int) -> np.ndarray:
        """`count` distinct free cells from the hook; StepError quoting a bad answer."""
        free = self.free_list()
        answer = self._pm.hook.kvlayout_choose_cells(free=free, count=count)
        expected = f"expected {count} distinct cells from the free list"
        if answer is None:
            raise StepError(f"kvlayout_choose_cells: no plugin answered; {expected}")
        try:
            cells = np.asarray(answer)
        except Exception:
            cells = np.asarray([])
        ok = (
            cells.ndim == 1
            and cells.size == count
            and (count == 0 or (np.issubdtype(cells.dtype, np.integer) and cells.dtype != np.bool_))
        )
        if ok:
            cells = cells.astype(np.int64)
            ok = np.unique(cells).size == count and self.are_free(cells)
        if not ok:
            raise StepError(f"kvlayout_choose_cells answered {answer!r:.120}: {expected}")
        return cells

    def _step(self, placed: _Placed, window: int) -> CellStep:
        step = placed.steps.get(window)
        if step is None:

            def mask() -> np.ndarray:  # [T, read_len], built on first access: grouped attention never reads it
                # Read after the step ended, it comes from the cells as the step saw them (`_keep_masks`).
                m = self.visible(placed.seq_ids, placed.positions, window, placed.cells, placed.frozen)
                m.flags.writeable = False  # shared by every layer with this window, and by observers
                placed.built.add(window)
                return m

            cells = placed.cells.astype(np.int32)
            cells.flags.writeable = False
            step = CellStep(length=placed.cells.size, read_len=placed.read_len, cells=cells, mask=mask)
            placed.steps[window] = step
            self._pm.hook.kvlayout_step_placed(step=step, window=window)
        return step


def lowest_free(free: np.ndarray, count: int) -> np.ndarray:
    """The default placement: the lowest free cells, so a freed cell refills before the table grows."""
    return free[:count]
