"""Row 14 (host): the host's own time per decode step, kvlayout's engine against mlx-lm's loops.

On an Apple GPU a small model's decode step is a few milliseconds of device
work, and what the host spends building the step's graph comes on top
(MLX overlaps it only partly). The tiny preset makes that visible on any
machine: its device work is trivial, so its decode speed is the host's.

What is timed: each side's whole generation (wall time), and the CPU time
of the thread that drives it (`time.thread_time`: time spent waiting for a
result does not count, nor time the thread was not running), less that
thread's CPU time inside `mx.async_eval` (where MLX takes the step's graph;
on the CPU it also runs much of the work there). What remains, divided by
the tokens, is the host time of a step: building the graph (the model, the
layout's bookkeeping, the engine's scheduling) and recording the tokens.
Both sides are timed the same way, in one process, interleaved.

- 1 sequence: `mlx:seq` and `mlx:cell` through `kvlayout run`'s engine
  against mlx-lm's `generate_step`, on the tiny preset at 2 layers and at
  `host_layers` layers; the difference between the two depths splits the
  host time into a per-layer and a per-step part.
- N sequences (8, 32): `mlx:cell` against mlx-lm's `batch_generate`
  (its BatchGenerator), distinct short prompts, every sequence decoding.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from kvlayout.bench import peers
from kvlayout.bench.model_rows import IdsOnly, load_both, run_config
from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved

SERVED_CELLS = 16384  # `kvlayout serve`'s default cache.capacity: the room a batch decodes in as served


class AsyncEvalClock:
    """The driving thread's CPU seconds inside `mx.async_eval` while `timing()` is open."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextlib.contextmanager
    def timing(self) -> Iterator[AsyncEvalClock]:
        """Count the CPU time of every `mx.async_eval` call (both sides call it through the module
        attribute) until the block ends; the original is put back whatever happens."""
        real = mx.async_eval

        def counted(*arrays):
            t0 = time.thread_time()
            try:
                return real(*arrays)
            finally:
                self.seconds += time.thread_time() - t0

        self.seconds = 0.0
        mx.async_eval = counted
        try:
            yield self
        finally:
            mx.async_eval = real


def host_timed(run: Callable[[], object]) -> tuple[float, float, object]:
    """(wall seconds, host seconds: the thread's CPU time outside mx.async_eval, what it returned) of `run()`."""
    clock = AsyncEvalClock()
    with clock.timing():
        t0, c0 = time.perf_counter(), time.thread_time()
        out = run()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return wall, cpu - clock.seconds, out


def opcodes(run: Callable[[], object]) -> int:
    """The Python bytecodes the calling thread runs in `run()` (`sys.settrace` opcode events).

    Unlike time on a shared machine, the same code gives the same count on every run: the host's
    own work per step, measured exactly (native work inside MLX or numpy calls is not counted)."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        run()
    finally:
        sys.settrace(previous)
    return count


class Rounds:
    """Each side's wall and host seconds, one entry per call, as `interleaved` makes the calls."""

    def __init__(self) -> None:
        self.got: dict[str, dict[str, list[float]]] = {}
        self.ids: dict[str, list[list[int]]] = {}  # each side's token ids, as its last call gave them
        self.runs: dict[str, Callable[[], list[list[int]]]] = {}  # each side's last run, to count (`count`)

    def count(self) -> dict[str, int]:
        """{side: Python opcodes of its run} (`opcodes`), each side's last run made once more, untimed."""
        return {side: opcodes(run) for side, run in self.runs.items()}

    def timed(self, side: str, run: Callable[[], list[list[int]]]) -> float:
        """`run()` (each sequence's token ids) timed (`host_timed`) and recorded for `side`; its wall
        seconds, for `interleaved`."""
        self.runs[side] = run
        wall, host, self.ids[side] = host_timed(run)
        times = self.got.setdefault(side, {"wall": [], "host": []})
        times["wall"].append(wall)
        times["host"].append(host)
        return wall

    def kept(self) -> dict[str, dict[str, list[float]]]:
        """{side: {"wall": [...], "host": [...]}} of the rounds `interleaved` keeps (each side's first
        call was its warm-up)."""
        return {side: {k: v[1:] for k, v in times.items()} for side, times in self.got.items()}

    def identical(self, side: str, baseline: str) -> bool:
        """Whether `side` gave the token ids `baseline` gave."""
        return self.ids[side] == self.ids[baseline]


