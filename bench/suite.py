"""`kvlayout bench`: kvlayout beside mlx-lm on the same work, one table.

Every comparison runs both sides in this one process, interleaved (one
repeat of each side per round, the order rotating each round), several
repeats; the table gives min and median seconds per side and the ratio of the
medians, A / B in time (below 1: A is faster). Each row states its workload.
Models come only from `kvlayout init-model` (written into a temporary
directory and loaded by both sides); nothing is downloaded.

Rows (one function each, in ROWS):

1. write      one-token update per layer at 1k/8k/32k context, and the total
              time appending tokens one by one from empty: kvlayout seq and
              cell vs mlx_lm.models.cache.KVCache.
2. generate   one sequence, greedy: kvlayout run on mlx:seq / mlx:cell vs
              mlx-lm's generate_step (the loop under mlx_lm.generate); token
              ids checked identical.
3. batch      ragged prompts (16..1024 tokens): mlx:cell vs mlx-lm
              batch_generate (BatchKVCache, left-padded); identical outputs
              checked; peak K/V bytes.
4. prefix     n samples of one prompt: time to first sampled token and K/V
              held, mlx:cell (one prefill, forks) vs mlx-lm (n rows).
5. bookkeep   declare + place + mask (+ grouping) for 64 seqs x 1 token
              beside one layer's attention over the same window.
6. grouped    a decode step of 32 sequences x 1k cells: the layout's choice
              (pages read in place here), gathered groups and the dense mask
              vs the ideal (the same SDPA over each sequence's own, already
              contiguous, cells).
7. fp16       float16 vs float32 attention on this device.

Sizes: the default run is scaled to finish in minutes on a 2-core CPU (each
row says where it is smaller than the issue's sizes); `--full` runs the
issue's sizes, `--quick` a smoke-test run.

    kvlayout bench [--out DIR] [--quick | --full] [--rows write,grouped,...]
    python bench/suite.py [same options]
"""

from __future__ import annotations

import importlib
import json
import platform
import statistics
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import attrs
import mlx.core as mx
import numpy as np

from kvlayout import CacheConfig, LayerConfig
from kvlayout.mlx import attend
from kvlayout.registry import make_plugin_manager

# -- sizes ----------------------------------------------------------------------

SIZES = {
    "quick": dict(
        repeats=2, write_ctx=(1024, 8192), write_reps=5, grow=1024, grow_reps=1, gen_tokens=32,
        batch_ns=(8,), batch_max_prompt=256, batch_tokens=8, prefix_prompt=256, prefix_ns=(1, 4),
        book_sizes=(4096,), book_dense_max=4096, group_seqs=8, group_len=256, attn_heads=(8, 2, 64),
    ),
    "default": dict(
        repeats=3, write_ctx=(1024, 8192, 32768), write_reps=20, grow=8192, grow_reps=2, gen_tokens=256,
        batch_ns=(8, 32), batch_max_prompt=1024, batch_tokens=32, prefix_prompt=1024, prefix_ns=(1, 4, 16),
        book_sizes=(4096, 32768), book_dense_max=4096, group_seqs=32, group_len=1024, attn_heads=(32, 8, 128),
    ),
    "full": dict(
        repeats=5, write_ctx=(1024, 8192, 32768), write_reps=50, grow=32768, grow_reps=2, gen_tokens=256,
        batch_ns=(8, 32), batch_max_prompt=1024, batch_tokens=128, prefix_prompt=1024, prefix_ns=(1, 4, 16),
        book_sizes=(4096, 32768, 131072), book_dense_max=32768, group_seqs=32, group_len=1024,
        attn_heads=(32, 8, 128),
    ),
}
H_KV, D = 8, 128  # rows 1, 5: the K/V shape

# -- measuring ------------------------------------------------------------------


