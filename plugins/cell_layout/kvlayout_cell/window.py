"""What a sliding-window layer group still needs of each sequence, and where it was cut.

The layers of one window w (a ring layer: query p sees positions p - w + 1 .. p)
have a table of their own (`kvlayout_cell.layer_groups`). Once a sequence's
newest position is n, its next query is at n + 1 or later, which reads
positions from n - w + 2 on; the group keeps one more, the last w positions
[n - w + 1, n], so taking the newest position back (a token drawn ahead that
turned out to end its sample) still leaves a whole window, as mlx-lm's
rotating cache of w slots does. Everything older is retired (`CellTable.retire`):
a cell no owner claims any more is free for another token.

A *pinned* sequence is not retired: a prompt the engine's prefix cache will
keep, so that a later request may part from it anywhere, as on a model without
windows. A clone of a pinned sequence takes all it holds below `upto` (and is
retired at the next declaration unless pinned too); a clone of any other, only
its last window there.

Where a sequence was cut is kept per id (`cut[s]`: the group no longer holds
s's positions below it; 0: it holds all it ever held). A sequence continued at
position u (one past its newest position below a clone's `upto` or a truncating
`seq_rm`'s `p0`: below a hole, less than them; `LayerGroups` says which) reads positions
u - w + 1 .. u - 1, so it can be continued only at u = 0 or u >= cut + w - 1 (its
floor); below that the keys are gone and the verb is refused, never answered
from a partial window.

Neutral: integers and numpy only.
"""

from __future__ import annotations

import numpy as np

from kvlayout.errors import SequenceError


class WindowKeeper:
    """The cuts of one window's table, and which ids moved on since the last retire."""

    def __init__(self, window: int, max_seqs: int):
        self.window = window
        self.cut = np.zeros(max_seqs, dtype=np.int64)  # [max_seqs]: positions below are gone, per id
        self.moved: set[int] = set()  # ids placed since the last retire: their window may have moved on
        self.pinned: set[int] = set()  # ids never retired (BatchControl.seq_pin)

    def clear(self) -> None:
        self.cut[:] = 0
        self.moved.clear()
        self.pinned.clear()

    def pin(self, seq_id: int, pinned: bool) -> None:
        if pinned:
            self.pinned.add(seq_id)
        elif seq_id in self.pinned:
            self.pinned.discard(seq_id)
            self.moved.add(seq_id)  # what it held whole goes at the next declaration

    def released(self, seq_id: int) -> None:
        """`seq_id` holds nothing any more: nothing cut, nothing pinned."""
        self.cut[seq_id] = 0
        self.pinned.discard(seq_id)
        self.moved.discard(seq_id)

    def floor(self, seq_id: int) -> int:
        """The least position but 0 at which `seq_id` can be continued (0: anywhere)."""
        cut = int(self.cut[seq_id])
        return cut + self.window - 1 if cut else 0

    def check_continue(self, verb: str, seq_id: int, at: int) -> None:
        """SequenceError when continuing `seq_id` at position `at` needs keys this window retired."""
        least = self.floor(seq_id)
        if 0 < at < least:
            w, cut = self.window, int(self.cut[seq_id])
            raise SequenceError(
                f"{verb}: sequence {seq_id} continued at position {at} needs positions {max(at - w + 1, 0)}.."
                f"{at - 1} in its window-{w} layers, which hold it from position {cut} on only (its last window "
                f"is kept); expected 0 or a position >= {least}"
            )

    def clone_since(self, src: int, upto: int | None, newest: int) -> int:
        """Where a clone of `src` up to `upto` (None: all, whose newest is `newest`) starts in this
        window: its last w positions, never below what src still holds; all src holds when pinned."""
        if src in self.pinned:
            return int(self.cut[src])
        last = newest if upto is None else min(upto - 1, newest)
        return max(int(self.cut[src]), last - self.window + 1, 0)

    def due(self, newest: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, cuts) of the ids in `ids` (live, with newest positions `newest`) holding more than
        their last window: what `CellTable.retire` drops."""
        cuts = newest - self.window + 1  # [N]: keep [newest - w + 1, newest]
        more = (cuts > self.cut[ids]) & ~np.isin(ids, list(self.pinned))
        return ids[more], cuts[more]
