"""One guarded forward: a failure part way through is undone in the cache before it propagates.

A forward writes K/V layer by layer, so an exception in layer k of n leaves
layers below k written for the step's cells and the others not. The engines
run every forward through `guarded_forward`, which then calls the cache's
`abort_step()` (the StepAbort face): the cache is back where it was before
the step, and the engine, which advances its own counters only after a
forward succeeds, is consistent with it. What the engines do next:

- engines.seq: the step is retried once; if it fails again the sample
  finishes with finish_reason "error" (its message in `Sample.error`) and
  the next sample runs.
- engines.cell: each sequence the step carried is retried once, alone; one
  whose retry fails too finishes with "error" (all its samples when it was a
  prompt still prefilling), its cells freed; the others carry on.

A plugin's fault is not transient: when the forward failed with a
`PluginError` (a placement policy's bad answer, an observer that raised,
named by the registry's guard), `ForwardFailed.retry` is False and every
sample the step carried finishes with "error" at once, the message naming
the plugin and the hook. An observer of the abort itself that raises
(`kvlayout_step_aborted`) is such a fault too; the abort still happened.

A `RunEnded` (a tensor-parallel rank whose peers are gone, or whose forward
failed: one rank cannot retry alone) is aborted the same way and raised as
it is: the run ends. A KeyboardInterrupt during a forward is aborted the
same way and comes out as `Interrupted`, which tells the caller the engine's state is whole and may
be saved (`kvlayout run --save-state`). Both exceptions live in `kvlayout.errors`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.errors import ForwardFailed, Interrupted, PluginError, RunEnded
from kvlayout.faces import StepAbort


def host_logits(logits: mx.array) -> np.ndarray:
    """The float32 logits `[R, V]` on the host: evaluating them is the step's sync point."""
    return np.array(logits.astype(mx.float32))


def guarded_forward(model: Any, cache: Any, tokens: Sequence[int] | mx.array, positions: Sequence[int],
                    rows: Sequence[int], read: Callable[[mx.array], Any] = host_logits) -> Any:
    """`read(logits)` of one forward's logits `[R, V]` (by default the float32 logits on the host).

    `tokens` may be a lazy mlx array (tokens drawn on the device, engines.ahead). `read` runs
    inside the guard: whatever it evaluates is evaluated before the forward counts as done.
    On an exception the cache's open step is aborted and ForwardFailed
    raised; on KeyboardInterrupt, aborted and Interrupted raised. A cache
    without the StepAbort face cannot be recovered: the exception propagates as is.
    """
    try:
        return read(model(tokens, positions, cache, rows=rows))
    except BaseException as exc:
        if not isinstance(cache, StepAbort):
            raise
        try:
            cache.abort_step()
        except PluginError as late:  # aborted all the same; an observer of the abort raised
            if isinstance(exc, Exception) and not isinstance(exc, PluginError):
                exc = late  # the plugin's fault is the one to report
        if isinstance(exc, KeyboardInterrupt):
            raise Interrupted() from exc
        if isinstance(exc, RunEnded):
            raise
        if isinstance(exc, Exception):
            raise ForwardFailed(exc) from exc
        raise
