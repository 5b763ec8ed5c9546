"""Grouped attention for a sparse step: which tokens attend which cells, and whether to.

Neutral (numpy only). The dense explicit mask makes every token of a step
attend all `read_len` cells, though a token may only see cells its own
sequence owns. `plan_groups` groups the step's tokens by sequence (a long
run of one sequence's tokens split into query blocks, see `block_sizes`) and
gives each group the cells any of its tokens may see (the union of their mask
rows: its sequence's cells, within the window, up to its newest token), so
attention can gather each group's K/V and run one batched SDPA over the
groups instead (`kvlayout.mlx.attend_groups`). The cell layout plans the same
groups from its table (`plan_cells`: each sequence's cells by position, runs
found by binary search), so a grouped step never builds the dense mask.

The rule (`choose`), in query-key pairs, with G groups, Qg the most tokens of
a group and Kg the most cells a group sees (the batch is padded to both):

    grouped = G * Kg * (Qg + 1)      # padded SDPA, plus gathering G * Kg K/V rows
    dense   = T * read_len           # every token against every cell

When groups differ much in size (prompt blocks beside one-token decodes,
short prompts beside long ones) they run as several batches, each padded only
to its own widest (`batch_groups`); `grouped` is then summed over the batches,
plus BATCH_PAIRS for each batch after the first. The block size is the one
with the least `grouped` cost; then grouped wins iff `grouped < dense`. Gathering a row costs about what
attending one query to it does (a copy of the same bytes the SDPA reads), hence
the `+ 1`. So a decode step of N sequences over mostly private cells is
grouped (about N times less work), while a single sequence's prefill (one
group that sees every cell: `read_len * (T + 1)`), or a few forks still
sharing most of their cells, stays dense. Whichever is chosen, the result is
the dense one's (up to float rounding): a group's padding is masked, padded
query slots repeat a real token whose output is dropped.

Pages. Gathering copies each group's K/V rows before the SDPA reads them
again, so a gathered decode step moves three times the bytes of reading the
rows where they lie (on a 2-core CPU, 32 sequences x 1k cells: ~1.4-1.7x the
time of attending each sequence's contiguous K/V). The pool's aligned pages
of B cells (`[p * B, (p + 1) * B)`, B dividing its slots) can be read in
place instead (`kvlayout.mlx.attend_groups` with `page=B`). A group reads a
page whole when it holds enough of its cells, h of them with

    h * (Qg + 1) > B * Qg + PAGE_PAIRS   # gathering them costs more than the page

and gathers its other cells (its `tail`) as before; its foreign cells in a
page are masked. Per batch (`page_batch`), with P the most pages and Kt the
longest tail of a group:

    paged    = G * (P * (B * Qg + PAGE_PAIRS) + Kt * (Qg + 1))

and the cheapest page size replaces the gathered batch when that is cheaper
than its `grouped_cost`. So a prompt placed in one run is read in place,
while decode tokens scattered one cell each among other sequences' stay
gathered beside it. Pages are tried only where the copy they save matters
(`_may_page`): one-query (decode) batches over K/V rows of at least
PAGED_MIN_ROW elements. The grouped-or-dense choice above is taken on the
gathered cost, which pages only lower.
"""

from __future__ import annotations

import numpy as np

from kvlayout.errors import ConfigError
from kvlayout.spec import AttendBatch, AttendGroups

PATHS = ("auto", "dense", "grouped", "paged")  # "grouped" gathers every batch; "paged" reads pages wherever it can


