"""Structured output's per-step cost: a decode step of constrained samples against free ones.

What it measures, on the real SmolLM2-135M-Instruct (a real tokenizer, so a real grammar), per
configuration (layout x sequences: mlx:seq at 1, mlx:cell at 1 and 16; the seq engine runs one
sample at a time, so 16 is cell's only), four variants side by side:

- `free greedy`: plain greedy, drawn ahead on the device (engines.ahead: the fast path);
- `free t0.7`: temperature 0.7, no constraint (the host path: logits read every step);
- `json greedy` / `json t0.7`: the same with a JSON-schema constraint per sample (kvlayout.grammar,
  llguidance): a mask filled on the host each step, applied to the logits on the device.

A step's time is the wall time of one `engine.step()`, kept only where every sequence decodes
(no prompt token fed: prefill excluded); the first such step of a run is dropped too (on the fast
path it waits for the prefill's compute, drawn ahead). Per run the median kept step; per variant the
median and the best of the rounds, with the ratios json greedy / free greedy (c/a) and json t0.7 /
free t0.7 (d/b). Goal: c/a and d/b <= 1.1. The schema has one string field with `minLength` 400, so
the grammar never closes the object inside `max_tokens` (a sample ends by length, never early);
the prompts ask for long prose, so free samples rarely meet EOS (steps after one ends are not kept).

The mask fill alone: every constrained sample's generated ids replayed through a fresh matcher,
`Matcher.fill` timed at each step (median and p99, us per sequence per step).

Each step is also timed in process CPU time (every thread: MLX computes on its own), the work it
costs, which a shared machine's other tenants disturb far less than the wall time. The 16 sequences
are one request of n=16 (one prefill, then 16 forks, each its own sequence: a free greedy fork is
drawn ahead): 16 distinct prompts would cost minutes of prefill per run on this CPU.

Rounds are interleaved (`kvlayout.bench.timing.interleaved`: each round starts at another variant)
after one short warm-up run per configuration. `--paths float32` measures with the weights
dequantized to float32 (`quantization.dequantize_model`): where batching pays on a CPU with a fast
BLAS (MLX multiplies packed 4-bit weights at a cost linear in the step's tokens).

    python bench/structured_step.py --json /tmp/structured.json          # 4-bit: ~10 min on 2 busy cores
    python bench/structured_step.py --paths float32 --max-tokens 16 --rounds 2

Measured 2026-12-03 07:29-07:43 UTC (2-core x86_64 shared with other jobs, load 2-5; MLX 0.32.4 CPU,
reference BLAS; llguidance 1.9.1). ms per decode step: wall median of rounds (best) | process CPU;
ratios c/a and d/b: wall median (best) | CPU. 4-bit: 1 sequence 24 tokens x 3 rounds, 16: 6 x 2.

    4-bit     free greedy (a)  free t0.7 (b)  json greedy (c)  json t0.7 (d)     c/a              d/b
    seq x1    198 (163) | 200  332 (203) | 211  189 (184) | 207  187 (184) | 205  0.96 (1.13) | 1.03  0.56 (0.91) | 0.97
    cell x1   205 (196) | 194  231 (193) | 210  181 (178) | 198  213 (207) | 219  0.88 (0.91) | 1.02  0.92 (1.07) | 1.04
    cell x16  2911 (2871)|2427 5165 (4887)|2488 4624 (4566)|2489 4158 (3613)|2481 1.59 (1.59) | 1.03  0.81 (0.74) | 1.00

    float32 (dequantized; 1 sequence 16 tokens x 2 rounds, 16: 6 x 2)
    seq x1    267 (243) | 217  296 (251) | 207  252 (210) | 205  334 (256) | 243  0.94 (0.86) | 0.95  1.13 (1.02) | 1.17
    cell x1   216 (195) | 221  240 (211) | 233  220 (193) | 222  218 (194) | 223  1.02 (0.99) | 1.01  0.91 (0.92) | 0.96
    cell x16  2898 (2817)|2898 3284 (3177)|3214 2759 (2429)|2763 3007 (2918)|2950 0.95 (0.86) | 0.95  0.92 (0.92) | 0.92

    Matcher.fill alone: 33 us median, 144 us p99 per sequence per step (4-bit run, 288 fills);
    28 / 136 us in the float32 run.

Reading: the CPU ratios, 0.92-1.04 in 11 of 12 cells (1.17 once, float32 seq x1 d/b, two rounds),
meet the goal (<= 1.1); the wall ratios scatter 0.56-1.59 with the machine's other tenants (the
cell x16 free rows differ 1.8x between two variants that do the same work) and bound nothing.
The grammar's own cost is far below the noise: 16 x 33 us = 0.5 ms of a 2.5 s step, 33 us of a
200 ms one. On this CPU float32 does not make batching pay (reference BLAS: 2.9 s a 16-sequence
step, 13-14x one sequence's, as with 4-bit weights).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import kvlayout
from kvlayout.bench.timing import interleaved
from kvlayout.config import CacheConfig
from kvlayout.engines import CellEngine, EngineOptions, Request, Sample, Sampling, SeqEngine, Stats
from kvlayout.engines.sampling import sample_rng
from kvlayout.grammar import Grammar, Grammars
from kvlayout.models.loading import load_model

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_json  # noqa: E402  (a bench script: its folder is on sys.path when run)

MODEL_DIR = Path.home() / ".cache/kvlayout/models/smollm2-135m-instruct"
# One long string field: minLength keeps the object open for far more than max_tokens tokens.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 400}}, "required": ["notes"]}
# variant -> (constrained, temperature)
VARIANTS = {"free greedy": (False, 0.0), "free t0.7": (False, 0.7), "json greedy": (True, 0.0),
            "json t0.7": (True, 0.7)}
CONFIGS = [("seq", 1), ("cell", 1), ("cell", 16)]
ENGINES = {"seq": SeqEngine, "cell": CellEngine}
SEED = 7


def load(model_dir: Path, float32: bool):
    """(model, args, tokenizer): as stored (4-bit), or every weight dequantized to float32."""
    model, args, tok = load_model(model_dir, dtype="float32" if float32 else None)
    if float32:
        from kvlayout.models.quantization import dequantize_model

        dequantize_model(model, mx.float32)
    return model, args, tok


def prompt(tok) -> list[int]:
    """A prompt asking for long prose (a free sample should not stop inside max_tokens)."""
    return tok.encode("Write long, detailed notes about rivers, as JSON with one field 'notes' holding "
                      "several paragraphs of prose.\n")


def requests(prompt: list[int], seqs: int, max_tokens: int, temperature: float, grammar: Grammar | None
             ) -> list[Request]:
    """One request of `seqs` samples: the prompt is prefilled once and forks (a 16-sequence prefill of
    distinct prompts costs minutes on this CPU); each sample has its own seeded generator and, with a
    grammar, its own matcher. After the fork every sample is a sequence of its own, so a greedy
    free one is drawn ahead on the device from its second token on."""
    r = Request(0, list(prompt), max_tokens, seqs, sampling=Sampling(temperature=temperature, seed=SEED))
    r.samples = [Sample(0, j, sample_rng(SEED, 0, j)) for j in range(seqs)]
    for sample in r.samples:
        sample.constraint = grammar.matcher() if grammar is not None else None
    return [r]


def engine_over(kind: str, loaded, capacity: int, eos: frozenset[int]):
    """(engine, stats): a fresh cache of layout mlx:<kind> and an engine over it; chunk large enough
    that every prompt is admitted in the first step."""
    model, args, _ = loaded
    config = CacheConfig(capacity=capacity, n_layers=args.num_hidden_layers, layers=args.layer_configs(),
                         kv_dtype="float32")
    cache = kvlayout.build("mlx", kind, config)
    control = cache.as_control() if kind == "seq" else cache.as_batch_control()
    stats = Stats()
    options = EngineOptions(eos=eos, sampling=Sampling(), chunk=2048, stats=stats)
    return ENGINES[kind](model, cache, control, options), stats


def decode_steps(engine, stats: Stats, seqs: int) -> list[tuple[float, float]]:
    """Run `engine` to the end; (wall, process CPU) seconds of each step in which all `seqs` sequences
    decoded and no prompt token was fed, the first of them left out (see the module docstring).
    CPU time counts every thread of the process (MLX computes on its own): the work a step costs,
    which other tenants of a shared machine disturb far less than the wall time."""
    kept = []
    while engine.has_work:
        prefill, decode = stats.prefill_tokens, stats.decode_tokens
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        if stats.prefill_tokens == prefill and stats.decode_tokens - decode == seqs:
            kept.append((seconds, cpu))
    engine.settle()
    return kept[1:]


class Variant:
    """One variant of one configuration: each call is one run (a fresh engine and request), its
    median kept step recorded; returns the run's seconds for `interleaved`."""

    def __init__(self, kind: str, seqs: int, loaded, temperature: float, grammar: Grammar | None, max_tokens: int):
        self.kind, self.seqs, self.loaded = kind, seqs, loaded
        self.temperature, self.grammar, self.max_tokens = temperature, grammar, max_tokens
        self.prompt = prompt(loaded[2])
        self.capacity = seqs * (len(self.prompt) + max_tokens) + 64
        self.step_medians: list[float] = []
        self.cpu_medians: list[float] = []
        self.kept_steps: list[int] = []
        self.last: list[Request] = []

    def __call__(self) -> float:
        eos = frozenset(self.loaded[2].eos_ids)
        engine, stats = engine_over(self.kind, self.loaded, self.capacity, eos)
        self.last = requests(self.prompt, self.seqs, self.max_tokens, self.temperature, self.grammar)
        engine.add(self.last)
        t0 = time.perf_counter()
        steps = decode_steps(engine, stats, self.seqs)
        wall = time.perf_counter() - t0
        if steps:
            self.step_medians.append(statistics.median(wall for wall, _ in steps))
            self.cpu_medians.append(statistics.median(cpu for _, cpu in steps))
        self.kept_steps.append(len(steps))
        return wall


