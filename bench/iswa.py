"""K/V bytes held and decode step time of sliding-window (iSWA) models' caches, side by side (issue 28).

    python bench/iswa.py [--shapes gemma3,gpt_oss] [--seqs 4,32] [--lengths 2048,8192,32768]
                         [--steps 5] [--warmup 2] [--rounds 1] [--chunk 2048] [--only base,iswa,mlx-lm,llama.cpp]
                         [--max-gb 14] [--json PATH]

At the cache + attention level: no model weights, random float16 K/V and queries. Two shapes:
gemma3 (Gemma-3-1B: 26 layers, 1 K/V head of 256, 4 query heads, layer i global iff (i + 1) % 6 == 0,
else a sliding window of 512) and gpt_oss (24 layers, 8 K/V heads of 64, 64 query heads and
attention sinks, even layers a window of 128, odd ones full). For N sequences of L tokens each, per
column:

- base: the cell layout before sliding-window tables, the kvlayout tree at --base (default: a git
  worktree of --base-commit, the commit before the change, made once under the system's temporary
  folder), run with its core and plugins first on PYTHONPATH;
- iswa: the cell layout of this tree, whose sliding-window layers keep only their window;
- mlx-lm: mlx_lm's BatchKVCache (full layers) and BatchRotatingKVCache(max_size=window) (sliding
  ones), masks from the caches' make_mask as mlx-lm's gemma3_text / gpt_oss build them, attention
  by mlx_lm.models.base.scaled_dot_product_attention;
- llama.cpp: its iSWA formula, no run: full layers hold n_ctx = N * L cells, sliding ones
  n_swa * n_seq + n_ubatch (512).

A cell cache is filled one sequence at a time in --chunk-token steps; mlx-lm's, all sequences at once
in chunks of the same length. Then decode steps of one token per sequence through every layer, each
layer's attention computed, everything evaluated at the step's end: --warmup steps, then the median
of --steps (of every round's steps with --rounds R, each column run R times round-robin: the
machine is shared, and its load drifts). "held" is the bytes the K/V arrays occupy (pools, grown
by doubling, or mlx-lm's arrays); "used" the bytes of the cells in use (cells x 2 x H_kv x D x 2 B
per layer).

Each measured column runs in a subprocess of its own, so its memory is returned before the next;
a column whose estimated bytes exceed --max-gb is not run (it says so), and a column that fails
(the new tree may be mid-change) prints its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import write_json

BASE_COMMIT = "8846d4f"  # the last commit whose cell layout kept one table for every layer
COLUMNS = ("base", "iswa", "mlx-lm", "llama.cpp")
MEASURED = ("base", "iswa", "mlx-lm")
N_UBATCH = 512  # llama.cpp's default n_ubatch: the SWA cache's room for one micro-batch
FP16 = 2
ROOM = 4096  # cells a cell cache's capacity holds past the N x L prefilled (the decode steps', and more)
PAGE_ROOM = 1024  # what rounding capacity up to whole pages may add to a pool (the estimate's slack)


@dataclass(frozen=True)
class Shape:
    name: str
    n_kv_heads: int
    head_dim: int
    n_q_heads: int
    windows: tuple[int, ...]  # per layer: 0 = full (flat) attention, else the sliding window
    sinks: bool  # gpt-oss's per-head attention sinks

    @property
    def cell_bytes(self) -> int:
        """One token's K and V in one layer, float16."""
        return 2 * self.n_kv_heads * self.head_dim * FP16


SHAPES = {
    "gemma3": Shape("gemma3", 1, 256, 4, tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26)), False),
    "gpt_oss": Shape("gpt_oss", 8, 64, 64, tuple(128 if i % 2 == 0 else 0 for i in range(24)), True),
}


# -- what each column is expected to hold (llama.cpp's is the answer itself) ---------------------