# What one more batch costs, in query-key pairs: an SDPA call, its gather and the concatenation
# (about 0.1 ms on a 2-core CPU, a few hundred pairs at small head sizes); kept high so a batch
# is split only when that saves real work, not to shave a few padded slots.
BATCH_PAIRS = 8192
# What reading one page of the pool in place costs beyond its slots, in query-key pairs: one small
# matmul per page and head in each of the two `gather_mm`s (a few microseconds on a 2-core CPU).
PAGE_PAIRS = 8
# Under "auto", pages only for rows of at least this many elements (H_kv * D); see _may_page.
PAGED_MIN_ROW = 128
# Page sizes tried, each only where it divides the pool's slots (the pages are then a view of it).
PAGE_SIZES = (256, 128, 64, 32, 16, 8, 4)
# The pages the cell plugin's default placement keeps each sequence in (`kvlayout_cell.plugin`).
# A decode group reads a page of B cells in place when it holds more than (B + PAGE_PAIRS) / 2 of
# them (`_keeps`), so 4 and 8 never are; a sequence of L cells in pages of its own costs about
# L * (1 + PAGE_PAIRS / B) pairs read that way (16: 1.5 L, 128: 1.06 L) against 2 L gathered. The
# planner takes one B per batch, the cheapest, and 256 wins wherever prompts ran on over aligned
# 256-cell pages: decode pages of 64 were then gathered until ~100 (1k prompts) to ~440 (4k)
# tokens each had been decoded, while 128 beats 256 after ~130 (bench/placement.py, 1k prompts:
# 0.80 of the last step's cells read in place at 64, 0.995 at 128 and 256). Each live sequence,
# and each fork that leaves its source's page, keeps up to B - 1 free cells of its partly filled
# page out of the others' way while fresh pages last: 4k cells at 32 sequences, where 256 would
# keep 8k for no more read in place. Pools tile 256-slot pages, so 128 divides every pool past one.
PLACEMENT_PAGE = 128
# Groups are binned by cells seen on a 2**(1/4) scale before batching: within a bin, padding
# wastes at most ~19% of a group's keys.
BINS_PER_OCTAVE = 4


def grouped_cost(n_groups: int, q_len: int, k_len: int) -> int:
    """Query-key pairs of the padded grouped SDPA plus one per gathered row."""
    return n_groups * k_len * (q_len + 1)


def dense_cost(n_tokens: int, read_len: int) -> int:
    return n_tokens * read_len


def choose(path: str, n_tokens: int, read_len: int, n_groups: int, q_len: int, k_len: int) -> bool:
    """True for the grouped path: forced by `path`, or cheaper by the rule above under "auto"."""
    return prefer_grouped(path, grouped_cost(n_groups, q_len, k_len), dense_cost(n_tokens, read_len))


def prefer_grouped(path: str, grouped: int, dense: int) -> bool:
    """The rule on two costs in query-key pairs: `path` forces a side, "auto" takes the cheaper."""
    if path not in PATHS:
        raise ConfigError(f"attention path {path!r}: expected one of {', '.join(PATHS)}")
    if path != "auto":
        return path != "dense"
    return grouped < dense


def plan_groups(seq_ids: np.ndarray, mask: np.ndarray, path: str = "auto", pool=None) -> AttendGroups | None:
    """Group a step's tokens by sequence; None when the dense mask is the cheaper (or forced).

    The plan is a `kvlayout.AttendGroups` of numpy arrays (mask `[G, 1, Qg, Kg]`),
    its `keys`/`values` unset: the cache converts it to MLX and adds its pools.

    `seq_ids` int `[T]` names each token's sequence, `mask` bool `[T, read_len]`
    is the step's dense mask (True = attend). Costs O(T * read_len) numpy.
    The cell layout plans from its table instead (`plan_cells`, the same
    plan without the dense mask); this form takes any mask.
    """
    seq_ids = np.asarray(seq_ids)
    n_tokens, read_len = mask.shape
    if path == "dense":
        return None
    if path == "auto" and (seq_ids == seq_ids[0]).all():  # one group: skip the sorting to decide
        k_len = int(np.count_nonzero(mask.any(axis=0)))
        if not choose(path, n_tokens, read_len, 1, n_tokens, k_len):
            return None
    order, counts, rank = _by_sequence(seq_ids)
    in_order = bool((order == np.arange(n_tokens)).all())  # each sequence's tokens already contiguous
    rows = mask if in_order else mask[order]  # [T, read_len], each group's rows contiguous

    # Estimate each group's cells as the most any one of its tokens sees (exact on a flat layer,
    # where a sequence's rows are nested; then computed exactly).
    first, starts, q_counts = _pick_blocks(rank, counts, np.count_nonzero(rows, axis=1))
    seen = np.logical_or.reduceat(rows, starts, axis=0)  # [G, read_len]: what any of its tokens sees
    k_counts = np.count_nonzero(seen, axis=1)  # [G]
    cost, labels = batch_groups(q_counts, np.maximum(k_counts, 1))
    if not prefer_grouped(path, cost, dense_cost(n_tokens, read_len)):
        return None

    # Cells of each group, ascending; padding slots point at cell 0 (valid: read_len >= 1) and are masked.
    g_of, c_of = np.nonzero(seen)  # sorted by group, then cell
    slot = np.arange(g_of.size) - np.repeat(np.cumsum(k_counts) - k_counts, k_counts)
    cells = np.zeros((starts.size, max(int(k_counts.max()), 1)), dtype=np.int32)  # [G, Kg]
    cells[g_of, slot] = c_of

    def batch(gi, b_tokens, k_b):
        b_cells = cells[gi, :k_b]  # [G_b, K_b]
        b_mask = mask[b_tokens[:, :, None], b_cells[:, None, :]]  # [G_b, Q_b, K_b]
        b_mask &= (np.arange(k_b)[None, :] < k_counts[gi][:, None])[:, None, :]
        return b_cells, b_mask

    return _assemble(order, first, starts, q_counts, k_counts, labels, batch, path, pool)


