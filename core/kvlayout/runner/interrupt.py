"""Ctrl-C during `kvlayout run --save-state`: the first one stops the run after its step."""

from __future__ import annotations

import signal
import sys
from typing import Any


class StopOnCtrlC:
    """While active, the first Ctrl-C asks the run to stop after its current step
    (the state is then saved); a second one interrupts at once, as usual.

    Call it (`stop()`) to ask whether a Ctrl-C came. Only the main thread can
    install a signal handler; elsewhere this never stops anything.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __call__(self) -> bool:
        return self.requested

    def handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        print("\nkvlayout: stopping after this step to save the state (Ctrl-C again to quit now)", file=sys.stderr)

    def __enter__(self) -> StopOnCtrlC:
        try:
            self._previous = signal.signal(signal.SIGINT, self.handle)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