def _tiny(ctx: dict, layers: int):
    """(ours, theirs, directory) of the tiny preset at `layers` layers, written and loaded once per run."""
    key = f"host_tiny_{layers}"
    if key not in ctx:
        from kvlayout.models.presets import write_preset

        model_dir = write_preset(Path(ctx["model_dir"]).parent / f"host-tiny-{layers}", "tiny",
                                 num_hidden_layers=layers)
        ours, theirs, _ = load_both(model_dir)
        ctx[key] = (ours, theirs, model_dir)
    return ctx[key]


def _single(z: dict, ctx: dict, layers: int) -> Rounds:
    """The Rounds of one sequence decoding `host_tokens` tokens."""
    from kvlayout.runner import job as jobs

    generate_step = peers.mlx_lm("generate").generate_step
    ours, theirs, model_dir = _tiny(ctx, layers)
    n = z["host_tokens"]
    prompt = [(7 * j + 3) % 256 for j in range(16)]
    rounds = Rounds()

    def ours_side(layout: str):
        def go():
            job = jobs.prepare(run_config(model_dir, layout, [{"prompt_ids": prompt, "max_tokens": n}],
                                          len(prompt) + n), loaded=ours)
            return rounds.timed(layout, lambda: [list(o[0].token_ids) for o in job.generate().outputs])
        return go

    def theirs_side():
        return rounds.timed("mlx-lm", lambda: [[int(t) for t, _ in generate_step(mx.array(prompt), theirs,
                                                                                     max_tokens=n)]])

    interleaved({"mlx:seq": ours_side("mlx:seq"), "mlx:cell": ours_side("mlx:cell"), "mlx-lm": theirs_side},
                z["host_repeats"])
    return rounds


def _batch(z: dict, ctx: dict, seqs: int) -> Rounds:
    """The Rounds of `seqs` distinct prompts decoding together."""
    from kvlayout.runner import job as jobs

    batch_generate = peers.mlx_lm("generate").batch_generate
    ours, theirs, model_dir = _tiny(ctx, 2)
    n = z["host_batch_tokens"]
    prompts = [[(11 * i + 5 * j + 1) % 256 for j in range(16)] for i in range(seqs)]
    reqs = [{"prompt_ids": p, "max_tokens": n} for p in prompts]
    rounds = Rounds()

    def ours_side():
        job = jobs.prepare(run_config(model_dir, "mlx:cell", reqs, max(seqs * (16 + n), SERVED_CELLS), chunk=512),
                           loaded=ours)
        return rounds.timed("mlx:cell", lambda: [list(o[0].token_ids) for o in job.generate().outputs])

    def theirs_side():
        return rounds.timed("batch_generate", lambda: [list(map(int, ids)) for ids in batch_generate(
            theirs, IdsOnly(), prompts, max_tokens=n, return_token_ids=True).token_ids])

    interleaved({"mlx:cell": ours_side, "batch_generate": theirs_side}, z["host_repeats"])
    return rounds


