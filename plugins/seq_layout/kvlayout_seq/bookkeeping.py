"""The seq layout's neutral bookkeeping: integers and numpy only, no tensors, no MLX.

One logical `length` for the whole model. Each layer maps positions to pool
slots through a policy:

- flat: position p lives in slot p; a step writes one run at its start and
  reads one run `[0, end)`.
- ring: position p lives in slot `p % slots`, `slots = window + max_write - 1`,
  so the `window - 1` keys a step needs from before its start survive its own
  write of up to `max_write` tokens. Write runs split in two where they wrap.
  A ring that can wrap is kept twice (`mirror`): slot `s + slots` repeats slot
  s, so the window a step reads, wrapped or not, is one run of `[0, 2 slots)`,
  a view of the pool rather than a copy of the window per step.

Layers with the same (kind, window) share one policy object, hence one record
of what their rings still hold.

Invariants kept by every verb:
- `0 <= floor <= length <= capacity`, where `floor` is the smallest length a
  rewind may return to;
- once every layer of a forward is served, a ring policy's slots hold every
  position in `[retained, length)` (`retained` only moves forward, until
  `clear`), so `floor` is where a next step still finds its whole window.

Planning is pure; `commit` is the only step verb that changes state, and it is
idempotent so every layer of one forward may commit the same step.

No state holds a step some layers never wrote: while a forward is half done
(the open step, see `commit`), a rewind that would keep a position of it,
and a new step that starts past it, are refused (StepError, nothing
changed); a new step starting at or below it (a re-feed) rewrites it, and
`clear`/`rewind(0)` forget it with the rest.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from kvlayout.checks import int_scalar
from kvlayout.errors import CapacityError, KVLayoutError, StepError
from kvlayout.spec import MaskKind


class Run(NamedTuple):
    """A contiguous range of pool slots: `length` slots from `slot`. A named tuple: a forward's first layer
    makes a step's runs every step, and a tuple is made in a fraction of a frozen attrs record's time."""

    slot: int
    length: int


class SeqStepPlan(NamedTuple):
    """Where one layer of a seq-layout step writes and what it reads.

    `writes` receive the step's tokens in order; `reads` hold the keys visible
    to the step, oldest first, starting at logical position `read_start`.
    `mirror` (> 0) asks for every write run to be written again `mirror` slots
    further (a ring kept twice over, so that its window, wrapped or not, is
    one run of `reads`). Planning is pure: a plan changes nothing until it is
    committed. A named tuple, as `Run` is: immutable, made every step.
    """

    start: int
    length: int
    writes: tuple[Run, ...]
    reads: tuple[Run, ...]
    read_start: int
    mask_kind: MaskKind
    window: int = 0
    mirror: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def read_len(self) -> int:
        return sum(run.length for run in self.reads)


def band_mask(length: int, read_len: int, window: int) -> np.ndarray:
    """Bool `[length, read_len]`, True = attend: the last `length` keys are the queries.

    Query i sits at key index `read_len - length + i` and sees keys j with
    `j - i` in `[read_len - length - window + 1, read_len - length]`.
    """
    offset = read_len - length
    d = np.arange(read_len)[None, :] - np.arange(length)[:, None]  # [T, S]: j - i
    return (d <= offset) & (d >= offset - window + 1)


class FlatPolicy:
    """All history: slot == position."""

    kind = "flat"
    window = 0
    mirror = 0

    def __init__(self, capacity: int):
        self.slots = capacity
        self.max_write = capacity

    @property
    def storage(self) -> int:
        """Slots the layer's pools hold."""
        return self.slots

    @property
    def floor(self) -> int:
        return 0

    def plan(self, start: int, length: int) -> SeqStepPlan:
        end = start + length
        return SeqStepPlan(
            start=start,
            length=length,
            writes=(Run(start, length),),
            reads=(Run(0, end),),
            read_start=0,
            mask_kind=MaskKind.NONE if length == 1 else MaskKind.CAUSAL,
        )

    def commit(self, end: int) -> None:
        pass

    def clear(self) -> None:
        pass