def plan_cells(
    seq_ids: np.ndarray,
    positions: np.ndarray,
    window: int,
    read_len: int,
    owned,
    path: str = "auto",
    held=None,
    pool=None,
) -> AttendGroups | None:
    """`plan_groups` for a cell-layout step, from each sequence's cells instead of the dense mask.

    `seq_ids`/`positions` int `[T]` are the step's tokens, placed already
    (each sequence's positions rising in step order); `owned(ids)` answers, for
    ascending distinct ids, `(cells, positions, starts)`: the cells each owns,
    ids[i]'s at `[starts[i], starts[i + 1])`, by position (`CellTable.seq_keys`).
    Token t sees the cells of its sequence with position in
    `[positions[t] - window + 1, positions[t]]` (no lower bound when
    window == 0): one run of that list, found by binary search, and a group's
    cells are the run from its first token's start to its last token's end.
    So the plan costs O(T log + cells of the step's sequences) plus the padded
    batch masks, never O(T * read_len); its cells come by position.

    `held(ids)` (optional) answers how many cells each id holds: on a flat
    layer a lone sequence's last token sees all of them, so the common
    single-sequence step is decided dense without looking at any cell.
    `pool` as in `plan_groups`.
    """
    n_tokens = seq_ids.size
    if path == "dense":
        return None
    if path == "auto" and held is not None and not window and (seq_ids == seq_ids[0]).all():
        if not choose(path, n_tokens, read_len, 1, n_tokens, int(held(seq_ids[:1])[0])):
            return None
    n_seqs, key_cells, key_pos, lo, hi = _token_runs(seq_ids, positions, window, owned)
    if path == "auto" and n_seqs == 1:  # one group: decide before sorting
        if not choose(path, n_tokens, read_len, 1, n_tokens, int(hi[-1] - lo[0])):
            return None
    if n_seqs == n_tokens:  # one token a sequence (a decode step): each is its own group, in step order
        order = starts = np.arange(n_tokens)
        first, q_counts = np.ones(n_tokens, dtype=bool), np.ones(n_tokens, dtype=np.int64)
    else:
        order, counts, rank = _by_sequence(seq_ids)
        first, starts, q_counts = _pick_blocks(rank, counts, (hi - lo)[order])
    g_lo = lo[order][starts]  # [G]: a group's run starts where its first token's does
    k_counts = hi[order][starts + q_counts - 1] - g_lo  # [G]: and ends where its last token's does
    cost, labels = batch_groups(q_counts, k_counts)  # k_counts >= 1: a token sees its own cell
    if not prefer_grouped(path, cost, dense_cost(n_tokens, read_len)):
        return None
    batch = _run_batches(key_cells, key_pos, positions, window, g_lo, k_counts)
    return _assemble(order, first, starts, q_counts, k_counts, labels, batch, path, pool)


