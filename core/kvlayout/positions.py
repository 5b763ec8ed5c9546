"""A forward's positions, checked once for every layer it serves.

`update_and_fetch(layer, positions, k, v)` takes the step's positions at
every layer, and a layout must refuse bad ones by name before it changes
anything. Checking them again at each layer costs host time that a small
model's step cannot hide (on an Apple GPU a decode step of a 135M model is a
few milliseconds, and the graph the host builds comes on top). A model
therefore makes one `StepPositions` per forward and hands that same object to
every layer: a layout accepts it wherever it accepts a list or an array, and
takes what it already holds true (integers, int64, whether they run
consecutively) as checked. What depends on the layout's own state (a
position not newer than its sequence holds, a gap) is still the layout's to
check, once per step.

Numpy only: the neutral bookkeeping of a layout reads it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlayout.checks import int_array
from kvlayout.errors import StepError


class StepPositions:
    """`positions` checked as integers (StepError naming `positions` otherwise) and frozen.

    - `host`: int64 `[T]`, read-only for good: a view of a read-only array this
      object alone made, so neither the caller's list nor anyone holding `host`
      can change what the layers after the first see (numpy refuses to make a
      view of a read-only base writable).
    - `first`: the first position (None for an empty step).
    - `consecutive`: the positions are first, first + 1, ... (True for one).
    """

    __slots__ = ("host", "first", "consecutive")

    def __init__(self, positions: Any):
        host = int_array("positions", positions, StepError)  # [T] int64
        if not isinstance(positions, (list, tuple, range)):  # an array's may share its memory: ours is a copy
            host = host.copy()
        self.host = frozen(host)
        size = host.size
        self.first = int(host[0]) if size else None
        # Consecutive: the last is size - 1 past the first and every step is 1 (one position always is).
        self.consecutive = size == 1 or (size > 1 and int(host[-1]) - self.first == size - 1
                                         and bool((np.diff(host) == 1).all()))

    @property
    def size(self) -> int:
        return self.host.size

    def __len__(self) -> int:
        return self.host.size

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # What numpy reads of it (np.asarray, int_array): the frozen host array.
        return self.host if dtype is None else self.host.astype(dtype)

    def __repr__(self) -> str:
        return f"StepPositions({self.host.tolist()!r:.80})"


def frozen(owned: np.ndarray) -> np.ndarray:
    """`owned` (an array nobody else holds) as a view no one can write or make writable again: numpy
    refuses WRITEABLE to a view of a read-only base, so what is handed out stays as it was made."""
    owned.flags.writeable = False
    return owned[:]


def step_positions(positions: Any) -> StepPositions:
    """`positions` as StepPositions: itself when it is one (checked already), else checked now."""
    return positions if isinstance(positions, StepPositions) else StepPositions(positions)