class RingPolicy:
    """A sliding window over `window + max_write - 1` recycled slots.

    When the capacity is smaller than that, `capacity` slots suffice: no
    position ever reaches the wrap, and the ring is a flat layer with a band.
    """

    kind = "ring"

    def __init__(self, window: int, max_write: int, capacity: int):
        self.window = window
        self.max_write = max_write
        self.slots = min(window + max_write - 1, capacity)
        # Kept twice when a position can wrap, so reads never join two runs: a wrapped window
        # read as two runs costs a copy of the whole window every step (~7 ms at 4k on a CPU),
        # the mirror one more slice write per run.
        self.mirror = self.slots if self.slots < capacity else 0
        self.retained = 0  # the oldest position whose slot no later write reused

    @property
    def storage(self) -> int:
        """Slots the layer's pools hold: the ring, and its mirror."""
        return self.slots + self.mirror

    @property
    def floor(self) -> int:
        """The smallest length from which a next step still finds its window."""
        return 0 if self.retained == 0 else self.retained + self.window - 1

    def _runs(self, first: int, count: int) -> tuple[Run, ...]:
        slot = first % self.slots
        head = min(count, self.slots - slot)
        if head == count:
            return (Run(slot, count),)
        return (Run(slot, head), Run(0, count - head))

    def plan(self, start: int, length: int) -> SeqStepPlan:
        end = start + length
        read_start = max(0, start - self.window + 1)
        read_len = end - read_start  # <= window - 1 + max_write == slots: one lap at most
        if length == 1:
            kind = MaskKind.NONE
        elif read_len > self.window:
            kind = MaskKind.EXPLICIT
        else:
            kind = MaskKind.CAUSAL
        # One run, always: with a mirror, slots [s, s + read_len) hold the window in order even past
        # the wrap; without one (slots == capacity) no position reaches the wrap.
        reads = (Run(read_start % self.slots, read_len),)
        return SeqStepPlan(
            start=start,
            length=length,
            writes=self._runs(start, length),
            reads=reads,
            read_start=read_start,
            mask_kind=kind,
            window=self.window,
            mirror=self.mirror,
        )

    def commit(self, end: int) -> None:
        # Writing up to `end` reused the slots of positions below `end - slots`.
        self.retained = max(self.retained, end - self.slots)

    def clear(self) -> None:
        self.retained = 0


class _OpenStep:
    """The step `abort_step` would undo: its range, the length and ring records from before it,
    and the layers that committed it (hence wrote it)."""

    def __init__(self, start: int, length: int, retained: list[int], source: Any = None):
        self.start, self.length, self.retained = start, length, retained
        self.source = source  # the positions object its first layer was checked with (see serve_again)
        self.served: set[int] = set()
        self.plans: dict[int, SeqStepPlan] = {}  # id(policy) -> its plan of this step, for its later layers


