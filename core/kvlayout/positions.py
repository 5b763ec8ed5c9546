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

import sys
from typing import Any

import numpy as np

from kvlayout.checks import INT64_MAX, frozen_ints, int_array
from kvlayout.errors import StepError


class StepPositions:
    """`positions` checked as integers (StepError naming `positions` otherwise) and frozen.

    - `host`: int64 `[T]`, read-only for good: a copy over immutable memory
      (`frozen`), so neither the caller's list nor anyone holding `host` can
      change what the layers after the first see; nor can any attribute be set.
      It reads as a sequence too (`len`, iteration, indexing, `tolist`), as the
      `update_and_fetch` contract's `Sequence[int]` does.
    - `listed`: the same positions as a tuple of Python ints, for a layout that settles a decode
      step's few in Python (made on first read unless given a list).
    - `first`: the first position (None for an empty step).
    - `consecutive`: the positions are first, first + 1, ... (True for one).
    """

    __slots__ = ("_host", "_listed", "first", "consecutive", "size")

    def __init__(self, positions: Any):
        run = type(positions) is range and positions.step == 1
        if run and positions.stop - positions.start > sys.maxsize:  # len() itself would overflow
            raise StepError(f"positions: {positions!r} holds {positions.stop - positions.start} positions: "
                            f"expected at most {sys.maxsize}")
        if run and -INT64_MAX <= positions.start <= positions.stop <= INT64_MAX:
            # A run of integers by construction (what an engine feeds one sequence), every one fitting in 64 bits:
            # nothing to check, and `host` is made only if someone reads it (a seq layout's step never does).
            size = len(positions)
            host, first, consecutive = None, positions.start if size else None, size > 0
            listed = None
        elif (host := frozen_ints(positions)) is not None:
            # A few Python ints (an engine's decode step): frozen in one numpy call, checked in Python.
            size = len(positions)
            listed = tuple(positions)  # the ints frozen_ints checked: a copy no caller can change
            first = positions[0] if size else None
            consecutive = size == 1 or (size > 1 and positions[-1] - first == size - 1
                                        and all(b - a == 1 for a, b in zip(positions, positions[1:])))
        else:
            host = frozen(int_array("positions", positions, StepError))  # [T] int64, a copy of our own
            size, listed = host.size, None
            first = int(host[0]) if size else None
            # Consecutive: the last is size - 1 past the first and every step is 1 (one position always is).
            consecutive = size == 1 or (
                size > 1 and int(host[-1]) - first == size - 1 and bool((np.diff(host) == 1).all()))
        _set = object.__setattr__
        _set(self, "_host", host)
        _set(self, "_listed", listed)
        _set(self, "first", first)
        _set(self, "consecutive", consecutive)
        _set(self, "size", size)

    def __setattr__(self, name: str, value: Any) -> None:
        # A later layer trusts what the first checked (compared by identity): nothing may change it.
        raise AttributeError(f"StepPositions is frozen: {name} cannot be set")

    @property
    def host(self) -> np.ndarray:
        """The positions, int64 `[T]`, read-only for good (made on first read for a run from a range)."""
        host = self._host
        if host is None:
            host = frozen(np.arange(self.first or 0, (self.first or 0) + self.size, dtype=np.int64))
            object.__setattr__(self, "_host", host)
        return host

    @property
    def listed(self) -> tuple[int, ...]:
        """The positions as a tuple of Python ints (made on first read when not given as a list)."""
        listed = self._listed
        if listed is None:
            listed = tuple(self.host.tolist())
            object.__setattr__(self, "_listed", listed)
        return listed

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(self.host.tolist())

    def __getitem__(self, index: Any) -> Any:
        return self.host[index]

    def tolist(self) -> list[int]:
        return self.host.tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # What numpy reads of it (np.asarray, int_array): the frozen host array, or a copy when asked.
        if copy or (dtype is not None and np.dtype(dtype) != self.host.dtype):
            return self.host.astype(self.host.dtype if dtype is None else dtype)
        return self.host

    def __repr__(self) -> str:
        return f"StepPositions({self.host.tolist()!r:.80})"


def frozen(array: np.ndarray) -> np.ndarray:
    """A copy of `array` no one can write or make writable again: its memory is an immutable bytes
    object (numpy refuses WRITEABLE to an array over read-only memory, its base included), so what is
    handed out stays as it was made."""
    return np.frombuffer(array.tobytes(), dtype=array.dtype).reshape(array.shape)


def step_positions(positions: Any) -> StepPositions:
    """`positions` as StepPositions: itself when it is one (checked already), else checked now."""
    return positions if isinstance(positions, StepPositions) else StepPositions(positions)
