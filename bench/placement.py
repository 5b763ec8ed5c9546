"""Placement under continuous batching: lowest-free cells against pages of each sequence's own.

N sequences are prefilled one after another (in chunks of 256 tokens), then decode together for
S steps, one token each, a sequence freed (seq_rm) and another forked (seq_clone) every 32
steps. Each decode step goes through a one-layer cell cache (float32 K/V, attention_path "auto",
random K/V and queries), placed by the old default (lowest free cells, `kvlayout_cell.plugin.
LowestFree`) or by the new one (`own_pages`, pages of PLACEMENT_PAGE cells; `--pages` adds other
page sizes). Reported per decode step, over the S steps:

- in place: the share of the step's visible cells that the planner reads as whole pages in place
  (its AttendGroups batches' `page` slots, against those and the gathered `tail`/cells), mean
  over the steps and at the last one;
- attn ms: `attend()` of the step (mx.eval'd), median, and its ratio to lowest-free's (the
  policies run step by step in turn, so drift on a shared machine hits them alike);
- write ms: `update_and_fetch` (placement, grouping plan, the K/V write, settled), median.

Under "auto" pages are planned only for rows of at least PAGED_MIN_ROW (256) elements: at
H_kv x D = 3 x 64 (192) every batch is gathered whatever the placement.

    python bench/placement.py [--seqs 32] [--prefill 1024] [--steps 256] [--shapes 3x64,8x128]
        [--pages 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common
import mlx.core as mx
import numpy as np

from kvlayout import CacheConfig, LayerConfig
from kvlayout.mlx import attend
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from kvlayout_cell.groups import PLACEMENT_PAGE
from kvlayout_cell.plugin import LowestFree, OwnPages

GQA = {3: 9, 8: 32}  # H_kv -> H_q: SmolLM2-135M's 9/3 heads, Llama-3-8B's 32/8
CHUNK = 256  # prefill tokens a step
CHURN_EVERY = 32  # decode steps between a free and a fork

COLUMNS = [
    ("shape", "shape", ""),
    ("placement", "policy", ""),
    ("in place", "in_place_mean", ".3f"),
    ("(last)", "in_place_last", ".3f"),
    ("attn ms", "attention_ms", ".2f"),
    ("attn/lowest", "attention_ratio", ".3f"),
    ("write ms", "write_ms", ".2f"),
]


def manager(policy: str):
    pm = make_plugin_manager()  # the cell plugin's own placement: pages of PLACEMENT_PAGE
    if policy == "lowest-free":
        pm.register(LowestFree())
    elif policy != f"pages of {PLACEMENT_PAGE}":
        pm.register(OwnPages(int(policy.split()[-1])))
    return pm


def in_place(groups) -> tuple[int, int]:
    """(cells read in place, cells attended), over the step's tokens, from its AttendGroups."""
    if groups is None:  # dense: the whole read window, no page
        return 0, 1
    read = seen = 0
    for b in groups.batches():
        n_groups, q_len = b.tokens.shape
        slots = b.cells.shape[1] * max(b.page, 1) + (0 if b.tail is None else b.tail.shape[1])
        mask = np.ones((n_groups, q_len, slots), bool) if b.mask is None else np.array(b.mask)[:, 0]
        seen += int(mask.sum())
        if b.page:
            read += int(mask[:, :, : b.cells.shape[1] * b.page].sum())
    return read, seen


