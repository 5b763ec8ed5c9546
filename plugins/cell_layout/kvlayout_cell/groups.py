"""Grouped attention for a sparse step: which tokens attend which cells, and whether to.

Neutral (numpy only). The dense explicit mask makes every token of a step
attend all `read_len` cells, though a token may only see cells its own
sequence owns. `plan_groups` groups the step's tokens by sequence (a long
run of one sequence's tokens split into query blocks, see `block_sizes`) and
gives each group the cells any of its tokens may see (the union of their mask
rows: its sequence's cells, within the window, up to its newest token), so
attention can gather each group's K/V and run one batched SDPA over the
groups instead (`kvlayout.mlx.attend_groups`).

The rule (`choose`), in query-key pairs, with G groups, Qg the most tokens of
a group and Kg the most cells a group sees (the batch is padded to both):

    grouped = G * Kg * (Qg + 1)      # padded SDPA, plus gathering G * Kg K/V rows
    dense   = T * read_len           # every token against every cell

The block size is the one with the least `grouped` cost; then grouped wins
iff `grouped < dense`. Gathering a row costs about what
attending one query to it does (a copy of the same bytes the SDPA reads), hence
the `+ 1`. So a decode step of N sequences over mostly private cells is
grouped (about N times less work), while a single sequence's prefill (one
group that sees every cell: `read_len * (T + 1)`), or a few forks still
sharing most of their cells, stays dense. Whichever is chosen, the result is
the dense one's (up to float rounding): a group's padding is masked, padded
query slots repeat a real token whose output is dropped.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvlayout.errors import ConfigError

PATHS = ("auto", "dense", "grouped")


@attrs.frozen(eq=False)
class GroupPlan:
    """The numpy side of `kvlayout.AttendGroups` (see there for the shapes)."""

    tokens: np.ndarray  # int32 [G, Qg]
    cells: np.ndarray  # int32 [G, Kg]
    mask: np.ndarray | None  # bool [G, Qg, Kg], None = all visible
    out: np.ndarray  # int32 [T]


def grouped_cost(n_groups: int, q_len: int, k_len: int) -> int:
    """Query-key pairs of the padded grouped SDPA plus one per gathered row."""
    return n_groups * k_len * (q_len + 1)


def dense_cost(n_tokens: int, read_len: int) -> int:
    return n_tokens * read_len


def choose(path: str, n_tokens: int, read_len: int, n_groups: int, q_len: int, k_len: int) -> bool:
    """True for the grouped path: forced by `path`, or cheaper by the rule above under "auto"."""
    if path not in PATHS:
        raise ConfigError(f"attention path {path!r}: expected one of {', '.join(PATHS)}")
    if path != "auto":
        return path == "grouped"
    return grouped_cost(n_groups, q_len, k_len) < dense_cost(n_tokens, read_len)


def plan_groups(seq_ids: np.ndarray, mask: np.ndarray, path: str = "auto") -> GroupPlan | None:
    """Group a step's tokens by sequence; None when the dense mask is the cheaper (or forced).

    `seq_ids` int `[T]` names each token's sequence, `mask` bool `[T, read_len]`
    is the step's dense mask (True = attend). Costs O(T * read_len) numpy,
    once per window per step, like the mask itself.
    """
    seq_ids = np.asarray(seq_ids)
    n_tokens, read_len = mask.shape
    if path == "dense":
        return None
    if path == "auto" and (seq_ids == seq_ids[0]).all():  # one group: skip the sorting to decide
        k_len = int(np.count_nonzero(mask.any(axis=0)))
        if not choose(path, n_tokens, read_len, 1, n_tokens, k_len):
            return None
    _, first_at, gid = np.unique(seq_ids, return_index=True, return_inverse=True)
    gid = np.argsort(np.argsort(first_at))[gid.reshape(-1)]  # sequences numbered by first appearance
    order = np.argsort(gid, kind="stable")  # tokens by sequence, in step order within one
    counts = np.bincount(gid)
    rank = np.arange(n_tokens) - np.repeat(np.cumsum(counts) - counts, counts)  # of order[i] in its sequence
    in_order = bool((order == np.arange(n_tokens)).all())  # each sequence's tokens already contiguous
    rows = mask if in_order else mask[order]  # [T, read_len], each group's rows contiguous

    # Pick the block size by the rule, estimating each group's cells as the most any one of its
    # tokens sees (exact on a flat layer, where a sequence's rows are nested; then computed exactly).
    row_counts = np.count_nonzero(rows, axis=1)  # [T]
    best = None
    for block in block_sizes(int(counts.max())):
        first = rank % block == 0  # a group starts at each sequence's start and every `block` tokens after
        starts = np.flatnonzero(first)
        q_counts = np.diff(np.append(starts, n_tokens))
        shape = (starts.size, int(q_counts.max()), max(int(np.maximum.reduceat(row_counts, starts).max()), 1))
        if best is None or grouped_cost(*shape) < grouped_cost(*best[0]):
            best = (shape, first, starts, q_counts)
    (n_groups, q_len, _), first, starts, q_counts = best
    seen = np.logical_or.reduceat(rows, starts, axis=0)  # [G, read_len]: what any of its tokens sees
    k_counts = np.count_nonzero(seen, axis=1)
    k_len = max(int(k_counts.max()), 1)
    if not choose(path, n_tokens, read_len, n_groups, q_len, k_len):
        return None

    # Cells of each group, ascending; padding slots point at cell 0 (valid: read_len >= 1) and are masked.
    g_of, c_of = np.nonzero(seen)  # sorted by group, then cell
    slot = np.arange(g_of.size) - np.repeat(np.cumsum(k_counts) - k_counts, k_counts)
    cells = np.zeros((n_groups, k_len), dtype=np.int32)
    cells[g_of, slot] = c_of

    # Tokens of each group; padding repeats the group's last token.
    group = np.cumsum(first) - 1  # group of order[i]
    within = np.arange(n_tokens) - starts[group]  # its slot in the group
    tokens = np.repeat(order[starts + q_counts - 1][:, None], q_len, axis=1).astype(np.int32)  # [G, Qg]
    tokens[group, within] = order
    out = np.empty(n_tokens, dtype=np.int32)
    out[order] = group * q_len + within

    group_mask = mask[tokens[:, :, None], cells[:, None, :]]  # [G, Qg, Kg]
    group_mask &= (np.arange(k_len)[None, :] < k_counts[:, None])[:, None, :]
    return GroupPlan(tokens, cells, None if group_mask.all() else group_mask, out)


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