def fill_times(grammar: Grammar, reqs: list[Request]) -> list[float]:
    """Microseconds of `Matcher.fill` at every step of every sample's output, replayed through a
    fresh matcher (fill, then accept the id the sample kept)."""
    out = []
    for sample in (x for r in reqs for x in r.samples):
        matcher = grammar.matcher()
        row = np.zeros(matcher.width, dtype=np.int32)
        for token in sample.generated:
            row[:] = 0
            t0 = time.perf_counter_ns()
            matcher.fill(row)
            out.append((time.perf_counter_ns() - t0) / 1e3)
            matcher.accept(token)
    return out


def measure_config(kind: str, seqs: int, loaded, grammar: Grammar, tokens: int, rounds: int
                   ) -> tuple[list[dict], list[float]]:
    """The four variants of one configuration, interleaved, after one short warm-up run (a constrained
    sampled one: prefill, fork, shaping and the host draw all run once): (rows, fill times of its
    constrained samples)."""
    Variant(kind, seqs, loaded, 0.7, grammar, 3)()
    variants = {name: Variant(kind, seqs, loaded, temp, grammar if constrained else None, tokens)
                for name, (constrained, temp) in VARIANTS.items()}
    interleaved(variants, rounds, warmup=0)
    rows = []
    for name, v in variants.items():
        rows.append({"config": f"{kind}x{seqs}", "variant": name, "median_ms": 1e3 * statistics.median(v.step_medians),
                     "best_ms": 1e3 * min(v.step_medians), "cpu_ms": 1e3 * statistics.median(v.cpu_medians),
                     "steps": min(v.kept_steps), "rounds": rounds,
                     "ended_early": sum(s.finish_reason != "length" for r in v.last for s in r.samples)})
    by = {r["variant"]: r for r in rows}
    for constrained, free in (("json greedy", "free greedy"), ("json t0.7", "free t0.7")):
        by[constrained]["ratio"] = by[constrained]["median_ms"] / by[free]["median_ms"]
        by[constrained]["ratio_best"] = by[constrained]["best_ms"] / by[free]["best_ms"]
        by[constrained]["ratio_cpu"] = by[constrained]["cpu_ms"] / by[free]["cpu_ms"]
    fills = [t for name in ("json greedy", "json t0.7") for t in fill_times(grammar, variants[name].last)]
    return rows, fills