def interleaved(sides: dict[str, Callable[[], float]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each side; each callable times its own work and returns it.

    Round r runs every side once, starting at side r mod n, so drift in the
    machine's load hits every side alike. `warmup` rounds are not kept.
    """
    names = list(sides)
    for _ in range(warmup):
        for n in names:
            sides[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(sides[n]())
    return times


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@attrs.define
class Row:
    """One printed line: side A against side B on one case."""

    row: str
    case: str
    a: str
    b: str
    a_times: list[float]
    b_times: list[float]
    note: str = ""
    extra: dict = attrs.Factory(dict)

    @property
    def ratio(self) -> float:
        return statistics.median(self.a_times) / statistics.median(self.b_times)

    def to_json(self) -> dict:
        return {
            "row": self.row, "case": self.case, "a": self.a, "b": self.b,
            "a_min_s": min(self.a_times), "a_median_s": statistics.median(self.a_times),
            "b_min_s": min(self.b_times), "b_median_s": statistics.median(self.b_times),
            "ratio_a_over_b": self.ratio, "a_times_s": self.a_times, "b_times_s": self.b_times,
            "note": self.note, **self.extra,
        }


def rows_of(row: str, case: str, times: dict[str, list[float]], a: str, b: str, note: str = "", **extra) -> Row:
    return Row(row, case, a, b, times[a], times[b], note, extra)


def mlx_lm_part(name: str):
    return importlib.import_module(f"mlx_lm.{name}")


def fmt_s(x: float) -> str:
    if x < 1e-3:
        return f"{x * 1e6:.0f}us"
    if x < 1:
        return f"{x * 1e3:.1f}ms"
    return f"{x:.2f}s"


# -- row 1: cache write and growth ----------------------------------------------------


def row_write(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout_cell.cache import CellCache
    from kvlayout_seq.mlx_cache import SeqCache

    KVCache = mlx_lm_part("models.cache").KVCache
    rng = np.random.default_rng(0)
    token = mx.array(rng.normal(size=(1, H_KV, 1, D)).astype(np.float16))  # [1, H, 1, D]
    mx.eval(token)
    out: list[Row] = []

    def config(capacity, **kw):
        return CacheConfig(capacity=capacity, n_layers=1, layers=[LayerConfig(H_KV, D)], kv_dtype="float16", **kw)

    # One token written and what it returns evaluated, on each side.
    def put_seq(c, p):
        spec = c.update_and_fetch(0, [p], token, token)
        mx.eval(spec.keys, spec.values)

    def put_cell(c, s, p):
        c.declare_step([s])
        spec = c.update_and_fetch(0, [p], token, token)
        mx.eval(spec.keys, spec.values, spec.mask)

    def put_ref(c):
        k, v = c.update_and_fetch(token, token)
        mx.eval(k, v)

    for L in z["write_ctx"]:
        cap = L + z["write_reps"] * 4 + 64
        seq, cell, ref = SeqCache(config(cap)), CellCache(config(cap), make_plugin_manager()), KVCache()
        s0 = cell.seq_new()
        fill = mx.array(rng.normal(size=(1, H_KV, L, D)).astype(np.float16))
        seq.update_and_fetch(0, list(range(L)), fill, fill)
        assert cell.declare_step([s0] * L)
        cell.update_and_fetch(0, list(range(L)), fill, fill)
        ref.update_and_fetch(fill, fill)
        mx.eval(seq.key_pools[0]._buf, cell.key_pools[0]._buf, ref.keys)

        def one_seq():
            p = seq.length
            return timed(lambda: put_seq(seq, p))

        def one_cell():
            p = cell.next_pos(s0)
            return timed(lambda: put_cell(cell, s0, p))

        def one_ref():
            return timed(lambda: put_ref(ref))

        t = interleaved({"seq": one_seq, "cell": one_cell, "mlx-lm": one_ref}, z["write_reps"], warmup=2)
        out.append(rows_of("1 write", f"1 token @{L // 1024}k: seq", t, "seq", "mlx-lm"))
        out.append(rows_of("1 write", f"1 token @{L // 1024}k: cell", t, "cell", "mlx-lm"))

    n = z["grow"]
    growing: dict[str, list[float]] = {"seq": [], "cell": [], "mlx-lm": []}

    def appended(side, storage, append):
        """Total time appending n tokens; also files under `side` the time the steps that grew the
        storage took beyond a typical step (their sum minus as many median non-growing steps)."""
        steps, grew = np.empty(n), np.zeros(n, dtype=bool)
        for p in range(n):
            before = storage()
            steps[p] = timed(lambda: append(p))
            grew[p] = storage() != before
        growing[side].append(float(steps[grew].sum() - grew.sum() * np.median(steps[~grew])))
        return float(steps.sum())

    def grow_seq():
        c = SeqCache(config(n, initial_capacity=256))
        return appended("seq", lambda: c.key_pools[0].slots, lambda p: put_seq(c, p))

    def grow_cell():
        c = CellCache(config(n, initial_capacity=256), make_plugin_manager())
        s = c.seq_new()
        return appended("cell", lambda: c.key_pools[0].slots, lambda p: put_cell(c, s, p))

    def grow_ref():
        c = KVCache()
        return appended("mlx-lm", lambda: 0 if c.keys is None else c.keys.shape[2], lambda p: put_ref(c))

    t = interleaved({"seq": grow_seq, "cell": grow_cell, "mlx-lm": grow_ref}, z["grow_reps"], warmup=0)
    k = f"{n // 1024}k"
    out.append(rows_of("1 write", f"append {k} from empty: seq", t, "seq", "mlx-lm"))
    out.append(rows_of("1 write", f"append {k} from empty: cell", t, "cell", "mlx-lm"))
    g = {f"{side} growing": times for side, times in growing.items()}
    out.append(rows_of("1 write", f"growing within {k}: seq", g, "seq growing", "mlx-lm growing",
                       "seq: pools double from 256 slots; mlx-lm: a 256-slot concatenation every 256 tokens"))
    out.append(rows_of("1 write", f"growing within {k}: cell", g, "cell growing", "mlx-lm growing"))
    scaled = "" if n == 32768 else " (the issue's 32k under --full)"
    work = (f"one layer, H_kv={H_KV}, D={D}, fp16; one-token update_and_fetch + mx.eval of what it returns at "
            f"{', '.join(f'{L // 1024}k' for L in z['write_ctx'])} context ({z['write_reps']} repeats); total time "
            f"appending {k} tokens one by one from empty{scaled}: pools start at 256 slots and double, "
            "mlx-lm grows by 256-token concatenation. cell pays its per-step bookkeeping and mask too. "
            "'growing' = the time the steps that grew the storage took beyond a median step, summed.")
    return work, out


# -- model rows: 2, 3, 4 ----------------------------------------------------------------


class _NoTokenizer:
    """What batch_generate needs of a tokenizer when prompts are ids: no EOS, no text."""

    eos_token_ids: list[int] = []

    def decode(self, ids):
        return ""


def _run_config(model_dir: Path, layout: str, requests: list[dict], capacity: int, chunk: int = 2048):
    from kvlayout.runner.config import RunConfig

    backend, kind = layout.split(":")
    return RunConfig.from_mapping(
        {
            "layout": {"backend": backend, "kind": kind},
            "cache": {"capacity": capacity, "kv_dtype": "float32", "max_seqs": 64},
            "model": {"path": str(model_dir)},
            "sampling": {"temperature": 0.0},
            "engine": {"prefill_chunk": chunk},
            "requests": requests,
        },
        source="bench",
    )


def _loaded(ctx: dict):
    """(ours, theirs, args): the tiny preset, written as `kvlayout init-model` writes it (on the first
    row that needs a model), loaded by kvlayout's loader and by mlx_lm's, once."""
    if "loaded" not in ctx:
        from kvlayout.runner.loading import load_model
        from kvlayout.runner.presets import write_preset
        from kvlayout.runner.tokenizer import ByteTokenizer

        model_dir = write_preset(ctx["model_dir"], "tiny")
        model, args, _ = load_model(model_dir)
        ours = (model, args, ByteTokenizer(eos_ids=()), str(model_dir))  # no EOS: every sample runs max_tokens
        theirs, _ = mlx_lm_part("utils").load_model(model_dir)
        ctx["loaded"] = (ours, theirs, args)
    return ctx["loaded"]


def row_generate(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout.runner import engine

    generate_step = mlx_lm_part("generate").generate_step
    ours, theirs, _ = _loaded(ctx)
    n = z["gen_tokens"]
    prompt = [(7 * j + 3) % 256 for j in range(32)]
    jobs = {
        lay: engine.prepare(_run_config(ctx["model_dir"], lay, [{"prompt_ids": prompt, "max_tokens": n}], 32 + n),
                            loaded=ours)
        for lay in ("mlx:seq", "mlx:cell")
    }
    got: dict[str, list[int]] = {}

    def ours_side(lay):
        def go():
            t0 = time.perf_counter()
            res = jobs[lay].generate()
            dt = time.perf_counter() - t0
            got[lay] = list(res.outputs[0][0].token_ids)
            return dt
        return go

    def theirs_side():
        t0 = time.perf_counter()
        ids = [int(t) for t, _ in generate_step(mx.array(prompt), theirs, max_tokens=n)]
        dt = time.perf_counter() - t0
        got["mlx-lm"] = ids
        return dt

    t = interleaved({"mlx:seq": ours_side("mlx:seq"), "mlx:cell": ours_side("mlx:cell"), "mlx-lm": theirs_side},
                    z["repeats"])
    out = []
    for lay in ("mlx:seq", "mlx:cell"):
        same = got[lay] == got["mlx-lm"]
        tok_s = n / statistics.median(t[lay]), n / statistics.median(t["mlx-lm"])
        out.append(rows_of("2 generate", f"{n} tokens: {lay}", t, lay, "mlx-lm",
                           f"{tok_s[0]:.0f} vs {tok_s[1]:.0f} tok/s; ids {'identical' if same else 'DIFFER'}",
                           identical=same, tok_s=tok_s[0], baseline_tok_s=tok_s[1]))
    work = (f"tiny preset from `kvlayout init-model` (2 layers, hidden 64, fp32), a 32-token prompt, {n} tokens "
            "greedy, no EOS; wall time of the whole generation (prompt included); kvlayout run's engine "
            "(fp32 K/V) vs mlx_lm.generate.generate_step.")
    return work, out


def _ragged(n: int, longest: int) -> list[list[int]]:
    lengths = np.linspace(16, longest, n).astype(int)
    np.random.default_rng(n).shuffle(lengths)
    return [[(11 * i + 5 * j + 1) % 256 for j in range(L)] for i, L in enumerate(lengths)]


def row_batch(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout.runner import engine

    batch_generate = mlx_lm_part("generate").batch_generate
    ours, theirs, args = _loaded(ctx)
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4  # fp32 K+V, all layers
    m = z["batch_tokens"]
    out = []
    for n in z["batch_ns"]:
        prompts = _ragged(n, z["batch_max_prompt"])
        reqs = [{"prompt_ids": p, "max_tokens": m} for p in prompts]
        cap = sum(len(p) for p in prompts) + n * m
        job = engine.prepare(_run_config(ctx["model_dir"], "mlx:cell", reqs, cap, chunk=512), loaded=ours)
        got: dict[str, object] = {}

        def ours_side():
            t0 = time.perf_counter()
            res = job.generate()
            dt = time.perf_counter() - t0
            got["ours"] = [list(o[0].token_ids) for o in res.outputs]
            got["stats"] = res.stats
            return dt

        def theirs_side():
            t0 = time.perf_counter()
            r = batch_generate(theirs, _NoTokenizer(), prompts, max_tokens=m, return_token_ids=True)
            dt = time.perf_counter() - t0
            got["theirs"] = [list(map(int, ids)) for ids in r.token_ids]
            return dt

        t = interleaved({"mlx:cell": ours_side, "batch_generate": theirs_side}, z["repeats"])
        same = got["ours"] == got["theirs"]
        ours_bytes = got["stats"].peak_cells * per_token
        padded = n * (max(len(p) for p in prompts) + m) * per_token  # the left-padded rectangle, at least
        tok = n * m
        out.append(rows_of(
            "3 batch", f"{n} ragged prompts: mlx:cell", t, "mlx:cell", "batch_generate",
            f"{tok / statistics.median(t['mlx:cell']):.0f} vs {tok / statistics.median(t['batch_generate']):.0f} "
            f"gen tok/s; K/V {ours_bytes / 2**20:.1f} vs {padded / 2**20:.1f} MiB; "
            f"outputs {'identical' if same else 'DIFFER'}",
            identical=same, peak_kv_bytes=ours_bytes, padded_kv_bytes=padded,
        ))
    scaled = "" if z["batch_max_prompt"] == 1024 else " (scaled from 1024)"
    work = (f"tiny preset; {' and '.join(map(str, z['batch_ns']))} requests, prompt lengths spread evenly over "
            f"16..{z['batch_max_prompt']}{scaled}, {m} tokens each greedy, no EOS; wall time prompt included; "
            "mlx:cell with engine.prefill_chunk 512 (prompt tokens per step, decodes ride along; the "
            "fastest of 512/1024/2048 here), mlx-lm with its defaults (prefill batches of 8, step 2048); "
            "K/V bytes: peak cells x fp32 bytes per cell vs n x (longest prompt + max_tokens), the smallest "
            "left-padded rectangle.")
    return work, out


def row_prefix(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout.runner import engine

    batch_generate = mlx_lm_part("generate").batch_generate
    ours, theirs, args = _loaded(ctx)
    P = z["prefix_prompt"]
    prompt = [(13 * j + 7) % 256 for j in range(P)]
    out = []
    for n in z["prefix_ns"]:
        job = engine.prepare(
            _run_config(ctx["model_dir"], "mlx:cell", [{"prompt_ids": prompt, "max_tokens": 1, "n": n}], P + n),
            loaded=ours)
        got = {}

        def ours_side():
            t0 = time.perf_counter()
            res = job.generate()
            dt = time.perf_counter() - t0
            got["cells"] = res.stats.peak_cells
            return dt

        def theirs_side():
            return timed(lambda: batch_generate(theirs, _NoTokenizer(), [prompt] * n, max_tokens=1))

        t = interleaved({"mlx:cell": ours_side, "mlx-lm rows": theirs_side}, z["repeats"])
        out.append(rows_of("4 prefix", f"n={n}: mlx:cell", t, "mlx:cell", "mlx-lm rows",
                           f"cells held {got['cells']} vs {n * (P + 1)} tokens in rows",
                           cells=got["cells"], baseline_tokens=n * (P + 1)))
    scaled = "" if P == 1024 else " (scaled from 1024)"
    work = (f"tiny preset; n samples of one {P}-token prompt{scaled}, time to the first sampled token (max_tokens=1; "
            "wall of the run, prompt included); mlx:cell prefills once and forks with seq_clone, mlx-lm "
            "batch_generate runs n identical rows.")
    return work, out


# -- row 5: bookkeeping ---------------------------------------------------------------


def _grouped_and_dense(q, spec, scale):
    dense = attrs.evolve(spec, groups=None)
    return (lambda: timed(lambda: mx.eval(attend(q, spec, scale))),
            lambda: timed(lambda: mx.eval(attend(q, dense, scale))))


def row_bookkeep(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout_cell.cache import CellCache

    n_seqs, h_q = 64, 32
    out = []
    rng = np.random.default_rng(5)
    for used_end in z["book_sizes"]:
        cache = CellCache(CacheConfig(capacity=used_end + 2 * n_seqs, n_layers=1, layers=[LayerConfig(H_KV, D)],
                                      kv_dtype="float32", max_seqs=n_seqs, initial_capacity=used_end + 2 * n_seqs),
                          make_plugin_manager())
        for _ in range(n_seqs):
            cache.seq_new()
        cells = np.arange(used_end, dtype=np.int64)
        cache.stepper.table.occupy(cells, cells % n_seqs, cells // n_seqs)  # seq s holds cells s, s+64, ... (K/V left random)
        kv0 = mx.array(rng.normal(size=(1, H_KV, used_end, D)).astype(np.float32))
        cache.key_pools[0].write(0, kv0)
        cache.value_pools[0].write(0, kv0)
        ids = list(range(n_seqs))
        kv = mx.zeros((1, H_KV, n_seqs, D))
        q = mx.array(rng.normal(size=(1, h_q, n_seqs, D)).astype(np.float32))
        mx.eval(q, kv)

        def book():
            positions = [cache.next_pos(s) for s in ids]
            cache.free_list()  # warm, as in a steady decode
            t0 = time.perf_counter()
            assert cache.declare_step(ids)
            step = cache.place_step(0, positions)
            groups = cache.step_groups(0, step)  # the grouping, planned once per step (numpy + conversion)
            mx.eval(cache.step_mask(0, step), *([] if groups is None else [groups.tokens, groups.cells, groups.out]))
            dt = time.perf_counter() - t0
            for s, p in zip(ids, positions):  # undo, untimed: same used_end next repeat
                cache.seq_rm(s, p)
            return dt

        tb = interleaved({"book": book}, max(z["repeats"], 5))["book"]
        # One layer's attention over the same window: a spec for this step from layer 0.
        positions = [cache.next_pos(s) for s in ids]
        assert cache.declare_step(ids)
        spec = cache.update_and_fetch(0, positions, kv, kv)
        g, d = _grouped_and_dense(q, spec, D**-0.5)
        sides = {"grouped attn": g}
        if used_end <= z["book_dense_max"]:
            sides["dense attn"] = d
        t = interleaved(sides, z["repeats"])
        t["bookkeeping"] = tb
        out.append(rows_of("5 bookkeep", f"{used_end // 1024}k cells vs grouped attn", t, "bookkeeping",
                           "grouped attn", f"groups {'on' if spec.groups is not None else 'off'}"))
        if "dense attn" in t:
            out.append(rows_of("5 bookkeep", f"{used_end // 1024}k cells vs dense attn", t, "bookkeeping",
                               "dense attn"))
        for s in ids:
            cache.seq_rm(s, positions[s])
    sizes = ", ".join(f"{s // 1024}k" for s in z["book_sizes"])
    work = (f"64 sequences x 1 token over {sizes} occupied cells (seq s holds cells s, s+64, ...); bookkeeping = "
            "declare_step + place_step (mask for one window) + the grouping plan + both converted to MLX, once "
            f"per step; beside one layer's attend() (H_q={h_q}, H_kv={H_KV}, D={D}, fp32) grouped, and dense up "
            f"to {z['book_dense_max'] // 1024}k (dense over more is minutes per call on this CPU; 128k under --full).")
    return work, out


# -- row 6: grouped vs dense vs ideal ---------------------------------------------------


def decode_step_setup(n_seqs: int, length: int, h_q: int, h_kv: int, d: int, chunk: int = 256, seed: int = 6,
                      path: str = "grouped"):
    """A cell cache holding n_seqs sequences of `length` tokens, prefilled round-robin in chunks
    (so each owns several runs of cells), and the spec of one decode step (one token each).

    Returns (q, spec, ideal_k, ideal_v, cache): ideal_* are each sequence's own K/V, contiguous, as
    `[n_seqs, H_kv, length + 1, D]` (what attending each sequence alone would read).
    """
    from kvlayout_cell.cache import CellCache

    rng = np.random.default_rng(seed)
    cap = n_seqs * (length + 1)
    cache = CellCache(CacheConfig(capacity=cap, n_layers=1, layers=[LayerConfig(h_kv, d)], kv_dtype="float32",
                                  max_seqs=max(n_seqs, 1), initial_capacity=cap), make_plugin_manager())
    cache.attention_path = path
    ids = [cache.seq_new() for _ in range(n_seqs)]
    for start in range(0, length, chunk):
        for s in ids:
            n = min(chunk, length - start)
            assert cache.declare_step([s] * n)
            kv = mx.array(rng.normal(size=(1, h_kv, n, d)).astype(np.float32))
            cache.update_and_fetch(0, list(range(start, start + n)), kv, kv * 0.5)
            mx.eval(cache.key_pools[0]._buf, cache.value_pools[0]._buf)
    assert cache.declare_step(ids)
    k1 = mx.array(rng.normal(size=(1, h_kv, n_seqs, d)).astype(np.float32))
    spec = cache.update_and_fetch(0, [length] * n_seqs, k1, k1 * 0.5)
    q = mx.array(rng.normal(size=(1, h_q, n_seqs, d)).astype(np.float32))  # [1, Hq, T, D]
    owned = np.stack([cache.stepper.table.seq_cells(s)[0] for s in ids])  # [N, length + 1], by position
    idx = mx.array(owned.reshape(-1).astype(np.int32))
    ideal_k = mx.take(spec.keys, idx, axis=2).reshape(h_kv, n_seqs, length + 1, d).transpose(1, 0, 2, 3)
    ideal_v = mx.take(spec.values, idx, axis=2).reshape(h_kv, n_seqs, length + 1, d).transpose(1, 0, 2, 3)
    ideal_k, ideal_v = mx.contiguous(ideal_k), mx.contiguous(ideal_v)  # [N, Hkv, L, D]
    mx.eval(q, ideal_k, ideal_v, spec.keys, spec.values, spec.mask)
    return q, spec, ideal_k, ideal_v, cache


def row_grouped(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    n, L = z["group_seqs"], z["group_len"]
    h_q, h_kv, d = z["attn_heads"]
    scale = d**-0.5
    q, spec, ik, iv, _ = decode_step_setup(n, L, h_q, h_kv, d, path="auto")
    _, gathered, _, _, _ = decode_step_setup(n, L, h_q, h_kv, d, path="grouped")  # the same K/V, gathered
    qi = mx.contiguous(q.transpose(2, 1, 0, 3))  # [N, Hq, 1, D]
    mx.eval(qi)
    g, dn = _grouped_and_dense(q, spec, scale)
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
        rows_of("6 grouped", "decode step: layout / ideal", t, "layout", "ideal", note + "; target <= 1.5"),
        rows_of("6 grouped", "decode step: gathered / ideal", t, "gathered", "ideal"),
        rows_of("6 grouped", "decode step: layout / ideal per seq", t, "layout", "ideal, one SDPA per seq"),
        rows_of("6 grouped", "decode step: layout / dense", td, "layout", "dense", "target <= 0.2 (5x faster)"),
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


# -- row 7: fp16 vs fp32 --------------------------------------------------------------


def row_fp16(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    h_q, h_kv, d = z["attn_heads"]
    rng = np.random.default_rng(7)
    out = []
    cases = {"prefill 256 x 4k causal": (256, 4096, "causal"), "decode 32 x 1k": (32, 1024, None)}
    for name, (T, S, mask) in cases.items():
        if mask is None:  # 32 sequences alone: batched, one query each
            shapes = ((T, h_q, 1, d), (T, h_kv, S, d))
        else:
            shapes = ((1, h_q, T, d), (1, h_kv, S, d))
        q32 = mx.array(rng.normal(size=shapes[0]).astype(np.float32))
        k32 = mx.array(rng.normal(size=shapes[1]).astype(np.float32))
        v32 = mx.array(rng.normal(size=shapes[1]).astype(np.float32))
        q16, k16, v16 = (x.astype(mx.float16) for x in (q32, k32, v32))
        mx.eval(q32, k32, v32, q16, k16, v16)

        def side(q, k, v):
            return lambda: timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5,
                                                                                        mask=mask)))

        t = interleaved({"fp16": side(q16, k16, v16), "fp32": side(q32, k32, v32)}, z["repeats"])
        out.append(rows_of("7 fp16", name, t, "fp16", "fp32"))
    work = (f"mx.fast.scaled_dot_product_attention, H_q={h_q}, H_kv={h_kv}, D={d}, q/K/V all in the one dtype, on "
            f"{mx.default_device()}; the runner's kv_dtype 'auto' picks float32 on the CPU because of this.")
    return work, out


ROWS: dict[str, Callable[[dict, dict], tuple[str, list[Row]]]] = {
    "write": row_write,
    "generate": row_generate,
    "batch": row_batch,
    "prefix": row_prefix,
    "bookkeep": row_bookkeep,
    "grouped": row_grouped,
    "fp16": row_fp16,
}

# -- output -------------------------------------------------------------------------


def print_table(results: list[tuple[str, str, list[Row]]]) -> None:
    head = (f"{'row':<11} {'case':<38} {'A':<14} {'A min':>8} {'A med':>8} {'B':<24} {'B min':>8} {'B med':>8} "
            f"{'A/B':>7}")
    print(head)
    print("-" * len(head))
    for key, work, rows in results:
        for r in rows:
            print(f"{r.row:<11} {r.case:<38.38} {r.a:<14.14} {fmt_s(min(r.a_times)):>8} "
                 f"{fmt_s(statistics.median(r.a_times)):>8} {r.b:<24.24} {fmt_s(min(r.b_times)):>8} "
                 f"{fmt_s(statistics.median(r.b_times)):>8} {r.ratio:>7.3f}")
            if r.note:
                print(f"{'':<11} {r.note}")
    print("")
    print("workloads (A/B = median time of A / median time of B; below 1: A is faster):")
    for key, work, _ in results:
        print(f"  {key}: {work}")


# A 3x5 bitmap font for the plot's labels: digits, '.', 'x' and a few letters.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "x": "000101010101000",
    " ": "000000000000000", "-": "000000111000000",
}


def write_png(path: Path, rows: list[Row]) -> None:
    """A bar chart of every row's A/B ratio on a log2 axis (1.0 marked), with numpy and zlib only.

    Bar i (top to bottom) is the i-th line of the table; its label is "i ratio". Green: A faster.
    """
    scale, cw = 2, 4  # font pixels per dot, dots per character cell
    bar_h, gap, left, width = 14, 6, 16 * cw * scale, 600
    h = len(rows) * (bar_h + gap) + gap
    img = np.full((h, left + width + 10, 3), 255, dtype=np.uint8)
    span = 6.0  # log2 range shown on each side of 1.0
    mid = left + width // 2
    img[:, mid] = (0, 0, 0)

    def text(y, x, s):
        for ch in s:
            bits = _FONT.get(ch, _FONT[" "])
            for i, b in enumerate(bits):
                if b == "1":
                    r, c = divmod(i, 3)
                    img[y + r * scale:y + (r + 1) * scale, x + c * scale:x + (c + 1) * scale] = 0
            x += cw * scale

    for i, r in enumerate(rows):
        y = gap + i * (bar_h + gap)
        v = float(np.clip(np.log2(max(r.ratio, 1e-9)), -span, span))
        x0, x1 = sorted((mid, int(mid + v / span * (width // 2))))
        img[y:y + bar_h, x0:max(x1, x0 + 1)] = (60, 160, 60) if r.ratio < 1 else (200, 70, 60)
        text(y + 2, 4, f"{i + 1} {r.ratio:.2f}x"[:16])
    raw = b"".join(b"\x00" + img[y].tobytes() for y in range(img.shape[0]))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", img.shape[1], img.shape[0], 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def run_suite(mode: str = "default", rows: list[str] | None = None, out: Path | None = None) -> dict:
    z = SIZES[mode]
    keys = rows or list(ROWS)
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise ValueError(f"unknown row(s) {', '.join(unknown)}; available: {', '.join(ROWS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="kvlayout-bench-") as tmp:
        ctx: dict = {"model_dir": Path(tmp) / "tiny"}  # written by the first row that loads the model
        for key in keys:
            t0 = time.perf_counter()
            work, got = ROWS[key](z, ctx)
            print(f"[{key}: {time.perf_counter() - t0:.0f}s]", file=sys.stderr)
            results.append((key, work, got))
    print(f"kvlayout bench ({mode}) · mlx {mx.__version__} on {mx.default_device()} · "
         f"mlx-lm {importlib.import_module('mlx_lm').__version__} · {platform.machine()}, {platform.system()}")
    print_table(results)
    payload = {
        "mode": mode, "mlx": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
        "sizes": z,
        "rows": [{"key": k, "workload": w, "results": [r.to_json() for r in rs]} for k, w, rs in results],
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(payload, indent=2))
        flat = [r for _, _, rs in results for r in rs]
        try:
            import matplotlib  # noqa: F401  (optional; not a dependency)

            _plot_matplotlib(out / "bench.png", flat)
        except ImportError:
            write_png(out / "bench.png", flat)
            print(f"wrote {out / 'bench.json'} and {out / 'bench.png'} (matplotlib is not installed: a plain "
                 "bar chart of the A/B ratios on a log2 axis, bar i = table line i; pip install matplotlib for "
                 "a labelled one)")
        else:
            print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return payload


def _plot_matplotlib(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1))
    labels = [f"{r.row}: {r.case} ({r.a} / {r.b})" for r in rows]
    ax.barh(range(len(rows)), [r.ratio for r in rows], color=["tab:green" if r.ratio < 1 else "tab:red" for r in rows])
    ax.set_xscale("log", base=2)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("median time A / B (below 1: A faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """`python bench/suite.py [options]` is `kvlayout bench [options]`: one parser, one row check."""
    from kvlayout.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
