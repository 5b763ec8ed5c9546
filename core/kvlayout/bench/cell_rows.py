"""Rows 5 and 6 (bookkeep, grouped): the cell cache's per-step work and its attention beside the ideal.

Both drive the cell cache through its faces: sequences and declarations
through `as_batch_control()`, placement through `as_cell_stepper()` or
`update_and_fetch`. They time the grouping and the mask through the cache's
public `step_groups`/`step_mask`, settle writes with `MLXPool.evaluate()`, and
read which cells a sequence holds through `layouts.cell_table`.
"""

from __future__ import annotations

import time

import attrs
import mlx.core as mx
import numpy as np

from kvlayout import CacheConfig, LayerConfig
from kvlayout.bench.layouts import cell_cache, cell_table
from kvlayout.bench.record import Row
from kvlayout.bench.sizes import H_KV, D
from kvlayout.bench.timing import interleaved, timed
from kvlayout.mlx import attend


def grouped_and_dense(q, spec, scale):
    """Two timed sides: attend() over the spec as the layout gave it, and over its dense mask alone."""
    dense = attrs.evolve(spec, groups=None)
    return (lambda: timed(lambda: mx.eval(attend(q, spec, scale))),
            lambda: timed(lambda: mx.eval(attend(q, dense, scale))))


