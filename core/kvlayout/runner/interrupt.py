"""Ctrl-C during `kvlayout run --save-state`: the first one stops the run after its step,
and no Ctrl-C leaves a state half saved.

- `StopOnCtrlC`, around the run: the first Ctrl-C asks the run to stop after
  its current step (the state is then saved). A second one inside a forward
  interrupts it at once: the engine aborts the step (engines.recovery) and
  the state is saved as it was before it. Between forwards the step ends in
  moments anyway, so a second one there is only answered; a third quits
  wherever it lands, nothing of that step saved.
- `held_while_saving`, around a save: a Ctrl-C is held and answered, and the
  save goes on; a second one abandons it (KeyboardInterrupt inside the save,
  which leaves the previous state as it was and says so).

Only the main thread can install a signal handler; elsewhere neither does anything.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

from kvlayout.engines.recovery import guarded_forward


def in_forward(frame: FrameType | None) -> bool:
    """Is `frame` (where a signal landed) inside a model forward, which the engine can abort?"""
    while frame is not None:
        if frame.f_code is guarded_forward.__code__:
            return True
        frame = frame.f_back
    return False


def _say(line: str) -> None:
    print(f"\n{line}", file=sys.stderr, flush=True)


class StopOnCtrlC:
    """While active, the first Ctrl-C asks the run to stop after its current step (the state
    is then saved); a second one interrupts the forward under way, if one is; a third one
    interrupts wherever the run is.

    Call it (`stop()`) to ask whether a Ctrl-C came.
    """

    def __init__(self) -> None:
        self.presses = 0
        self._previous: Any = None

    @property
    def requested(self) -> bool:
        return self.presses > 0

    def __call__(self) -> bool:
        return self.requested

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.presses += 1
        if self.presses == 1:
            _say("kvlayout: stopping after this step to save the state (Ctrl-C again to stop at once)")
        elif self.presses > 2 or in_forward(frame):
            raise KeyboardInterrupt
        else:
            _say("kvlayout: the step is ending and the state will be saved (Ctrl-C again to quit without saving it)")

    def __enter__(self) -> StopOnCtrlC:
        try:
            self._previous = signal.signal(signal.SIGINT, self.handle)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


@contextlib.contextmanager
def held_while_saving(notice: str) -> Iterator[None]:
    """Around a save: the first Ctrl-C prints `notice` and the save goes on; a second raises
    KeyboardInterrupt where the save is (it is abandoned). The previous handler is back after."""
    presses = 0

    def hold(signum: int, frame: FrameType | None) -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            raise KeyboardInterrupt
        _say(notice)

    try:
        previous = signal.signal(signal.SIGINT, hold)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
