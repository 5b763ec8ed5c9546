"""The one interface every engine implements, whoever drives it.

The runner drives an engine to the end (`run`); a server submits requests
while it runs (`add`) and interleaves its own work between steps (`step`).
Saving and resuming go through `state()` / `restore()`: plain JSON in, plain
JSON out, so whoever writes the files never looks inside an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvlayout.engines.records import Request

Stop = Callable[[], bool]  # asked before every step: True ends the run there


@runtime_checkable
class Engine(Protocol):
    """Generates the samples of its requests through one cache, one step at a time.

    A step is one forward of the model, with whatever the engine does around
    it (admitting, preempting, retrying a failed forward; see each engine).
    Between two steps the engine and its cache agree, so `state()` taken
    there, with the cache saved beside it, can be put back by `restore`.
    """

    @property
    def has_work(self) -> bool:
        """True while a sample of an added request is unfinished."""
        ...

    def add(self, requests: Sequence[Request]) -> None:
        """Queue the unfinished samples of `requests`, behind what is queued; allowed between any two steps."""
        ...

    def step(self) -> bool:
        """Take one step of the queued work; False, having done nothing, when there is none."""
        ...

    def run(self, stop: Stop | None = None) -> bool:
        """Step until no work is left: True. `stop()`, asked before every step
        while work is left, ends the run early between two steps: False."""
        ...

    def cancel(self, request: Request) -> None:
        """End `request`'s unfinished samples now, between two steps, with finish_reason
        "cancelled" (`on_token` hears each, token None): its queued work is dropped and the
        cells only it held are freed; what other sequences share stays. A request with nothing
        unfinished is left as it is."""
        ...

    def settle(self) -> None:
        """Read the tokens still in flight (drawn on the device, engines.ahead), recording them
        as a step would: afterwards the samples and `state()` are what the host path gives.
        `run()` settles before it returns; a driver of `step()` settles before it reads the
        samples whole (to save them, say). Nothing in flight: nothing happens."""
        ...

    def state(self) -> dict:
        """The engine's own state as plain JSON (what it holds of its requests, by index); what
        is in flight is settled first."""
        ...

    def restore(self, state: dict, requests: Sequence[Request]) -> None:
        """Continue from `state` (taken by `state()` of the same kind of engine) over `requests`,
        whose samples already hold what they held then; the cache must be the one saved with it.

        Replaces any queued work: `run()` or `step()` then carries on where the
        saved run stopped. StateError, changing nothing, when `state` is another
        engine's, is not what `state()` gives for these requests, or disagrees
        with the cache; its message starts with the field's path in `state`
        (`running[0].cached`), read with `engines.saved`.
        """
        ...


def run_steps(engine: Engine, stop: Stop | None = None) -> bool:
    """`Engine.run` in terms of `has_work` and `step`: one loop for every engine."""
    while engine.has_work:
        if stop is not None and stop():
            engine.settle()
            return not engine.has_work  # what was in flight may have finished the last sample
        engine.step()
    return True