def _single_rows(z: dict, ctx: dict, layers: int, per_step: dict[int, dict[str, float]]) -> list[Row]:
    """The two rows of one sequence at `layers` layers; each side's host seconds a step into `per_step`."""
    n = z["host_tokens"]
    rounds = _single(z, ctx, layers)
    got, ops = rounds.kept(), {side: count / n for side, count in rounds.count().items()}
    walls = {side: t["wall"] for side, t in got.items()}
    per_step[layers] = {side: min(t["host"]) / n for side, t in got.items()}
    rows = []
    for layout in ("mlx:seq", "mlx:cell"):
        tok_s = n / min(walls[layout]), n / min(walls["mlx-lm"])
        host = per_step[layers][layout] * 1e3, per_step[layers]["mlx-lm"] * 1e3
        same = rounds.identical(layout, "mlx-lm")
        rows.append(Row.from_times(
            "14 host", f"1 seq, {layers} layers: {layout}", walls, layout, "mlx-lm",
            f"{tok_s[0]:.0f} vs {tok_s[1]:.0f} tok/s ({tok_s[0] / tok_s[1]:.2f}x); host {host[0]:.3f} vs "
            f"{host[1]:.3f} ms a step; {ops[layout]:.0f} vs {ops['mlx-lm']:.0f} Python opcodes a step; ids "
            f"{'identical' if same else 'DIFFER'}", tok_s=tok_s[0], baseline_tok_s=tok_s[1], host_ms=host[0],
            baseline_host_ms=host[1], opcodes=ops[layout], baseline_opcodes=ops["mlx-lm"], layers=layers,
            identical=same))
    return rows


def row_host(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    n, deep, m = z["host_tokens"], z["host_layers"], z["host_batch_tokens"]
    out: list[Row] = []
    per_step: dict[int, dict[str, float]] = {}
    for layers in (2, deep):
        out += _single_rows(z, ctx, layers, per_step)
    for side in ("mlx:seq", "mlx:cell", "mlx-lm"):
        layer_ms = (per_step[deep][side] - per_step[2][side]) / (deep - 2) * 1e3
        step_ms = per_step[2][side] * 1e3 - 2 * layer_ms
        out[-1].extra.setdefault("split", {})[side] = {"per_layer_ms": layer_ms, "per_step_ms": step_ms}
    split = out[-1].extra["split"]
    out[-1].note += "; host split per layer + per step: " + ", ".join(
        f"{side} {s['per_layer_ms']:.3f} + {s['per_step_ms']:.3f} ms" for side, s in split.items())
    for seqs in z["host_seqs"]:
        rounds = _batch(z, ctx, seqs)
        got, same = rounds.kept(), rounds.identical("mlx:cell", "batch_generate")
        ops = {side: count / m for side, count in rounds.count().items()}
        hosts = {side: t["host"] for side, t in got.items()}
        tok_s = {side: seqs * m / min(t["wall"]) for side, t in got.items()}
        host = {side: min(t) / m * 1e3 for side, t in hosts.items()}
        out.append(Row.from_times(
            "14 host", f"{seqs} seqs, 2 layers: mlx:cell host", hosts, "mlx:cell", "batch_generate",
            f"host {host['mlx:cell']:.3f} vs {host['batch_generate']:.3f} ms a step; {ops['mlx:cell']:.0f} vs "
            f"{ops['batch_generate']:.0f} Python opcodes a step; {tok_s['mlx:cell']:.0f} vs "
            f"{tok_s['batch_generate']:.0f} tok/s; ids {'identical' if same else 'DIFFER'}",
            host_ms=host["mlx:cell"], baseline_host_ms=host["batch_generate"], opcodes=ops["mlx:cell"],
            baseline_opcodes=ops["batch_generate"], seqs=seqs, identical=same))
    work = (f"tiny preset (hidden 64, fp32) at 2 and {deep} layers: one sequence, a 16-token prompt, {n} tokens "
            f"greedy, no EOS, kvlayout run's engine vs mlx_lm generate_step (A/B: wall time of the generation); "
            f"{' and '.join(map(str, z['host_seqs']))} distinct 16-token prompts decoding {m} tokens each, mlx:cell "
            f"(capacity {SERVED_CELLS}, the server's default) vs batch_generate (A/B: host time). Host time: CPU "
            f"time of the driving thread outside mx.async_eval, per token (best of {z['host_repeats']} rounds); "
            "split into per layer and per step from the two depths. Python opcodes a step: the bytecodes the "
            "driving thread runs (sys.settrace), one more run per side, untimed: the same on every run.")
    return work, out
