"""Row 12 (shapes): a decode step's attention on the cell layout against the per-sequence ideal, for
every head shape and two histories (issue 15's measurement).

For H_kv x D in 1x32, 2x64, 3x64 (SmolLM2's) and 8x128, and N = 8 and 32 sequences:

- "fresh": each sequence prefilled alone in one step, then one decode step;
- "interleaved": a short prompt each, then 256 decode steps with all N
  sequences in every step, a sequence freed and another forked every 32
  steps (the placement policy decides where every token goes), then the
  measured decode step.

Timed sides, float32, interleaved: the cell layout's `attend()` over the
step's spec (attention_path "auto"); the step for one layer: declare, place,
write, plan (once per step, whichever layer comes first) and attend; a later
layer of the same step: its `update_and_fetch` (the placement and plan
reused, its own write) and `attend`; and the ideal: one batched SDPA over
each sequence's own K/V, already contiguous, padded to the longest with a
key mask. A model's decode step is the first layer plus L - 1 later ones
against L ideals: "model step/ideal" at L = 30 (SmolLM2's layers), where the
once-per-step bookkeeping is shared as it is in a real forward. Every
side's output agrees with the ideal's (the max difference is printed).
"""

from __future__ import annotations

import statistics
import time

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.bench.layouts import cell_cache, cell_table
from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved, timed
from kvlayout.config import CacheConfig, LayerConfig
from kvlayout.mlx import attend

SHAPES = ((1, 32), (2, 64), (3, 64), (8, 128))  # (H_kv, D): rows of 32, 128, 192 and 1024 elements
REP = {32: 2, 64: 3, 128: 4}  # query heads per KV head
MODEL_LAYERS = 30  # SmolLM2-135M's: the "model step" shares one step's bookkeeping over this many layers
LAYERS = 2  # the bench's cache: a first layer (which places and plans) and a later one (which reuses it)


def history(n: int, h_kv: int, d: int, kind: str, rng: np.random.Generator, prompt: int, steps: int):
    """A cell cache and its live ids after `kind` ("fresh" or "interleaved"); the next step is declared
    by the caller."""
    cap = n * (prompt + steps + 64) * 2
    cache = cell_cache(CacheConfig(capacity=cap, n_layers=LAYERS, layers=[LayerConfig(h_kv, d)] * LAYERS,
                                   kv_dtype="float32", max_seqs=2 * n, initial_capacity=cap), lowest_free=False)
    control = cache.as_batch_control()
    ids = [control.seq_new() for _ in range(n)]

    def step(seqs: list[int], positions: list[int]) -> None:
        assert control.declare_step(seqs)
        kv = mx.array(rng.normal(size=(1, h_kv, len(seqs), d)).astype(np.float32))
        for layer in range(LAYERS):
            cache.update_and_fetch(layer, positions, kv, kv * 0.5)

    first = prompt + steps if kind == "fresh" else prompt
    for s in ids:  # each prompt in one step of its own
        step([s] * first, list(range(first)))
    if kind == "interleaved":
        for i in range(steps):
            if i and i % 32 == 0:  # one sequence done, another forks from a live one
                gone = ids.pop(int(rng.integers(len(ids))))
                control.seq_rm(gone)
                ids.append(control.seq_clone(ids[int(rng.integers(len(ids)))]))
            step(list(ids), [control.next_pos(s) for s in ids])
    for pool in (*cache.key_pools, *cache.value_pools):
        pool.evaluate()
    return cache, ids


def ideal_inputs(cache, spec, ids: list[int], q: mx.array):
    """(q [N, Hq, 1, D], K, V [N, H_kv, Lmax, D] each sequence's own, contiguous, key mask [N, 1, 1, Lmax],
    lengths [N]): what the per-sequence ideal attends, taken from the pool the spec reads."""
    owned = [cell_table(cache).seq_cells(s)[0] for s in ids]  # each sequence's cells by position
    lengths = np.array([c.size for c in owned])
    longest = int(lengths.max())
    idx = mx.array(np.stack([np.pad(c, (0, longest - c.size)) for c in owned]).reshape(-1).astype(np.int32))
    _, h_kv, _, d = spec.keys.shape
    n = len(ids)
    pools = (spec.groups.keys, spec.groups.values) if spec.groups is not None else (spec.keys, spec.values)
    ik, iv = (mx.contiguous(mx.take(a, idx, axis=2).reshape(h_kv, n, longest, d).transpose(1, 0, 2, 3)) for a in pools)
    kmask = mx.array((np.arange(longest)[None] < lengths[:, None])[:, None, None, :])
    qi = mx.contiguous(q.transpose(2, 1, 0, 3))
    mx.eval(ik, iv, kmask, qi)
    return qi, ik, iv, kmask, lengths


@attrs.frozen(eq=False)
class DecodeStep:
    """The measured decode step of every live sequence: its queries and its new K (V is K * 0.5)."""

    cache: object
    control: object  # the cache's BatchControl
    ids: list[int]
    positions: list[int]
    k1: mx.array  # [1, H_kv, N, D]
    q: mx.array  # [1, Hq, T, D]
    scale: float

    @classmethod
    def after(cls, cache, ids: list[int], rng: np.random.Generator, h_kv: int, d: int) -> DecodeStep:
        control = cache.as_batch_control()
        positions = [control.next_pos(s) for s in ids]
        k1 = mx.array(rng.normal(size=(1, h_kv, len(ids), d)).astype(np.float32))
        q = mx.array(rng.normal(size=(1, h_kv * REP[d], len(ids), d)).astype(np.float32))
        mx.eval(q, k1)
        return cls(cache, control, ids, positions, k1, q, d**-0.5)

    def place(self):
        """Layer 0's part of the step: declare, place, write and plan; its spec."""
        assert self.control.declare_step(self.ids)
        return self.cache.update_and_fetch(0, self.positions, self.k1, self.k1 * 0.5)

    def later_layer(self):
        """A later layer's part of the step: the placement and plan reused, its own write; its spec."""
        return self.cache.update_and_fetch(1, self.positions, self.k1, self.k1 * 0.5)


