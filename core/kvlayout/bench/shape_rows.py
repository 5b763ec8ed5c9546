"""Row 12 (shapes): a decode step's attention on the cell layout against the per-sequence ideal, for
every head shape and two histories (issue 15's measurement).

For H_kv x D in 1x32, 2x64, 3x64 (SmolLM2's) and 8x128, and N = 8 and 32 sequences:

- "fresh": each sequence prefilled alone in one step, then one decode step;
- "interleaved": a short prompt each, then 256 decode steps with all N
  sequences in every step, a sequence freed and another forked every 32
  steps (the placement policy decides where every token goes), then the
  measured decode step.

Timed sides, one layer, float32, interleaved: the cell layout's `attend()`
over the step's spec (attention_path "auto"); the same plus the step's
`update_and_fetch` (declare, place, write, plan: the step as a whole for
one layer); and the ideal: one batched SDPA over each sequence's own K/V,
already contiguous, padded to the longest with a key mask. Every side's
output agrees with the ideal's (the max difference is printed).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from kvlayout.bench.layouts import cell_cache, cell_table
from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved, timed
from kvlayout.config import CacheConfig, LayerConfig
from kvlayout.mlx import attend

SHAPES = ((1, 32), (2, 64), (3, 64), (8, 128))  # (H_kv, D): rows of 32, 128, 192 and 1024 elements
REP = {32: 2, 64: 3, 128: 4}  # query heads per KV head


def history(n: int, h_kv: int, d: int, kind: str, rng: np.random.Generator, prompt: int, steps: int):
    """A cell cache and its live ids after `kind` ("fresh" or "interleaved"); the next step is declared
    by the caller."""
    cap = n * (prompt + steps + 64) * 2
    cache = cell_cache(CacheConfig(capacity=cap, n_layers=1, layers=[LayerConfig(h_kv, d)], kv_dtype="float32",
                                   max_seqs=2 * n, initial_capacity=cap), lowest_free=False)
    control = cache.as_batch_control()
    ids = [control.seq_new() for _ in range(n)]

    def step(seqs: list[int]) -> None:
        positions = [control.next_pos(s) for s in seqs]
        assert control.declare_step(seqs)
        kv = mx.array(rng.normal(size=(1, h_kv, len(seqs), d)).astype(np.float32))
        cache.update_and_fetch(0, positions, kv, kv * 0.5)

    first = prompt + steps if kind == "fresh" else prompt
    for s in ids:  # each prompt in one step of its own
        positions = list(range(first))
        assert control.declare_step([s] * first)
        kv = mx.array(rng.normal(size=(1, h_kv, first, d)).astype(np.float32))
        cache.update_and_fetch(0, positions, kv, kv * 0.5)
    if kind == "interleaved":
        for i in range(steps):
            if i and i % 32 == 0:  # one sequence done, another forks from a live one
                gone = ids.pop(int(rng.integers(len(ids))))
                control.seq_rm(gone)
                ids.append(control.seq_clone(ids[int(rng.integers(len(ids)))]))
            step(list(ids))
    cache.key_pools[0].evaluate()
    cache.value_pools[0].evaluate()
    return cache, ids


def row_shapes(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    out: list[Row] = []
    rng = np.random.default_rng(12)
    prompt, steps = z["shape_prompt"], z["shape_steps"]
    for h_kv, d in SHAPES:
        h_q = h_kv * REP[d]
        scale = d**-0.5
        for n in z["shape_seqs"]:
            for kind in ("fresh", "interleaved"):
                cache, ids = history(n, h_kv, d, kind, rng, prompt, steps)
                control = cache.as_batch_control()
                positions = [control.next_pos(s) for s in ids]
                k1 = mx.array(rng.normal(size=(1, h_kv, n, d)).astype(np.float32))
                q = mx.array(rng.normal(size=(1, h_q, n, d)).astype(np.float32))
                assert control.declare_step(ids)
                spec = cache.update_and_fetch(0, positions, k1, k1 * 0.5)
                table = cell_table(cache)
                owned = [table.seq_cells(s)[0] for s in ids]  # each sequence's cells by position
                longest = max(c.size for c in owned)
                pad = np.stack([np.pad(c, (0, longest - c.size)) for c in owned])  # [N, Lmax]
                idx = mx.array(pad.reshape(-1).astype(np.int32))
                keys = spec.groups.keys if spec.groups is not None else spec.keys
                values = spec.groups.values if spec.groups is not None else spec.values
                ik = mx.contiguous(mx.take(keys, idx, axis=2).reshape(h_kv, n, longest, d).transpose(1, 0, 2, 3))
                iv = mx.contiguous(mx.take(values, idx, axis=2).reshape(h_kv, n, longest, d).transpose(1, 0, 2, 3))
                lengths = np.array([c.size for c in owned])
                kmask = mx.array((np.arange(longest)[None] < lengths[:, None])[:, None, None, :])  # [N, 1, 1, Lmax]
                qi = mx.contiguous(q.transpose(2, 1, 0, 3))  # [N, Hq, 1, D]
                mx.eval(q, ik, iv, kmask, qi)

                def ideal():
                    return timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(qi, ik, iv, scale=scale,
                                                                                      mask=kmask)))

                def layout():
                    return timed(lambda: mx.eval(attend(q, spec, scale)))

                err = float(np.abs(np.array(attend(q, spec, scale))
                                   - np.array(mx.fast.scaled_dot_product_attention(
                                       qi, ik, iv, scale=scale, mask=kmask).transpose(2, 1, 0, 3))).max())
                pages = [b.page for b in spec.groups.batches()] if spec.groups is not None else []
                read = sum(b.cells.size * b.page for b in spec.groups.batches() if b.page) if pages else 0
                share = read / max(int(lengths.sum()), 1)
                del spec
                cache.abort_step()

                def whole():  # the step for one layer: declare, place, write, plan, attend
                    t0 = time.perf_counter()
                    assert control.declare_step(ids)
                    s = cache.update_and_fetch(0, positions, k1, k1 * 0.5)
                    mx.eval(attend(q, s, scale))
                    dt = time.perf_counter() - t0
                    cache.abort_step()
                    return dt

                assert control.declare_step(ids)
                spec = cache.update_and_fetch(0, positions, k1, k1 * 0.5)
                t = interleaved({"layout": layout, "ideal": ideal}, 3 * z["repeats"])
                del spec
                cache.abort_step()
                tw = interleaved({"whole step": whole, "ideal": ideal}, 3 * z["repeats"])
                case = f"{h_kv}x{d} N={n} {kind}"
                note = (f"{'paged ' + '/'.join(map(str, sorted(set(p for p in pages if p)))) if any(pages) else ('gathered' if pages else 'dense')}"
                        f", {share:.0%} of cells read in place; max |layout - ideal| {err:.1e}")
                out.append(Row.from_times("12 shapes", f"{case}: attn/ideal", t, "layout", "ideal", note,
                                          h_kv=h_kv, d=d, n=n, history=kind, in_place=share))
                out.append(Row.from_times("12 shapes", f"{case}: step/ideal", tw, "whole step", "ideal",
                                          "goal <= 1.3 (attention <= 1.2)", h_kv=h_kv, d=d, n=n, history=kind))
    work = (f"one layer, float32, H_q = H_kv x (2 at D 32, 3 at D 64, 4 at D 128); fresh = a {prompt + steps}-token "
            f"prompt each then one decode step; interleaved = a {prompt}-token prompt each, then {steps} decode "
            "steps of every sequence (a free and a fork every 32), under the default placement; attn = attend() "
            "on the layout's spec (attention_path auto); step = declare + update_and_fetch + attend; ideal = one "
            "batched SDPA over each sequence's own K/V, contiguous, padded to the longest under a key mask.")
    return work, out