def formula_bytes(shape: Shape, n: int, length: int) -> int:
    """llama.cpp's iSWA cache: n_ctx = N * L cells for full layers, n_swa * n_seq + n_ubatch for SWA ones."""
    cells = [n * length if w == 0 else w * n + N_UBATCH for w in shape.windows]
    return sum(cells) * shape.cell_bytes


def _doubled(need: int, start: int = 512) -> int:
    """Slots a pool that starts at `start` and doubles reaches to hold `need`."""
    slots = start
    while slots < need:
        slots *= 2
    return slots


def estimate_bytes(column: str, shape: Shape, n: int, length: int, chunk: int) -> int:
    """Peak K/V bytes a column should need (pools doubled past the tokens, plus one pool's copy while
    it grows), so a run that cannot fit is skipped instead of swapping the machine to death."""
    tokens = n * length + n * 16  # the decode steps' tokens too
    full = sum(1 for w in shape.windows if w == 0)
    if column == "base":
        slots = min(_doubled(tokens), tokens + ROOM + PAGE_ROOM)
        return len(shape.windows) * slots * shape.cell_bytes * 5 // 4
    if column == "iswa":
        slots = min(_doubled(tokens), tokens + ROOM + PAGE_ROOM)
        sliding = sum(_doubled(w * n + chunk) for w in shape.windows if w)
        return (full * slots + sliding) * shape.cell_bytes * 5 // 4
    if column == "mlx-lm":  # arrays grown by concatenation: old and new side by side while one grows
        sliding = sum(n * (w + chunk) for w in shape.windows if w)
        return (full * tokens + sliding) * shape.cell_bytes + 2 * tokens * shape.cell_bytes
    return 0


# -- the child: one column, one (shape, N, L) ------------------------------------------------------


def _cell_config(shape: Shape, n: int, length: int):
    from kvlayout.config import CacheConfig, LayerConfig, LayerPolicy

    def layer(w: int) -> LayerConfig:
        policy = LayerPolicy("ring", w) if w else LayerPolicy("flat")
        return LayerConfig(n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim, policy=policy)

    return CacheConfig(capacity=n * length + ROOM, n_layers=len(shape.windows),
                       layers=[layer(w) for w in shape.windows], kv_dtype="float16",
                       initial_capacity=512, max_seqs=max(n, 1))


def _cell_fill(cache, bc, ids: list[int], shape: Shape, length: int, chunk: int) -> None:
    """Prefill every sequence, one at a time, `chunk` tokens a step; pools evaluated after each step so
    the graph stays one step deep."""
    import mlx.core as mx

    k = mx.random.normal((1, shape.n_kv_heads, chunk, shape.head_dim)).astype(mx.float16)  # [1, H, C, D]
    v = mx.random.normal((1, shape.n_kv_heads, chunk, shape.head_dim)).astype(mx.float16)
    mx.eval(k, v)
    for sid in ids:
        for start in range(0, length, chunk):
            t = min(chunk, length - start)
            if not bc.declare_step([sid] * t):
                raise RuntimeError(f"declare_step refused {t} tokens of seq {sid} at {start}")
            for layer in range(len(shape.windows)):
                cache.update_and_fetch(layer, range(start, start + t), k[:, :, :t], v[:, :, :t])
            for pool in (*cache.key_pools, *cache.value_pools):
                pool.evaluate()


def _cell_used_bytes(bc, shape: Shape) -> int:
    """Cells in use x bytes per cell, per layer: the new tree says it per window, the old holds every
    token in every layer."""
    by_window = getattr(bc, "cells_by_window", None)
    if by_window is None:
        return (bc.capacity - bc.free_cells) * shape.cell_bytes * len(shape.windows)
    cells = by_window()
    return sum(cells[w] for w in shape.windows) * shape.cell_bytes