def _token_runs(seq_ids: np.ndarray, positions: np.ndarray, window: int, owned):
    """(sequences, key_cells, key_pos, lo, hi): how many distinct sequences the step has; the cells they
    own and their positions, each sequence's by position (`owned`, as in `plan_cells`); and the run
    `[lo[t], hi[t])` of that list that token t sees."""
    order = np.argsort(seq_ids, kind="stable")
    ids = seq_ids[order]
    distinct = bool((ids[1:] != ids[:-1]).all())  # one token a sequence: a decode step
    if distinct:  # np.unique's answer without its second pass: each token is its own sequence
        row = np.empty(seq_ids.size, dtype=np.int64)
        row[order] = np.arange(seq_ids.size)
    else:
        ids, row = np.unique(seq_ids, return_inverse=True)
        row = row.reshape(-1)  # [T]: index of each token's sequence in ids
    key_cells, key_pos, key_starts = owned(ids)  # [M], [M], [N + 1]
    if distinct and not window:
        # Each token sees its sequence's cells up to its position: all of them when it is the sequence's
        # newest (a decode step's token, placed already), so no search.
        lo, hi = key_starts[row], key_starts[row + 1]  # [T]
        if (hi > lo).all() and (key_pos[hi - 1] == positions).all():
            return ids.size, key_cells, key_pos, lo, hi
    # Runs by binary search on (sequence, position), one sorted int64 key per cell.
    span = np.int64(max(int(key_pos.max(initial=0)), int(positions.max())) + 2)
    keys = np.repeat(np.arange(ids.size, dtype=np.int64), np.diff(key_starts)) * span + key_pos  # [M], ascending
    hi = np.searchsorted(keys, row * span + positions, side="right")  # [T]: one past the newest it sees
    lo = key_starts[row] if not window else np.searchsorted(
        keys, row * span + np.maximum(positions - (window - 1), 0), side="left"
    )  # [T]: the oldest it sees
    return ids.size, key_cells, key_pos, lo, hi


def _run_batches(key_cells, key_pos, positions, window: int, g_lo, k_counts):
    """`_assemble`'s `batch(gi, b_tokens, k_b)` for groups whose cells are runs of `key_cells` (group g's:
    the `k_counts[g]` from `g_lo[g]`), each token's mask row by position and the window."""

    def batch(gi, b_tokens, k_b):
        j = np.arange(k_b)[None, :]  # [1, K_b]
        valid = j < k_counts[gi][:, None]  # [G_b, K_b]
        at = np.where(valid, g_lo[gi][:, None] + j, g_lo[gi][:, None])  # padding repeats a real cell, masked
        b_cells, kp = key_cells[at].astype(np.int32), key_pos[at]  # [G_b, K_b]
        tp = positions[b_tokens][:, :, None]  # [G_b, Q_b, 1]
        b_mask = (kp[:, None, :] <= tp) & valid[:, None, :]  # [G_b, Q_b, K_b]
        if window:
            b_mask &= kp[:, None, :] >= tp - (window - 1)
        return b_cells, b_mask

    return batch


def _by_sequence(seq_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, counts, rank): tokens by sequence (numbered by first appearance), in step order within
    one; each sequence's token count; the rank of order[i] within its sequence. All [T] but counts."""
    n_tokens = seq_ids.size
    _, first_at, gid = np.unique(seq_ids, return_index=True, return_inverse=True)
    gid = np.argsort(np.argsort(first_at))[gid.reshape(-1)]  # sequences numbered by first appearance
    order = np.argsort(gid, kind="stable")
    counts = np.bincount(gid)
    rank = np.arange(n_tokens) - np.repeat(np.cumsum(counts) - counts, counts)
    return order, counts, rank


