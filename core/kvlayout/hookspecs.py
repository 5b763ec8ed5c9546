"""The hooks a kvlayout plugin may implement (pluggy project name "kvlayout").

Discovery: every layout plugin implements `kvlayout_builders`. The others
are the CellStepper seams a cell layout calls through the plugin manager, so a
third party can change where tokens land, or watch them land (and be taken
back), without forking the layout.

What the host does with a plugin that breaks these contracts
(`kvlayout.registry`): a plugin implementing a hook not listed here, or whose
`kvlayout_builders` fails, is skipped whole and shown under "failed" by
`kvlayout plugins`. Every implementation is called through a guard naming its
plugin, so a step hook that raises or answers wrongly refuses the step with a
`PluginStepError` (a StepError) naming the plugin, its distribution and the
hook, and the cell layout's state is as before the refused call. `kvlayout
run` does not retry a plugin's fault as a transient forward failure: the
samples the step carried end with "error", the reason is said once on stderr,
and the run exits 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pluggy

if TYPE_CHECKING:
    from kvlayout.builder import Builder
    from kvlayout.faces import CellStep

hookspec = pluggy.HookspecMarker("kvlayout")
hookimpl = pluggy.HookimplMarker("kvlayout")


@hookspec
def kvlayout_builders() -> list[Builder]:
    """Called once, when the plugin is registered.

    Return a list (any iterable) of the `Builder` records this plugin
    provides, one per `(backend_id, kind)`; `[]` for none. The registry tags
    each with the distribution that provided it and refuses to pick between
    two distributions that claim the same key. Raising, or returning None,
    a single Builder, anything but Builders, a Builder whose names cannot
    make a "backend:kind" key or whose build/load is not callable, or one key
    twice, skips the plugin (named in `kvlayout plugins` under "failed";
    resolving a key it was seen to claim says why). Its Builder's
    `build(config)` / `load(state_file)` raising (other than a KVLayoutError,
    the layout's refusal of a bad config) or returning None is a PluginError
    naming the layout and its distribution.
    """


@hookspec(firstresult=True)
def kvlayout_choose_cells(
    free: np.ndarray, count: int, seq_ids: np.ndarray, positions: np.ndarray, prev_cells: np.ndarray, window: int
) -> np.ndarray | None:
    """Called by a cell layout when the first layer of a step places its tokens
    (and when `load_seq` places a restored sequence's).

    `free` is the ascending int array of free cells (at least `count` of
    them); return `count` distinct cells taken from it, in token order, or
    None to let the next implementation decide. The first non-None answer
    wins.

    What a stateless policy needs to keep a sequence together, one entry per
    token (int64 `[count]`): `seq_ids[i]` is token i's sequence and
    `positions[i]` its position (a sequence's positions rise in token order);
    `prev_cells[i]` is the cell holding the newest position token i's
    sequence held before this step, or -1 when it held none. Every token of
    one sequence carries the same `prev_cells` value: where its 2nd..nth
    tokens go follows from the cells the policy gives its earlier ones. A
    fork shares its source's cells, so a fork and its source (both in the
    step) may carry the same previous cell. `load_seq` places a sequence
    under the id it is about to get, with every `prev_cells` -1.

    `window`: whose cells these are. A cell layout keeps a table of cells per
    layer group (kvlayout_cell.layer_groups): 0 for the flat layers', whose
    cells stay until a sequence drops them; w > 0 for the layers of sliding
    window w, whose cells are retired as soon as no sequence's window reaches
    them, and reused.

    pluggy lets an implementation take any subset of these arguments: one
    written for `(free, count)` is called with just those and still wins.

    The cell plugin's own answer is `trylast`, so any installed policy
    overrides it. It keeps each sequence in aligned pages of
    `kvlayout_cell.groups.PLACEMENT_PAGE` (128) cells of its own (in a
    window's table, of the least power of two covering the window when that
    is smaller: `kvlayout_cell.placement.page_for`), so the paged attention path
    reads them in place, in three passes:

    1. continue: a sequence whose previous cell is followed, within that
       cell's page, by free cells takes them for its first tokens (forks
       sharing a previous cell: the first in token order does);
    2. fresh pages: each sequence's other tokens, sequences in the order of
       their first token, fill pages all of whose cells are free, each from
       its first cell: the page right after the one its last cell is in
       when that page is (flat layers only: a window's retired pages are
       reused, so its tables stay as small as the windows they hold), else
       the lowest;
    3. fallback: tokens still without a cell (no such page left) take the
       lowest free cells left, in token order.

    Attention results never depend on the answer: masks key off positions
    and owners, never cell indices. The arrays are read-only. An answer that
    is not `count` distinct integers from `free`, or an implementation that
    raises, refuses the step (PluginStepError quoting the answer as a list);
    nothing is placed.
    """


@hookspec
def kvlayout_step_placed(step: CellStep, window: int) -> None:
    """Called once per distinct window each time a cell layout places a step
    (a restored sequence's placement by `load_seq` included).

    `step` is the placed `CellStep` (cells, mask) shared by every layer whose
    window is `window` (0 for flat layers). For observers (metrics, tracing,
    pictures); the return value is ignored and the step must not be changed
    (its arrays are read-only). An observer that raises refuses the step:
    every other observer still hears of it, the first failure is raised as a
    PluginStepError, and the placement is taken back (`kvlayout_step_aborted`
    for the refused window, the cells released when it was the step's first).
    """


@hookspec
def kvlayout_step_aborted(step: CellStep, window: int) -> None:
    """Called once per window announced by `kvlayout_step_placed` when that step is aborted.

    `abort_step()` (a forward that failed part way), or `clear()` called in
    the middle of a forward (which aborts the step first), released the step's
    cells: they are free again and no sequence holds its tokens. A placement
    policy or observer that keeps its own record of where tokens landed
    takes `step.cells` back out of it here. The return value is ignored. An
    observer that raises does not undo the abort: every window is still
    announced, then the first failure is raised as a PluginStepError.
    """