def _time_steps(step, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of `steps` calls of `step`, after `warmup` untimed ones."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def run_cell(shape: Shape, n: int, length: int, warmup: int, steps: int, chunk: int) -> dict:
    import mlx.core as mx

    import kvlayout_cell
    from kvlayout.mlx import attend
    from kvlayout.registry import resolve

    cache = resolve("mlx", "cell").build(_cell_config(shape, n, length))
    bc = cache.as_batch_control()
    ids = [bc.seq_new() for _ in range(n)]
    t0 = time.perf_counter()
    _cell_fill(cache, bc, ids, shape, length, chunk)
    fill_s = time.perf_counter() - t0
    k = mx.random.normal((1, shape.n_kv_heads, n, shape.head_dim)).astype(mx.float16)  # [1, H_kv, N, D]
    v = mx.random.normal((1, shape.n_kv_heads, n, shape.head_dim)).astype(mx.float16)
    q = mx.random.normal((1, shape.n_q_heads, n, shape.head_dim)).astype(mx.float16)  # [1, H_q, N, D]
    sinks = mx.zeros((shape.n_q_heads,), dtype=mx.float16) if shape.sinks else None
    mx.eval(k, v, q)
    scale = shape.head_dim**-0.5
    pos = [length]  # the next position of every sequence (all the same length)

    def step() -> None:
        if not bc.declare_step(ids):
            raise RuntimeError(f"declare_step refused a decode step at position {pos[0]}")
        outs = []
        for layer in range(len(shape.windows)):
            spec = cache.update_and_fetch(layer, [pos[0]] * n, k, v)
            outs.append(attend(q, spec, scale, sinks=sinks))  # [1, H_q, N, D]
        mx.eval(outs)
        pos[0] += 1

    times = _time_steps(step, warmup, steps)
    held = sum(p.nbytes for p in (*cache.key_pools, *cache.value_pools))
    return {"held": held, "used": _cell_used_bytes(bc, shape), "step_ms": statistics.median(times),
            "steps_ms": times, "fill_s": fill_s, "source": kvlayout_cell.__file__}


def _mlx_lm_caches(shape: Shape, n: int) -> list:
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    pad = [0] * n  # every sequence the same length: no left padding
    return [BatchRotatingKVCache(max_size=w, left_padding=pad) if w else BatchKVCache(left_padding=pad)
            for w in shape.windows]


def run_mlx_lm(shape: Shape, n: int, length: int, warmup: int, steps: int, chunk: int) -> dict:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.base import scaled_dot_product_attention

    caches = _mlx_lm_caches(shape, n)
    t0 = time.perf_counter()
    k = mx.random.normal((n, shape.n_kv_heads, chunk, shape.head_dim)).astype(mx.float16)  # [N, H, C, D]
    v = mx.random.normal((n, shape.n_kv_heads, chunk, shape.head_dim)).astype(mx.float16)
    mx.eval(k, v)
    for start in range(0, length, chunk):
        t = min(chunk, length - start)
        for c in caches:
            c.update_and_fetch(k[:, :, :t], v[:, :, :t])
            mx.eval(c.keys, c.values)
    fill_s = time.perf_counter() - t0
    k = mx.random.normal((n, shape.n_kv_heads, 1, shape.head_dim)).astype(mx.float16)  # [N, H_kv, 1, D]
    v = mx.random.normal((n, shape.n_kv_heads, 1, shape.head_dim)).astype(mx.float16)
    q = mx.random.normal((n, shape.n_q_heads, 1, shape.head_dim)).astype(mx.float16)  # [N, H_q, 1, D]
    sinks = mx.zeros((shape.n_q_heads,), dtype=mx.float16) if shape.sinks else None
    mx.eval(k, v, q)
    scale = shape.head_dim**-0.5
    full = next(c for c, w in zip(caches, shape.windows) if w == 0)
    slide = next(c for c, w in zip(caches, shape.windows) if w)
    window = next(w for w in shape.windows if w)

    def step() -> None:
        # As gemma3_text / gpt_oss do: both masks from one cache of each kind, before any layer writes.
        full_mask = full.make_mask(1)
        swa_mask = slide.make_mask(1, window_size=window)
        outs = []
        for c, w in zip(caches, shape.windows):
            keys, values = c.update_and_fetch(k, v)
            mask = swa_mask if w else full_mask
            outs.append(scaled_dot_product_attention(q, keys, values, c, scale=scale, mask=mask, sinks=sinks))
        mx.eval(outs)

    times = _time_steps(step, warmup, steps)
    held = sum(c.nbytes for c in caches)
    return {"held": held, "used": held, "step_ms": statistics.median(times), "steps_ms": times,
            "fill_s": fill_s, "source": mlx_lm.__file__, "mlx_lm": mlx_lm.__version__}


def child(a: argparse.Namespace) -> None:
    """Measure one column and print its figures as one JSON line (the parent reads the last line)."""
    shape = SHAPES[a.shape]
    if a.child == "base":  # the point of the column: the old tree, not this one
        import kvlayout_cell

        if not kvlayout_cell.__file__.startswith(a.base):
            raise RuntimeError(f"base column imported {kvlayout_cell.__file__}, not the tree at {a.base}")
    run = run_mlx_lm if a.child == "mlx-lm" else run_cell
    out = run(shape, a.n, a.length, a.warmup, a.steps, a.chunk)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps(out))