def _pick_blocks(rank: np.ndarray, counts: np.ndarray, row_counts: np.ndarray):
    """(first, starts, q_counts) for the block size of least estimated cost.

    `row_counts` `[T]`, in `order`: cells each token sees; a group's cells are
    estimated as its widest token's. A group starts at each sequence's start
    and every `block` tokens after (first: bool [T]; starts, q_counts: [G]).
    """
    n_tokens = rank.size
    best = None
    for block in block_sizes(int(counts.max())):
        first = rank % block == 0
        starts = np.flatnonzero(first)
        q_counts = np.diff(np.append(starts, n_tokens))  # [G]
        k_est = np.maximum(np.maximum.reduceat(row_counts, starts), 1)  # [G]
        cost = batch_groups(q_counts, k_est)[0]
        if best is None or cost < best[0]:
            best = (cost, first, starts, q_counts)
    return best[1:]


def _assemble(order, first, starts, q_counts, k_counts, labels, batch, path, pool) -> AttendGroups:
    """The plan: tokens of each group (padding repeats its last token), each batch cut to its own
    longest query run and key count, `batch(gi, tokens [G_b, Q_b], K_b)` giving its cells and mask
    (read by pages instead where `page_batch` finds that cheaper), and where each token's output
    lands among the batches' slots."""
    n_tokens, q_len = order.size, int(q_counts.max())
    group = np.cumsum(first) - 1  # group of order[i]
    within = np.arange(n_tokens) - starts[group]  # its slot in the group
    tokens = np.repeat(order[starts + q_counts - 1][:, None], q_len, axis=1).astype(np.int32)  # [G, Qg]
    tokens[group, within] = order
    batches, slot_of_group, offset = [], np.empty(starts.size, dtype=np.int64), 0
    for label in range(int(labels.max()) + 1):
        gi = np.flatnonzero(labels == label)  # [G_b], in step order
        q_b, k_b = int(q_counts[gi].max()), max(int(k_counts[gi].max()), 1)
        b_tokens = tokens[gi, :q_b]  # [G_b, Q_b]
        b_cells, b_mask = batch(gi, b_tokens, k_b)
        paged = page_batch(b_cells, b_mask, k_counts[gi], pool[0], path) if _may_page(path, pool, q_b) else None
        page = 0
        tail = None
        if paged is not None:
            page, b_cells, tail, b_mask = paged
        batches.append(AttendBatch(b_tokens, b_cells, None if b_mask.all() else b_mask[:, None], page, tail))
        slot_of_group[gi] = offset + np.arange(gi.size) * q_b
        offset += gi.size * q_b
    out = np.empty(n_tokens, dtype=np.int32)
    out[order] = slot_of_group[group] + within
    # No padded slot, and each token's slot is its own index: the slots are the tokens in order.
    in_order = offset == n_tokens and bool((out == np.arange(n_tokens)).all())
    head = batches[0]
    return AttendGroups(head.tokens, head.cells, head.mask, out, more=tuple(batches[1:]), page=head.page,
                        tail=head.tail, in_order=in_order)


def _may_page(path: str, pool, q_len: int) -> bool:
    """Whether a batch of `q_len` queries per group is worth trying by pages: always when forced,
    never for "grouped" or without a pool; under "auto" only decode batches (one query each) over
    rows of at least PAGED_MIN_ROW elements. With Qg queries per group the copy a page saves is
    1/(Qg + 1) of the batch's work, and a narrow row is cheap to copy, while the paged path runs
    about ten more operations than the gathered one: measured on a 2-core CPU, pages were 7-25%
    faster for one-query groups over H_kv * D = 512 or 1024 rows, and up to 2x slower than gathering
    for the tiny preset's 32-element rows in a real run. At 128 and 192 (2 x 64, Qwen2.5-0.5B's;
    3 x 64, SmolLM2's), bench row 12's decode steps of 8 and 32 sequences took 1.13-1.38x the
    per-sequence ideal by pages against 1.29-1.60x gathered (2 x 64), and 1.14-1.34x against
    1.24-2.0x (3 x 64; with OpenBLAS 1.34-1.76x against 1.52-2.65x)."""
    if pool is None or path == "grouped":
        return False
    return path == "paged" or (q_len == 1 and pool[1] >= PAGED_MIN_ROW)