class Run:
    """One policy's cache through the workload, a step at a time; every Run of one shape draws the
    same K/V, queries and churn (one seed), so runs differ only in where the cells land."""

    def __init__(self, policy: str, h_kv: int, d: int, n_seqs: int, prefill: int, steps: int, seed: int = 0):
        self.policy, self.h_kv, self.d, self.n_ids = policy, h_kv, d, 2 * n_seqs
        self.rng = np.random.default_rng(seed)
        capacity = n_seqs * (prefill + steps) + 4096
        config = CacheConfig(capacity=capacity, n_layers=1, layers=[LayerConfig(h_kv, d)], kv_dtype="float32",
                             max_seqs=self.n_ids, initial_capacity=capacity)
        self.cache = CellCache(config, manager(policy))
        self.reads, self.attn, self.write = [], [], []
        # one prompt after another, in chunks
        for s in [self.cache.as_batch_control().seq_new() for _ in range(n_seqs)]:
            for p0 in range(0, prefill, CHUNK):
                n = min(CHUNK, prefill - p0)
                assert self.cache.as_batch_control().declare_step([s] * n)
                self.cache.update_and_fetch(0, list(range(p0, p0 + n)), self.kv(n), self.kv(n))  # spec dropped
                self.settle()

    def kv(self, n: int, heads: int | None = None) -> mx.array:
        return mx.array(self.rng.normal(size=(1, heads or self.h_kv, n, self.d)).astype(np.float32))  # [1, H, n, D]

    def settle(self) -> None:
        self.cache.key_pools[0].evaluate()
        self.cache.value_pools[0].evaluate()

    def live(self) -> list[int]:
        return [s for s in range(self.n_ids) if self.cache.as_batch_control().seq_len(s)]

    def decode_step(self, i: int) -> None:
        cache = self.cache
        if i and i % CHURN_EVERY == 0:
            gone, src = self.rng.choice(self.live(), size=2, replace=False)
            cache.as_batch_control().seq_rm(int(gone))
            cache.as_batch_control().seq_clone(int(src))
        live = self.live()
        positions = [cache.as_batch_control().next_pos(s) for s in live]
        k, v, q = self.kv(len(live)), self.kv(len(live)), self.kv(len(live), GQA[self.h_kv])  # q: [1, H_q, T, D]
        mx.eval(k, v, q)
        assert cache.as_batch_control().declare_step(live)
        t0 = time.perf_counter()
        spec = cache.update_and_fetch(0, positions, k, v)
        self.settle()
        t1 = time.perf_counter()
        mx.eval(attend(q, spec, self.d**-0.5))
        t2 = time.perf_counter()
        self.reads.append(in_place(spec.groups))
        self.write.append(t1 - t0)
        self.attn.append(t2 - t1)
        del spec  # a live read of the pool would make the next write copy it

    def row(self) -> dict:
        shares = [r / max(s, 1) for r, s in self.reads]
        return dict(shape=f"{self.h_kv}x{self.d}", policy=self.policy, in_place_mean=statistics.fmean(shares),
                    in_place_last=shares[-1], attention_ms=statistics.median(self.attn) * 1e3,
                    write_ms=statistics.median(self.write) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=1024, help="prompt cells per sequence")
    ap.add_argument("--steps", type=int, default=256, help="decode steps")
    ap.add_argument("--shapes", default="3x64,8x128", help="H_kv x D, comma-separated")
    ap.add_argument("--pages", default=str(PLACEMENT_PAGE), help="page sizes of own-pages placement to run")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()

    policies = ["lowest-free"] + [f"pages of {int(p)}" for p in args.pages.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        h_kv, d = (int(x) for x in shape.split("x"))
        runs = [Run(policy, h_kv, d, args.seqs, args.prefill, args.steps) for policy in policies]
        for i in range(args.steps):  # the policies step by step in turn: drift hits them alike
            for r in runs:
                r.decode_step(i)
        base = runs[0].row()["attention_ms"]
        for r in runs:
            rows.append({**r.row(), "attention_ratio": r.row()["attention_ms"] / base})
        del runs
    print(f"placement: {args.seqs} seqs x {args.prefill}-cell prompts, then {args.steps} decode steps "
          f"(a free and a fork every {CHURN_EVERY}); float32, attention_path auto, {mx.default_device()}")
    print(common.table(COLUMNS, rows))
    common.write_json(args.json, "placement", seqs=args.seqs, prefill=args.prefill, steps=args.steps, rows=rows)


if __name__ == "__main__":
    main()