def one_case(z: dict, rng: np.random.Generator, h_kv: int, d: int, n: int, kind: str) -> list[Row]:
    """The three lines of one shape, sequence count and history."""
    cache, ids = history(n, h_kv, d, kind, rng, z["shape_prompt"], z["shape_steps"])
    step = DecodeStep.after(cache, ids, rng, h_kv, d)
    spec = step.place()
    qi, ik, iv, kmask, lengths = ideal_inputs(cache, spec, ids, step.q)
    scale = step.scale

    def ideal():
        return timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(qi, ik, iv, scale=scale, mask=kmask)))

    want = mx.fast.scaled_dot_product_attention(qi, ik, iv, scale=scale, mask=kmask).transpose(2, 1, 0, 3)
    plan, share = plan_note(step, spec, want, lengths)
    t = time_attend(step, spec, ideal, 3 * z["repeats"])
    # A spec holding a view of the pools makes the next write copy them whole; a model drops each
    # layer's spec as it attends, so the timed step must too.
    del spec
    cache.abort_step()
    tw, later = time_whole_step(step, ideal, 3 * z["repeats"])
    # L layers of one step: the first (placing, planning) and L - 1 later ones, against L ideals.
    model = {"model step": [statistics.median(tw["whole step"]) + (MODEL_LAYERS - 1) * later],
             "ideal": [MODEL_LAYERS * statistics.median(tw["ideal"])]}
    case = f"{h_kv}x{d} N={n} {kind}"
    keys = {"h_kv": h_kv, "d": d, "n": n, "history": kind}
    return [
        Row.from_times("12 shapes", f"{case}: attn/ideal", t, "layout", "ideal", plan, in_place=share, **keys),
        Row.from_times("12 shapes", f"{case}: layer step/ideal", tw, "whole step", "ideal",
                       "one layer carrying the step's bookkeeping", **keys),
        Row.from_times("12 shapes", f"{case}: model step/ideal", model, "model step", "ideal",
                       f"{MODEL_LAYERS} layers, the bookkeeping once: goal <= 1.3 (attention <= 1.2); "
                       f"a later layer {later * 1e3:.2f} ms", **keys),
    ]


def plan_note(step: DecodeStep, spec, want: mx.array, lengths: np.ndarray) -> tuple[str, float]:
    """What the layout chose for `spec` (paged, gathered or dense), the share of cells it reads in place,
    and how far its attention is from the ideal's output `want`; with that share."""
    err = float(np.abs(np.array(attend(step.q, spec, step.scale)) - np.array(want)).max())
    batches = spec.groups.batches() if spec.groups is not None else ()
    pages = sorted({b.page for b in batches if b.page})
    share = sum(b.cells.size * b.page for b in batches if b.page) / int(lengths.sum())
    chose = f"paged {'/'.join(map(str, pages))}" if pages else ("gathered" if batches else "dense")
    return f"{chose}, {share:.0%} of cells read in place; max |layout - ideal| {err:.1e}", share


def time_attend(step: DecodeStep, spec, ideal, repeats: int) -> dict[str, list[float]]:
    """The layout's `attend()` over the placed step's `spec` against the ideal."""
    q, scale = step.q, step.scale

    def layout():
        return timed(lambda: mx.eval(attend(q, spec, scale)))

    return interleaved({"layout": layout, "ideal": ideal}, repeats)


def time_whole_step(step: DecodeStep, ideal, repeats: int) -> tuple[dict[str, list[float]], float]:
    """The step for layer 0 (declare, place, write, plan, attend) against the ideal, a later layer of the
    same step timed alongside, the step taken back after each; with the later layer's median."""
    q, scale, cache = step.q, step.scale, step.cache
    later_times = []

    def whole():
        t0 = time.perf_counter()
        mx.eval(attend(q, step.place(), scale))
        t1 = time.perf_counter()
        mx.eval(attend(q, step.later_layer(), scale))
        later_times.append(time.perf_counter() - t1)
        cache.abort_step()
        return t1 - t0

    tw = interleaved({"whole step": whole, "ideal": ideal}, repeats)
    later_times[:] = later_times[1:]  # the warm-up round's
    return tw, statistics.median(later_times)


def row_shapes(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    rng = np.random.default_rng(12)
    out = [row for h_kv, d in SHAPES for n in z["shape_seqs"] for kind in ("fresh", "interleaved")
           for row in one_case(z, rng, h_kv, d, n, kind)]
    prompt, steps = z["shape_prompt"], z["shape_steps"]
    work = (f"one layer, float32, H_q = H_kv x (2 at D 32, 3 at D 64, 4 at D 128); fresh = a {prompt + steps}-token "
            f"prompt each then one decode step; interleaved = a {prompt}-token prompt each, then {steps} decode "
            "steps of every sequence (a free and a fork every 32), under the default placement; attn = attend() "
            "on the layout's spec (attention_path auto); step = declare + update_and_fetch + attend; ideal = one "
            "batched SDPA over each sequence's own K/V, contiguous, padded to the longest under a key mask.")
    return work, out