class SeqBook:
    """The length and per-layer policies of one sequence; no tensors.

    `policies` is one entry per layer, `(kind, window)` pairs; `max_write`
    bounds one step on a ring layer (None: each ring layer's own window).
    """

    def __init__(self, capacity: int, policies: list[tuple[str, int]], max_write: int | None = None):
        self.capacity = int_scalar("capacity", capacity, KVLayoutError, minimum=1)
        if not policies:
            raise KVLayoutError("policies: expected one (kind, window) per layer, got none")
        if max_write is not None:
            max_write = int_scalar("max_write", max_write, KVLayoutError, minimum=1)
        shared: dict[tuple[str, int], FlatPolicy | RingPolicy] = {}
        for kind, window in policies:
            if (kind, window) in shared:
                continue
            if kind == "flat":
                shared[kind, window] = FlatPolicy(self.capacity)
            elif kind == "ring":
                window = int_scalar("window", window, KVLayoutError, minimum=1)
                shared[kind, window] = RingPolicy(window, max_write or window, self.capacity)
            else:
                raise KVLayoutError(f"policy kind {kind!r}: expected flat or ring")
        self.layers = [shared[p] for p in policies]
        self.policies = list(shared.values())
        self._all_flat = all(p.kind == "flat" for p in self.policies)
        # Every layer of a forward gets the same step, so the tightest ring bounds
        # it at every layer: a step no ring can take is refused at the first layer,
        # before any layer has written it.
        self._tightest = min(self.policies, key=lambda p: p.max_write)
        self.max_step = self._tightest.max_write
        self.length = 0
        self._open: _OpenStep | None = None  # the step abort_step would undo

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def floor(self) -> int:
        """The smallest length `rewind` accepts: the highest over rings, 0 with none.

        A ring of window w holding positions from r on can serve a next step
        from `r + w - 1` on; after contiguous writes past its first lap that is
        `length - max_write`, i.e. `length - w` with max_write unset.
        """
        if self._all_flat:  # no ring: nothing is ever lost below the length
            return 0
        return max((p.floor for p in self.policies), default=0)

    def can_extend(self, n: int = 1) -> bool:
        if type(n) is int and n >= 0:  # the usual count, settled at once (asked every step)
            return self.length + n <= self.capacity
        return self.length + int_scalar("n", n, StepError, minimum=0) <= self.capacity

    def check_layer(self, layer: Any) -> int:
        if type(layer) is int and 0 <= layer < len(self.layers):  # the usual index, settled at once
            return layer
        return int_scalar("layer", layer, StepError, 0, self.n_layers - 1)

    def plan(self, layer: int, start: int, length: int) -> SeqStepPlan:
        """Where layer `layer` writes tokens `[start, start + length)` and what it reads.

        Pure. Refuses (StepError / CapacityError) a layer out of range, an
        empty step, a negative start, a gap after `length`, a start older than
        a ring still holds, an end past `capacity`, a step longer than a
        ring layer's `max_write` (on every layer: see `max_step`), or a new
        step starting past one a forward left half written (see `open_step`).
        Every check but the layer index reads only model-wide state, so a
        step is refused at a forward's first layer or not at all.
        """
        if (self._open is None and type(layer) is int and 0 <= layer < len(self.layers) and start == self.length
                and 1 <= length <= self.max_step and start + length <= self.capacity):
            # An append between forwards (every decode step): each check below holds, the floor being at
            # most the length. Settled at once: a forward's first layer plans it every step.
            return self.layers[layer].plan(start, length)
        layer = self.check_layer(layer)
        later = self.serve_later(layer, start, length)  # a later layer of the forward that opened the step
        if later is not None:
            return later
        step = self._open
        if step is not None and start > step.start and not self._continues(step, layer, start, length):
            raise StepError(
                f"positions start at {start}, past the step at {step.start} that layer(s) "
                f"{self._unwritten(step)} have not written: finish that forward, re-feed it from "
                f"{step.start} or below, or abort_step() first"
            )
        if start < 0:
            raise StepError(f"positions start at {start}: expected positions >= 0")
        if length < 1:
            raise StepError(f"a step of {length} token(s) at layer {layer}: expected at least 1")
        if start > self.length:
            raise StepError(
                f"positions start at {start} but the cache holds {self.length}: "
                f"a step must start at or below the length (no gap)"
            )
        if start < self.floor:
            raise StepError(
                f"positions start at {start}, older than a ring layer still holds: "
                f"expected a start in [{self.floor}, {self.length}]"
            )
        if start + length > self.capacity:
            raise CapacityError(
                f"a step of {length} token(s) at position {start} ends at {start + length}, "
                f"past capacity={self.capacity}"
            )
        if length > self.max_step:
            ring = self._tightest
            raise StepError(
                f"a step of {length} token(s) at layer {layer}: expected at most "
                f"max_write={ring.max_write} (the ring layers of window {ring.window} take no more)"
            )
        return self.layers[layer].plan(start, length)

    def serve_later(self, layer: int, start: int, length: int) -> SeqStepPlan | None:
        """The plan of `layer` (an index in range) when it serves the open step as a later layer of its
        forward, `[start, start + length)` again; else None (`plan` then checks the step whole).

        Pure, and what `plan` would answer: the checks that read model-wide state passed at the
        forward's first layer and read the same state now, and layers of one policy share its plan.
        """
        step = self._open
        if step is None or not self._continues(step, layer, start, length):
            return None
        return self._plan_of(step, layer)

    def serve_again(self, layer: Any, source: Any) -> SeqStepPlan | None:
        """The plan of `layer` when it serves the open step as a later layer of the forward whose
        first layer committed it with this very `source` (its positions object, compared by
        identity: a frozen StepPositions cannot have changed since); else None, and `plan` checks
        the step whole. `layer` must be a plain int in range that has not served the step: what
        `plan` would answer for it then, without checking again what the first layer checked."""
        step = self._open
        if (step is None or source is None or source is not step.source or type(layer) is not int
                or not 0 <= layer < len(self.layers) or layer in step.served):
            return None
        return self._plan_of(step, layer)

    def _plan_of(self, step: _OpenStep, layer: int) -> SeqStepPlan:
        """Layer `layer`'s plan of the open `step`: its policy's, planned once for all its layers."""
        policy = self.layers[layer]
        plan = step.plans.get(id(policy))
        if plan is None:
            plan = step.plans[id(policy)] = policy.plan(step.start, step.length)
        return plan

    def served_again(self, layer: int) -> None:
        """`layer`, whose plan `serve_again` just answered, wrote the open step: what `commit` records of a
        later layer of the forward (the step closes with its last layer), without checking again that it is
        one. Call nothing in between that could change the book."""
        self._served(self._open, layer)

    def _served(self, step: _OpenStep, layer: int) -> None:
        """`layer` wrote `step`; the step closes with its last layer (a forward every layer wrote is complete)."""
        step.served.add(layer)
        if len(step.served) == len(self.layers):
            self._open = None

    def commit(self, plan: SeqStepPlan, layer: int | None = None, source: Any = None) -> None:
        """Set the length to the step's end; every ring records the slots it reused.

        Idempotent: committing the same step again changes nothing, so every
        layer of a forward commits. Rings record the reuse at the first commit,
        before their own layers are written: that only makes the floor
        conservative in between. A step that starts below the length
        truncates to its end, as `rewind` would.

        `layer` (the layer that wrote the step) opens a step for `abort_step`
        at the first commit of a new step: one with another (start, length),
        or a layer this step already committed. The commit of its last layer
        closes it: a forward every layer wrote is complete. (The seq layout
        has no declaration, so this is what keeps a forward that fails before
        its first layer from undoing the forward before it.) `source`: the positions object the
        step's first layer was checked with, for its later layers (`serve_again`).
        """
        if layer is not None:
            step = self._open
            later = step is not None and self._continues(step, layer, plan.start, plan.length)
            if not later:
                retained = [getattr(p, "retained", 0) for p in self.policies]
                step = self._open = _OpenStep(plan.start, plan.length, retained, source)
                step.plans[id(self.layers[layer])] = plan  # its later layers of the same policy share it
            self._served(step, layer)
            if later:  # the step's first commit already moved the length and the rings' records to its end
                return
        for policy in self.policies:
            policy.commit(plan.end)
        self.length = plan.end

    def rewind(self, new_len: int) -> bool:
        """Truncate to `new_len`; False (nothing changes) past `length` or below `floor`.

        Rewinding to 0 needs no position a ring may have lost, so it always
        succeeds: it is `clear()`, which also forgets what the rings reused.
        While a forward is half done, a rewind past its start would keep
        positions some layers never wrote: StepError, nothing changed (one
        to its start or below ends it).
        """
        new_len = int_scalar("new_len", new_len, StepError, minimum=0)
        if new_len == 0:
            self.clear()
            return True
        step = self._open
        if step is not None and new_len > step.start:
            raise StepError(
                f"rewind(new_len={new_len}) during a forward: layer(s) {self._unwritten(step)} have not "
                f"written the step at {step.start}; finish the forward, abort_step(), or rewind to "
                f"{step.start} or below"
            )
        if new_len > self.length or new_len < self.floor:
            return False
        self.length = new_len
        self._open = None
        return True

    def clear(self) -> None:
        for policy in self.policies:
            policy.clear()
        self.length = 0
        self._open = None

    def open_step(self) -> tuple[int, list[int]] | None:
        """(start, layers not yet written) of the step a forward has begun and not finished
        (the one `abort_step` would undo); None between forwards."""
        step = self._open
        return None if step is None else (step.start, self._unwritten(step))

    def _unwritten(self, step: _OpenStep) -> list[int]:
        return sorted(set(range(self.n_layers)) - step.served)

    @staticmethod
    def _continues(step: _OpenStep, layer: int, start: int, length: int) -> bool:
        """Whether `layer` writing `[start, start + length)` serves the open `step` (else it begins
        another: a re-feed from the same start included, when `layer` already wrote this one)."""
        return (step.start, step.length) == (start, length) and layer not in step.served

    def abort_step(self) -> bool:
        """Return to where the open step began; False (nothing changes) when none is open.

        The open step runs from the first layer that commits it (see
        `commit`) until its last layer commits it (the forward is complete),
        another step commits, or `rewind` or `clear` ends it.
        Aborting sets the length to the step's start, which is the length
        before it for a step that appended. A step that overwrote below the
        length (start < length) loses the positions it overwrote: the layers
        that ran wrote them anew, the others did not, so what survives is
        `[0, start)`, in every layer.

        A ring none of whose layers ran gets its record back; a ring whose
        layers ran keeps the record of what they overwrote, so `floor` may
        stay above where it was (never above the start: a step carries at
        most max_write tokens, and the slots a ring recycles hold positions
        older than the window the next step needs). The pools are not
        rolled back: what lies past the length is overwritten before it is
        read, and what a ring overwrote is below the floor.
        """
        step = self._open
        if step is None:
            return False
        self._open = None
        written = {id(self.layers[layer]) for layer in step.served}
        for policy, retained in zip(self.policies, step.retained):
            if policy.kind == "ring" and id(policy) not in written:
                policy.retained = retained
        self.length = step.start
        return True