def page_batch(cells: np.ndarray, mask: np.ndarray, k_counts: np.ndarray, slots: int, path: str = "auto"):
    """`(B, pages, tail, mask)`: a batch read as whole pages of B cells plus gathered cells, or None.

    `cells` int `[G, K]` and `mask` bool `[G, Q, K]` are the gathered batch
    (slots past `k_counts[g]` are padding, masked); `slots` the pool's cells.
    A group keeps a page of B cells when it holds enough of them (`_keeps`);
    its other cells form its `tail`, gathered. So `pages` int32 `[G, P]`
    (ascending; padding repeats a page, masked) and `tail` int32 `[G, Kt]`
    (padding cell 0, masked), and the new `mask` `[G, Q, P * B + Kt]` runs
    over the pages' slots (`r * B + o` is cell `pages[g, r] * B + o`) then
    the tail's; a slot is visible where the gathered slot of its cell was.
    B is the cheapest of PAGE_SIZES dividing `slots` (`paged_cost`); None
    when no size does, when no group keeps a page, or (path "auto") when
    that costs no less than gathering. O(G * K log) numpy.
    """
    n_groups, q_len, k_len = mask.shape
    gi, ji = np.nonzero(np.arange(k_len)[None, :] < k_counts[:, None])  # every real (group, slot), by group
    order = np.lexsort((cells[gi, ji], gi))  # by group, then cell
    gi, ji = gi[order], ji[order]
    cell = cells[gi, ji].astype(np.int64)
    best = None
    for size in PAGE_SIZES:
        if slots % size:
            continue
        key = gi * np.int64(slots // size + 1) + cell // size  # (group, page), ascending
        starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])  # each (group, page) run's first cell
        held = np.diff(np.r_[starts, key.size])  # cells of the group in that page
        if held.max() == 1:  # every cell alone in its page, and so in any smaller one: none is kept
            break
        keep = _keeps(held, size, q_len, path)  # per (group, page) run
        kept = np.repeat(keep, held)  # [M]: the cell is read by its page
        n_pages = np.bincount(gi[starts][keep], minlength=n_groups)  # [G]
        n_tail = np.bincount(gi[~kept], minlength=n_groups)  # [G]
        cost = paged_cost(n_groups, q_len, size, int(n_pages.max()), int(n_tail.max()))
        if n_pages.any() and (best is None or cost < best[0]):  # without a page it is the gathered batch
            best = (cost, size, key, kept, n_pages, n_tail)
    if best is None:
        return None
    cost, size, key, kept, n_pages, n_tail = best
    if path == "auto" and cost >= grouped_cost(n_groups, q_len, k_len):
        return None
    p_max, t_max = int(n_pages.max()), int(n_tail.max())
    # A kept cell's page rank within its group: runs of one page are contiguous, numbered per group.
    page_start = kept & np.r_[True, key[1:] != key[:-1]]  # [M]: first cell of a kept page
    page_no = np.cumsum(page_start) - 1  # [M]: the kept page it lies in, counted over all groups
    rank = page_no - (np.cumsum(n_pages) - n_pages)[gi]  # [M] (meaningful where kept)
    pages = np.zeros((n_groups, p_max), dtype=np.int32)  # [G, P]
    pages[gi[page_start], rank[page_start]] = cell[page_start] // size
    pages = np.where(np.arange(p_max)[None, :] < n_pages[:, None], pages, pages[:, :1])  # padding: a page again
    t_rank = _rank_within(gi, ~kept, n_groups)  # [M] (meaningful where not kept)
    tail = np.zeros((n_groups, t_max), dtype=np.int32)  # [G, Kt]
    tail[gi[~kept], t_rank[~kept]] = cell[~kept]
    slot = np.where(kept, rank * size + cell % size, p_max * size + t_rank)  # [M]
    paged = np.zeros((n_groups, q_len, p_max * size + t_max), dtype=bool)  # [G, Q, P * B + Kt]
    paged[gi, :, slot] = mask[gi, :, ji]  # distinct cells: distinct slots
    return size, pages, tail if t_max else None, paged