def measure_path(label: str, loaded, args) -> tuple[list[dict], list[float]]:
    """Every configuration on one weight path (4-bit, float32): rows, and every fill time."""
    _, model_args, tok = loaded
    grammar = Grammars(tok, model_args.vocab_size, tok.eos_ids).json_schema(SCHEMA, strict=True)
    rows, fills = [], []
    for kind, seqs in CONFIGS:
        if seqs > args.max_seqs:
            continue
        t0 = time.perf_counter()
        batch = seqs > 1
        got, filled = measure_config(kind, seqs, loaded, grammar, args.batch_tokens if batch else args.max_tokens,
                                     args.batch_rounds if batch else args.rounds)
        for r in got:
            r["weights"] = label
        rows += got
        fills += filled
        print(f"  {label} {kind}x{seqs}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return rows, fills


COLUMNS = [("weights", "weights", ""), ("config", "config", ""), ("variant    ", "variant", ""),
           ("ms/step med", "median_ms", ".1f"), ("ms/step best", "best_ms", ".1f"),
           ("ratio med", "ratio_text", ""), ("ratio best", "ratio_best_text", ""),
           ("cpu ms/step", "cpu_ms", ".1f"), ("cpu ratio", "ratio_cpu_text", ""),
           ("kept steps", "steps", "d"), ("ended early", "ended_early", "d")]


def printable(rows: list[dict]) -> list[dict]:
    """Rows with their ratios as text ("-" for the free variants, which have none)."""
    return [{**r, **{f"{key}_text": f"{r[key]:.2f}" if key in r else "-"
                     for key in ("ratio", "ratio_best", "ratio_cpu")}} for r in rows]


def fill_summary(label: str, fills: list[float]) -> str:
    return (f"{label}: Matcher.fill {np.median(fills):.1f} us median, {np.percentile(fills, 99):.1f} us p99, "
            f"{max(fills):.0f} us max per sequence per step ({len(fills)} fills)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per sample, one sequence")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds, one sequence")
    ap.add_argument("--batch-tokens", type=int, default=6, help="tokens per sample, 16 sequences (seconds a step)")
    ap.add_argument("--batch-rounds", type=int, default=2, help="interleaved rounds, 16 sequences")
    ap.add_argument("--paths", default="4-bit", help="weight paths, comma-separated: 4-bit, float32")
    ap.add_argument("--max-seqs", type=int, default=16, help="skip configurations of more sequences")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows, summaries = [], []
    for label in args.paths.split(","):
        got, fills = measure_path(label, load(args.model, label == "float32"), args)
        rows += got
        summaries.append(fill_summary(label, fills))
    print(table(COLUMNS, printable(rows)))
    print("\n".join(summaries))
    write_json(args.json, "structured_step", rows=rows, fills=summaries, schema=SCHEMA,
               settings={k: v for k, v in vars(args).items() if k != "model"})


if __name__ == "__main__":
    main()