# -- the parent: every row, every column, one subprocess each --------------------------------------


def _child_env(column: str, base: str) -> dict:
    env = dict(os.environ)
    if column == "base":  # the installed editable dists' entry points then resolve to the base tree
        paths = [f"{base}/core", f"{base}/plugins/cell_layout", f"{base}/plugins/seq_layout"]
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_column(column: str, shape: Shape, n: int, length: int, a: argparse.Namespace) -> dict:
    """One measured column in a subprocess: its figures, or {"error": ...} / {"skipped": ...}."""
    need = estimate_bytes(column, shape, n, length, a.chunk)
    if need > a.max_gb * 2**30:
        return {"skipped": f"not run: needs ~{need / 2**30:.1f} GB", "estimate": need}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", column, "--shape", shape.name,
           "--n", str(n), "--length", str(length), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--chunk", str(a.chunk), "--base", a.base or ""]
    # cwd: the bench folder, so the base column does not pick this tree up from the current directory.
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                              env=_child_env(column, a.base), cwd=Path(__file__).parent)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout} s", "estimate": need}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return {"error": tail[0][:300], "stderr": proc.stderr[-4000:], "estimate": need}
    return {**json.loads(lines[-1]), "estimate": need}


def _merge(runs: list[dict]) -> dict:
    """One column's rounds as one result: the last round's bytes (the same every round), the median
    of every timed step of every round, and each round's own median (how much the machine drifted)."""
    out = dict(runs[-1])
    out["steps_ms"] = [t for r in runs for t in r["steps_ms"]]
    out["step_ms"] = statistics.median(out["steps_ms"])
    out["round_ms"] = [r["step_ms"] for r in runs]
    return out


def measure_row(shape: Shape, n: int, length: int, columns: list[str], a: argparse.Namespace) -> dict:
    """Every column of one (shape, N, L). With --rounds R the measured columns run R times each,
    round-robin in an order rotated every round, so drift in a shared machine's load hits all alike."""
    row = {"shape": shape.name, "n": n, "length": length}
    measured = [c for c in columns if c in MEASURED]
    runs: dict[str, list[dict]] = {c: [] for c in measured}
    for i in range(a.rounds if measured else 0):
        turn = i % len(measured)
        for column in measured[turn:] + measured[:turn]:
            if runs[column] and "held" not in runs[column][-1]:
                continue  # failed or skipped: once is enough
            r = run_column(column, shape, n, length, a)
            runs[column].append(r)
            what = r.get("error") or r.get("skipped") or f"{r['held'] / 2**20:.1f} MiB, {r['step_ms']:.2f} ms"
            print(f"  {shape.name} N={n} L={length} {column}: {what}", file=sys.stderr, flush=True)
    for column in columns:
        if column == "llama.cpp":
            row[column] = {"held": formula_bytes(shape, n, length), "used": formula_bytes(shape, n, length)}
        elif "held" not in runs[column][-1]:
            row[column] = runs[column][-1]
        else:
            row[column] = _merge(runs[column])
    return row


