"""Rows 2-4 (generate, batch, prefix): the tiny model through `kvlayout run`'s engine vs mlx-lm.

The model is the tiny preset, written as `kvlayout init-model` writes it into
the suite's temporary directory by the first of these rows that runs, and
loaded once by kvlayout's loader and once by mlx-lm's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvlayout.bench import peers
from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved, timed
from kvlayout.builder import split_layout_key


class IdsOnly:
    """What batch_generate needs of a tokenizer when prompts are ids: no EOS, no text (rows 3, 4, 9)."""

    eos_token_ids: list[int] = []

    def decode(self, ids):
        return ""


def run_config(model_dir: Path, layout: str, requests: list[dict], capacity: int, chunk: int = 2048,
               pipeline: bool = True):
    """A run config for `requests` on `model_dir` through `layout`: greedy, fp32 K/V; `pipeline` False:
    every step waits for its logits on the host (engines.ahead)."""
    from kvlayout.runner.config import RunConfig

    backend, kind = split_layout_key(layout)
    return RunConfig.from_mapping(
        {
            "layout": {"backend": backend, "kind": kind},
            "cache": {"capacity": capacity, "kv_dtype": "float32", "max_seqs": 64},
            "model": {"path": str(model_dir)},
            "sampling": {"temperature": 0.0},
            "engine": {"prefill_chunk": chunk, "pipeline": pipeline},
            "requests": requests,
        },
        source="bench",
    )


def load_both(model_dir: Path):
    """(ours, theirs, tokenizer): `model_dir` loaded by kvlayout's loader, as `jobs.prepare(loaded=)` takes
    it but with no EOS (every sample runs its max_tokens: both sides do the same work), and by mlx-lm's;
    `tokenizer` is kvlayout's own for the directory."""
    from kvlayout.models.loading import load_model
    from kvlayout.models.tokenizer import ByteTokenizer

    model, args, tokenizer = load_model(model_dir)
    ours = (model, args, ByteTokenizer(eos_ids=()), str(model_dir))  # prompts are ids: only the EOS matters
    theirs, _ = peers.mlx_lm("utils").load_model(model_dir)
    return ours, theirs, tokenizer


def _loaded(ctx: dict):
    """(ours, theirs, args): the tiny preset, written as `kvlayout init-model` writes it (on the first
    row that needs a model), loaded by both sides once."""
    if "loaded" not in ctx:
        from kvlayout.models.presets import write_preset

        ours, theirs, _ = load_both(write_preset(ctx["model_dir"], "tiny"))
        ctx["loaded"] = (ours, theirs, ours[1])
    return ctx["loaded"]


def row_generate(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout.runner import job as jobs

    generate_step = peers.mlx_lm("generate").generate_step
    ours, theirs, _ = _loaded(ctx)
    n = z["gen_tokens"]
    prompt = [(7 * j + 3) % 256 for j in range(32)]
    jobs = {
        lay: jobs.prepare(run_config(ctx["model_dir"], lay, [{"prompt_ids": prompt, "max_tokens": n}], 32 + n),
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
        out.append(Row.from_times("2 generate", f"{n} tokens: {lay}", t, lay, "mlx-lm",
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
    from kvlayout.runner import job as jobs

    batch_generate = peers.mlx_lm("generate").batch_generate
    ours, theirs, args = _loaded(ctx)
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * 4  # fp32 K+V, all layers
    m = z["batch_tokens"]
    out = []
    for n in z["batch_ns"]:
        prompts = _ragged(n, z["batch_max_prompt"])
        reqs = [{"prompt_ids": p, "max_tokens": m} for p in prompts]
        cap = sum(len(p) for p in prompts) + n * m
        job = jobs.prepare(run_config(ctx["model_dir"], "mlx:cell", reqs, cap, chunk=512), loaded=ours)
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
            r = batch_generate(theirs, IdsOnly(), prompts, max_tokens=m, return_token_ids=True)
            dt = time.perf_counter() - t0
            got["theirs"] = [list(map(int, ids)) for ids in r.token_ids]
            return dt

        t = interleaved({"mlx:cell": ours_side, "batch_generate": theirs_side}, z["repeats"])
        same = got["ours"] == got["theirs"]
        ours_bytes = got["stats"].peak_cells * per_token
        padded = n * (max(len(p) for p in prompts) + m) * per_token  # the left-padded rectangle, at least
        tok = n * m
        out.append(Row.from_times(
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
    from kvlayout.runner import job as jobs

    batch_generate = peers.mlx_lm("generate").batch_generate
    ours, theirs, args = _loaded(ctx)
    P = z["prefix_prompt"]
    prompt = [(13 * j + 7) % 256 for j in range(P)]
    out = []
    for n in z["prefix_ns"]:
        job = jobs.prepare(
            run_config(ctx["model_dir"], "mlx:cell", [{"prompt_ids": prompt, "max_tokens": 1, "n": n}], P + n),
            loaded=ours)
        got = {}

        def ours_side():
            t0 = time.perf_counter()
            res = job.generate()
            dt = time.perf_counter() - t0
            got["cells"] = res.stats.peak_cells
            return dt

        def theirs_side():
            return timed(lambda: batch_generate(theirs, IdsOnly(), [prompt] * n, max_tokens=1))

        t = interleaved({"mlx:cell": ours_side, "mlx-lm rows": theirs_side}, z["repeats"])
        out.append(Row.from_times("4 prefix", f"n={n}: mlx:cell", t, "mlx:cell", "mlx-lm rows",
                                  f"cells held {got['cells']} vs {n * (P + 1)} tokens in rows",
                                  cells=got["cells"], baseline_tokens=n * (P + 1)))
    scaled = "" if P == 1024 else " (scaled from 1024)"
    work = (f"tiny preset; n samples of one {P}-token prompt{scaled}, time to the first sampled token (max_tokens=1; "
            "wall of the run, prompt included); mlx:cell prefills once and forks with seq_clone, mlx-lm "
            "batch_generate runs n identical rows.")
    return work, out