def interleaved_cells(used_end: int, n_seqs: int, rng: np.random.Generator):
    """A cell cache whose cells [0, used_end) hold n_seqs sequences interleaved: seq s holds cells
    s, s + n_seqs, ... at positions 0, 1, ... (K/V random).

    Laid out by one step through the protocol: under lowest-free placement token i of the step
    goes to cell i, so declaring ids cells % n_seqs at positions cells // n_seqs gives that layout
    (checked). Returns (cache, its BatchControl face).
    """
    cap = used_end + 2 * n_seqs
    cache = cell_cache(CacheConfig(capacity=cap, n_layers=1, layers=[LayerConfig(H_KV, D)], kv_dtype="float32",
                                   max_seqs=n_seqs, initial_capacity=cap))
    control = cache.as_batch_control()
    ids = [control.seq_new() for _ in range(n_seqs)]
    cells = np.arange(used_end, dtype=np.int64)
    kv0 = mx.array(rng.normal(size=(1, H_KV, used_end, D)).astype(np.float32))
    assert control.declare_step(cells % n_seqs)
    cache.update_and_fetch(0, cells // n_seqs, kv0, kv0)  # the spec is dropped: no read outlives the write
    table = cell_table(cache)
    assert all(np.array_equal(table.seq_cells(s)[0], cells[s::n_seqs]) for s in ids), "placement is not lowest-free"
    return cache, control


def row_bookkeep(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    n_seqs, h_q = 64, 32
    out = []
    rng = np.random.default_rng(5)
    for used_end in z["book_sizes"]:
        cache, control = interleaved_cells(used_end, n_seqs, rng)
        stepper = cache.as_cell_stepper()
        ids = list(range(n_seqs))
        kv = mx.zeros((1, H_KV, n_seqs, D))
        q = mx.array(rng.normal(size=(1, h_q, n_seqs, D)).astype(np.float32))
        mx.eval(q, kv)

        def book():
            positions = [control.next_pos(s) for s in ids]
            cell_table(cache).free_list()  # warm, as in a steady decode
            t0 = time.perf_counter()
            assert control.declare_step(ids)
            step = stepper.place_step(0, positions)
            groups = cache.step_groups(0, step)  # the grouping, planned once per step (numpy + conversion)
            mx.eval(cache.step_mask(0, step), *([] if groups is None else [groups.tokens, groups.cells, groups.out]))
            dt = time.perf_counter() - t0
            for s, p in zip(ids, positions):  # undo, untimed: same used_end next repeat
                control.seq_rm(s, p)
            return dt

        tb = interleaved({"book": book}, max(z["repeats"], 5))["book"]
        # One layer's attention over the same window: a spec for this step from layer 0.
        positions = [control.next_pos(s) for s in ids]
        assert control.declare_step(ids)
        spec = cache.update_and_fetch(0, positions, kv, kv)
        g, d = grouped_and_dense(q, spec, D**-0.5)
        sides = {"grouped attn": g}
        if used_end <= z["book_dense_max"]:
            sides["dense attn"] = d
        t = interleaved(sides, z["repeats"])
        t["bookkeeping"] = tb
        out.append(Row.from_times("5 bookkeep", f"{used_end // 1024}k cells vs grouped attn", t, "bookkeeping",
                                  "grouped attn", f"groups {'on' if spec.groups is not None else 'off'}"))
        if "dense attn" in t:
            out.append(Row.from_times("5 bookkeep", f"{used_end // 1024}k cells vs dense attn", t, "bookkeeping",
                                      "dense attn"))
        for s in ids:
            control.seq_rm(s, positions[s])
    sizes = ", ".join(f"{s // 1024}k" for s in z["book_sizes"])
    work = (f"64 sequences x 1 token over {sizes} occupied cells (seq s holds cells s, s+64, ...); bookkeeping = "
            "declare_step + place_step (mask for one window) + the grouping plan + both converted to MLX, once "
            f"per step; beside one layer's attend() (H_q={h_q}, H_kv={H_KV}, D={D}, fp32) grouped, and dense up "
            f"to {z['book_dense_max'] // 1024}k (dense over more is minutes per call on this CPU; 128k under --full).")
    return work, out


def decode_step_setup(n_seqs: int, length: int, h_q: int, h_kv: int, d: int, chunk: int = 256, seed: int = 6,
                      path: str = "grouped"):
    """A cell cache holding n_seqs sequences of `length` tokens, prefilled round-robin in chunks
    (so each owns several runs of cells), and the spec of one decode step (one token each).

    Returns (q, spec, ideal_k, ideal_v): ideal_* are each sequence's own K/V, contiguous, as
    `[n_seqs, H_kv, length + 1, D]` (what attending each sequence alone would read).
    """
    rng = np.random.default_rng(seed)
    cap = n_seqs * (length + 1)
    cache = cell_cache(CacheConfig(capacity=cap, n_layers=1, layers=[LayerConfig(h_kv, d)], kv_dtype="float32",
                                   max_seqs=max(n_seqs, 1), initial_capacity=cap))
    cache.attention_path = path
    control = cache.as_batch_control()
    ids = [control.seq_new() for _ in range(n_seqs)]
    for start in range(0, length, chunk):
        for s in ids:
            n = min(chunk, length - start)
            assert control.declare_step([s] * n)
            kv = mx.array(rng.normal(size=(1, h_kv, n, d)).astype(np.float32))
            cache.update_and_fetch(0, list(range(start, start + n)), kv, kv * 0.5)
            cache.key_pools[0].evaluate()
            cache.value_pools[0].evaluate()
    assert control.declare_step(ids)
    k1 = mx.array(rng.normal(size=(1, h_kv, n_seqs, d)).astype(np.float32))
    spec = cache.update_and_fetch(0, [length] * n_seqs, k1, k1 * 0.5)
    q = mx.array(rng.normal(size=(1, h_q, n_seqs, d)).astype(np.float32))  # [1, Hq, T, D]
    owned = np.stack([cell_table(cache).seq_cells(s)[0] for s in ids])  # [N, length + 1], by position
    idx = mx.array(owned.reshape(-1).astype(np.int32))
    ideal_k = mx.take(spec.keys, idx, axis=2).reshape(h_kv, n_seqs, length + 1, d).transpose(1, 0, 2, 3)
    ideal_v = mx.take(spec.values, idx, axis=2).reshape(h_kv, n_seqs, length + 1, d).transpose(1, 0, 2, 3)
    ideal_k, ideal_v = mx.contiguous(ideal_k), mx.contiguous(ideal_v)  # [N, Hkv, L, D]
    mx.eval(q, ideal_k, ideal_v, spec.keys, spec.values, spec.mask)
    return q, spec, ideal_k, ideal_v


def row_grouped(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    n, L = z["group_seqs"], z["group_len"]
    h_q, h_kv, d = z["attn_heads"]
    scale = d**-0.5
    q, spec, ik, iv = decode_step_setup(n, L, h_q, h_kv, d, path="auto")
    _, gathered, _, _ = decode_step_setup(n, L, h_q, h_kv, d, path="grouped")  # the same K/V, gathered
    qi = mx.contiguous(q.transpose(2, 1, 0, 3))  # [N, Hq, 1, D]
    mx.eval(qi)
    g, dn = grouped_and_dense(q, spec, scale)
    pages = [b.page for b in spec.groups.batches()] if spec.groups is not None else []
    chose = ("pages of " + "/".join(str(p) for p in sorted(set(pages))) + " cells") if any(pages) else (
        "gathered" if pages else "dense")

    def gather():
        return timed(lambda: mx.eval(attend(q, gathered, scale)))

    def ideal():
        return timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(qi, ik, iv, scale=scale)))

    def ideal_loop():  # each sequence alone, one SDPA per sequence
        return timed(lambda: mx.eval(*[
            mx.fast.scaled_dot_product_attention(qi[i:i + 1], ik[i:i + 1], iv[i:i + 1], scale=scale)
            for i in range(n)]))

    # the same result four ways
    a = np.array(attend(q, spec, scale))
    b = np.array(attend(q, attrs.evolve(spec, groups=None), scale))
    c = np.array(mx.fast.scaled_dot_product_attention(qi, ik, iv, scale=scale).transpose(2, 1, 0, 3))
    e = np.array(attend(q, gathered, scale))
    err = float(max(np.abs(a - b).max(), np.abs(a - c).max(), np.abs(a - e).max()))
    # The cheap sides get more repeats; dense (seconds per call) is timed against the layout's choice apart.
    t = interleaved({"layout": g, "gathered": gather, "ideal": ideal, "ideal, one SDPA per seq": ideal_loop},
                    3 * z["repeats"])
    td = interleaved({"layout": g, "dense": dn}, z["repeats"])
    note = f"layout chose {chose}; max |layout - dense|, |layout - ideal|, |layout - gathered| = {err:.1e}"
    out = [
        Row.from_times("6 grouped", "decode step: layout / ideal", t, "layout", "ideal", note + "; target <= 1.5"),
        Row.from_times("6 grouped", "decode step: gathered / ideal", t, "gathered", "ideal"),
        Row.from_times("6 grouped", "decode step: layout / ideal per seq", t, "layout", "ideal, one SDPA per seq"),
        Row.from_times("6 grouped", "decode step: layout / dense", td, "layout", "dense", "target <= 0.2 (5x faster)"),
    ]
    scaled = "" if (n, L, h_q) == (32, 1024, 32) else " (scaled down; the issue's under the default/--full)"
    work = (f"one layer's attend() for a decode step of {n} sequences x {L} cells each (prefilled round-robin in "
            f"256-token chunks, so each owns {max(L // 256, 1)} runs of cells), H_q={h_q}, H_kv={h_kv}, D={d}, fp32"
            f"{scaled}; layout = the cell layout's own choice under attention_path 'auto' (pages of the pool "
            "read in place where the cells fill them, else gathered groups); gathered = gather each sequence's "
            f"cells + one batched SDPA; dense = one SDPA over all {n * (L + 1)} cells with the explicit mask; "
            "ideal = the same batched SDPA over each sequence's K/V already contiguous (no gather); planning the "
            "groups is per step, not per layer (row 5).")
    return work, out