def paged_cost(n_groups: int, q_len: int, size: int, n_pages: int, n_tail: int) -> int:
    """Query-key pairs of a paged batch: every slot of its pages, plus the gathered tail as in grouped_cost."""
    return n_groups * (n_pages * (size * q_len + PAGE_PAIRS) + n_tail * (q_len + 1))


def _keeps(held: np.ndarray, size: int, q_len: int, path: str) -> np.ndarray:
    """Which pages a group reads whole, from the cells it holds in each: those cheaper read in place
    than gathered ("paged" forces at least half-full pages, so small tests exercise them)."""
    if path == "paged":
        return 2 * held >= size
    return held * (q_len + 1) > size * q_len + PAGE_PAIRS


def _rank_within(group: np.ndarray, chosen: np.ndarray, n_groups: int) -> np.ndarray:
    """For elements sorted by `group`: each chosen one's index among the chosen of its group."""
    count = np.cumsum(chosen) - chosen  # chosen elements before this one, over all groups
    per_group = np.bincount(group[chosen], minlength=n_groups)
    return count - (np.cumsum(per_group) - per_group)[group]


def batch_groups(q_counts: np.ndarray, k_counts: np.ndarray) -> tuple[int, np.ndarray]:
    """(cost, batch label [G]): the groups split into batches, each padded only to its own widest.

    One SDPA pads every group to the most queries and keys of any group, so a
    step mixing one-token decodes with prompt blocks, or short prompts with
    long ones, does several times the work it needs. Groups are ordered by
    kind (several queries first, then one-query decodes) and cells seen,
    widest first, in bins of BINS_PER_OCTAVE per doubling; walking the bins in
    that order, a bin joins the open batch when that costs no more than
    running it apart (its own padded pairs plus BATCH_PAIRS). O(G) numpy plus
    a loop over the bins (a few dozen). The cost is `grouped_cost` summed
    over the batches plus BATCH_PAIRS per batch after the first; a single
    batch costs exactly `grouped_cost`.
    """
    kind = (q_counts > 1).astype(np.int64)  # 1: a prompt block, 0: a one-token decode
    key = (kind << 20) + np.floor(np.log2(k_counts) * BINS_PER_OCTAVE).astype(np.int64)  # k_counts >= 1
    bins, inv = np.unique(key, return_inverse=True)  # ascending
    inv = inv.reshape(-1)
    n = np.bincount(inv)
    q = np.zeros(bins.size, dtype=np.int64)
    k = np.zeros(bins.size, dtype=np.int64)
    np.maximum.at(q, inv, q_counts)
    np.maximum.at(k, inv, k_counts)
    label_of_bin = np.empty(bins.size, dtype=np.int64)
    cost, label = 0, -1
    cn = cq = ck = 0  # the open batch: groups, most queries, most cells
    for b in range(bins.size - 1, -1, -1):  # blocks before decodes, widest first
        nb, qb, kb = int(n[b]), int(q[b]), int(k[b])
        if label >= 0:
            merged = grouped_cost(cn + nb, max(cq, qb), max(ck, kb))
            if merged <= grouped_cost(cn, cq, ck) + grouped_cost(nb, qb, kb) + BATCH_PAIRS:
                cn, cq, ck = cn + nb, max(cq, qb), max(ck, kb)
                label_of_bin[b] = label
                continue
            cost += grouped_cost(cn, cq, ck) + BATCH_PAIRS
        label += 1
        cn, cq, ck = nb, qb, kb
        label_of_bin[b] = label
    cost += grouped_cost(cn, cq, ck)
    return cost, label_of_bin[inv]


def block_sizes(longest: int) -> list[int]:
    """Query-block sizes tried: a sequence's tokens unsplit, then halving down to 1.

    A prefill chunk of one sequence attends a causal triangle; split into
    blocks, each block's group holds only the cells up to its last token, so
    the padded batch does less work when ragged sequences share a step, and
    a step mixing prefill chunks with one-token decodes pads every group to
    the block size, not to the longest chunk. The cheapest by `grouped_cost`
    is taken.
    """
    sizes, b = [longest], 1
    while b < longest:
        sizes.append(b)
        b *= 2
    return sizes