# -- the table -------------------------------------------------------------------------------------


def _mib(x: float) -> str:
    return f"{x / 2**20:,.1f}"


def _ratio(x: float | None, base: float | None) -> str:
    return f"{x / base:.3f}x" if x is not None and base else "-"


def _cells(column: str, r: dict, base: dict) -> list[str]:
    """A column's cells of one row: held MiB, used MiB, held/base, step ms, ms/base."""
    if "held" not in r:
        return [r.get("skipped") or f"error: {r.get('error')}", "", "", "", ""]
    ms = r.get("step_ms")
    return [_mib(r["held"]), _mib(r["used"]), _ratio(r["held"], base.get("held")),
            "-" if ms is None else f"{ms:.2f}", _ratio(ms, base.get("step_ms"))]


def markdown(rows: list[dict], columns: list[str]) -> str:
    head = ["shape", "N", "L"]
    for c in columns:
        head += [f"{c} held MiB", f"{c} used MiB", f"{c} held/base", f"{c} step ms", f"{c} ms/base"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        base = row.get("base", {})
        cells = [row["shape"], str(row["n"]), str(row["length"])]
        for c in columns:
            cells += _cells(c, row[c], base)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="gemma3,gpt_oss")
    ap.add_argument("--seqs", type=_ints, default=[4, 32])
    ap.add_argument("--lengths", type=_ints, default=[2048, 8192, 32768])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each measured column, round-robin")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    ap.add_argument("--only", default=",".join(COLUMNS), help="columns, comma-separated")
    ap.add_argument("--max-gb", type=float, default=14.0, help="skip a column estimated to need more")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one column may run")
    ap.add_argument("--base", default=None, help="a kvlayout tree of the single-table cell layout")
    ap.add_argument("--base-commit", default=BASE_COMMIT, help="the commit --base defaults to a worktree of")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=MEASURED, help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=tuple(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return ap.parse_args()


def base_worktree(commit: str) -> str:
    """A git worktree of `commit` of this repository (made once, then reused): the base column's tree."""
    import tempfile

    tree = Path(tempfile.gettempdir()) / f"kvlayout-iswa-base-{commit}"
    if not tree.exists():
        repo = Path(__file__).resolve().parent.parent
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), commit],
                       check=True, capture_output=True)
    return str(tree)


def main() -> None:
    a = parse_args()
    if a.child:
        child(a)
        return
    if a.base is None and "base" in a.only.split(","):
        a.base = base_worktree(a.base_commit)
    columns = [c for c in a.only.split(",") if c]
    unknown = sorted(set(columns) - set(COLUMNS)) + sorted(set(a.shapes.split(",")) - set(SHAPES))
    if unknown:
        sys.exit(f"unknown column or shape: {', '.join(unknown)}")
    rows = []
    for name in a.shapes.split(","):
        for n in a.seqs:
            for length in a.lengths:
                rows.append(measure_row(SHAPES[name], n, length, columns, a))
    print(markdown(rows, columns))
    for row in rows:
        for c in columns:
            if "error" in row[c]:
                print(f"\n{row['shape']} N={row['n']} L={row['length']} {c} failed:\n{row[c].get('stderr', '')}")
    write_json(a.json, "iswa", shapes={k: asdict(v) for k, v in SHAPES.items()}, rows=rows,
               steps=a.steps, warmup=a.warmup, rounds=a.rounds, chunk=a.chunk)


if __name__ == "__main__":
    main()
