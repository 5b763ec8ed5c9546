"""N-gram speculative decoding (prompt lookup) in kvlayout's cell engine, on SmolLM2-135M-Instruct, in one run.

    python bench/speculation.py [--quick] [--rounds N] [--only copy,chat] [--batches 1,8,32] [--max-tokens N]
        [--quantized] [--json PATH]

For each workload and batch size, three sides run interleaved (each round starts at another side, one warm-up
round not kept), every figure below a median over the rounds and every ratio taken within this run:
- off: `mlx:cell` (CellEngine, every sequence added at once) with `[engine] speculate = "off"`;
- ngram: the same with `speculate = "ngram"`, `speculate_tokens = 4` (engines.drafts);
- mlx-lm: `mlx_lm.generate.generate_step` on the same weights, one sequence (batch 1 only).
Workloads, chat-templated (kvlayout's own rendering; mlx-lm gets the same ids), greedy, no EOS (every sequence
runs its max_tokens on every side, so all do the same number of tokens; past the answer's end the model goes
on, as it would with `ignore_eos`):
- quote: "quote this passage back verbatim", a ~150-token passage of filler prose;
- rename: "rename foo to bar in this Python code, output the whole code", a ~300-token snippet;
- form: "fill this form", twelve field names to repeat with values from a short description;
- chat: real_rows.QUESTIONS under its SYSTEM prompt (request i carries i // 8 earlier exchanges: distinct).
`--only copy` is quote,rename,form. Every sequence of a batch has its own prompt (seeded variants).
Columns: decode tok/s = Stats.decode_tokens / Stats.decode_s (kvlayout: its decode steps' share of step time,
kept draft tokens counted as decoded; mlx-lm: the n - 1 tokens after the first, from generate_step's first
yield to its last, as real_rows' row 8); ng/off and ng/mlx: ratios of those medians; wall: the whole
generate's generated tokens per second, prefill included, as ratio ngram/off; steps/tok: engine steps per
generated token (prefill steps included); accept: accepted / drafted tokens (all kept rounds); same: whether
ngram's token ids equal off's ("seq S @I" names the first difference: a multi-token step's logits may differ
from a one-token step's in the last bits, which can flip a near-tie), and, at batch 1, whether off's equal
mlx-lm's.

The model is kvlayout's default on a Linux CPU: the cached 4-bit checkpoint (`kvlayout init-model DIR --preset
smollm2`) dequantized to float32 at load, MLX's matmuls on the OpenBLAS `kvlayout run` would choose
(runner.blas: this script re-executes itself once with it preloaded, as the CLI does; KVLAYOUT_BLAS is
honoured). mlx-lm's copy is dequantized by the same code (bit for bit `mlx_lm.convert --dequantize --dtype
float32`). `--quantized`: the 4-bit checkpoint as is on both sides, MLX's bundled reference BLAS.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import common

MODEL = Path(os.environ.get("KVLAYOUT_CACHE", Path.home() / ".cache/kvlayout")) / "models/smollm2-135m-instruct"
COPY = ("quote", "rename", "form")
WORKLOADS = (*COPY, "chat")
K = 4  # speculate_tokens: the engine's default
SIDES = ("off", "ngram")
WORDS = ("river valley harbour lantern orchard library mountain meadow village engine garden bridge market "
         "scholar weaver sailor painter miller farmer baker clock letter window road forest winter summer").split()
VERBS = "crossed mended watched carried followed described remembered painted visited measured".split()
PLACES = "Oslo Lisbon Kyoto Quito Dakar Perth Tallinn Cusco Hanoi Tunis".split()
FIELDS = ("Full name", "Date of birth", "Place of birth", "Occupation", "Employer", "City", "Street address",
          "Phone number", "Email", "Favourite colour", "Pet's name", "Emergency contact")
FIRST = "Ada Bruno Chiara Dmitri Elif Farah Goran Hana Ivo Jun Kofi Lena Mateo Noor Oskar Priya".split()
LAST = "Novak Okafor Silva Tanaka Weber Haddad Lindqvist Moreau Petrov Costa Kim Ortiz".split()


def ensure_blas(quantized: bool) -> None:
    """Re-execute this script once with the BLAS kvlayout would choose preloaded (`--quantized`: none).

    `blas.ensure` does this for the CLI but re-executes `kvlayout`, not this file; a library must be
    preloaded before the process starts, so both kvlayout and mlx-lm here multiply through it."""
    from kvlayout.runner import blas

    if not blas.applies() or os.environ.get(blas.CHOSEN) is not None:
        return
    hand = blas.hand_preloaded()
    if hand and not quantized:  # someone chose a BLAS already: kept, as blas.ensure keeps it
        return
    choice = blas.choose("none" if quantized else None)
    for line in choice.passed_over:
        print(f"speculation: {line}", file=sys.stderr)
    if choice.path is None and not hand:
        os.environ[blas.CHOSEN] = "none"  # nothing to preload or take out: go on in this process
        return
    env = {**os.environ, **choice.env, blas.CHOSEN: choice.path or "none"}
    if hand:  # --quantized: a BLAS preloaded by hand would hide the reference one
        env["LD_PRELOAD"] = " ".join(p for p in env["LD_PRELOAD"].replace(":", " ").split() if p not in hand)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)


# -- the workloads: each `variant(i, tok)` is request i's messages, distinct for every i


def cut(text: str, tokens: int, tok) -> str:
    """`text` cut to at most `tokens` tokens of `tok`, at a word boundary (so the copy is of whole words)."""
    words = text.split(" ")
    while len(tok.encode(" ".join(words), add_special_tokens=False)) > tokens:
        words = words[: -max(1, len(words) // 20)]
    return " ".join(words)


def passage(i: int, tokens: int, tok) -> str:
    rng = random.Random(1000 + i)
    sentences = []
    for _ in range(tokens // 8):
        a, b, c = rng.sample(WORDS, 3)
        sentences.append(f"The {a} near {rng.choice(PLACES)} {rng.choice(VERBS)} the {b} and the {c} at dawn.")
    return cut(" ".join(sentences), tokens, tok)


def quote(i: int, tok) -> list[dict]:
    text = passage(i, 150, tok)
    return [{"role": "user", "content": f"Quote the following passage back verbatim, word for word, with no "
                                        f"comments.\n\nPassage:\n{text}"}]


def snippet(i: int, tokens: int, tok) -> str:
    """Python of about `tokens` tokens where `foo` is a function, called and passed around; seeded by `i`."""
    rng = random.Random(2000 + i)
    parts = [f"def foo(values, scale={rng.randint(2, 9)}):\n    total = 0\n    for v in values:\n"
             f"        total += v * scale\n    return total\n"]
    while len(tok.encode("\n".join(parts), add_special_tokens=False)) < tokens:
        name, var = rng.choice(WORDS), rng.choice(WORDS)
        n = rng.randint(2, 40)
        parts.append(f"def {name}_{len(parts)}({var}):\n    result = foo({var}, {n})\n"
                     f"    if result > {n * 10}:\n        return foo([result], 1)\n    return result\n")
    return "\n".join(parts)


def rename(i: int, tok) -> list[dict]:
    code = snippet(i, 300, tok)
    return [{"role": "user", "content": "Rename the function foo to bar in this Python code. Output the whole "
                                        f"code, nothing else.\n\n```python\n{code}\n```"}]


def form(i: int, tok) -> list[dict]:
    rng = random.Random(3000 + i)
    who = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    about = (f"{who} was born on {rng.randint(1, 28)} March {rng.randint(1950, 2005)} in {rng.choice(PLACES)}, "
             f"works as a {rng.choice(WORDS)} keeper at the {rng.choice(WORDS).title()} Company and lives at "
             f"{rng.randint(1, 99)} {rng.choice(WORDS).title()} Road, {rng.choice(PLACES)}. Phone "
             f"{rng.randint(100, 999)}-{rng.randint(1000, 9999)}, email {who.split()[0].lower()}@example.org. "
             f"Likes the colour {rng.choice(['red', 'green', 'blue', 'amber'])}; has a cat called "
             f"{rng.choice(FIRST)}; in an emergency call {rng.choice(FIRST)} {rng.choice(LAST)}.")
    blank = "\n".join(f"{f}: ____" for f in FIELDS)
    return [{"role": "user", "content": f"Fill in this form for the person described below. Write every line "
                                        f"of the form, replacing each ____ with the value.\n\nPerson: {about}"
                                        f"\n\nForm:\n{blank}"}]


def chat(i: int, tok) -> list[dict]:
    from kvlayout.bench.real_rows import ANSWER, QUESTIONS, SYSTEM

    history = []
    for q in QUESTIONS[: i // len(QUESTIONS)]:  # distinct prompts past the first eight
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]
    return [{"role": "system", "content": SYSTEM}, *history,
            {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


VARIANTS = {"quote": quote, "rename": rename, "form": form, "chat": chat}


# -- loading and the sides


def load(quantized: bool):
    """(ours, theirs, tok, name): the model as `kvlayout run` loads it by default (dequantized where a fast
    BLAS is in use; `quantized`: packed), with no EOS so every sample runs its max_tokens; mlx-lm's own
    load of the directory, unpacked by the same code; kvlayout's tokenizer, which renders the prompts."""
    import mlx.core as mx

    from kvlayout.bench import peers
    from kvlayout.models.quantization import dequantize_model, packed_bits
    from kvlayout.models.tokenizer import ByteTokenizer
    from kvlayout.runner import job as jobs
    from kvlayout.runner.config import RunConfig

    cfg = RunConfig.from_mapping({"model": {"path": str(MODEL), "dequantize": False if quantized else "auto"},
                                  "requests": [{"prompt": "x"}]}, source="bench")
    _, (model, args, tok, name), notices = jobs.load_with_fallback(cfg)
    for line in notices:
        print(f"speculation: {line}", file=sys.stderr)
    theirs, _ = peers.mlx_lm("utils").load_model(MODEL)
    if not packed_bits(model) and packed_bits(theirs):  # ours was unpacked: the same weights for mlx-lm
        dequantize_model(theirs, mx.float32)
    return (model, args, ByteTokenizer(eos_ids=()), name), theirs, tok, name


def render(tok, vocab: int, conversations: list[list[dict]]) -> list[list[int]]:
    """The prompt ids `kvlayout run` would feed for each chat (its chat template)."""
    from kvlayout.runner.config import RunConfig
    from kvlayout.runner.prompts import build_prompts

    cfg = RunConfig.from_mapping({"model": {"path": str(MODEL)}, "requests": [{"messages": m} for m in conversations]},
                                 source="bench")
    built, _ = build_prompts(cfg, tok, vocab)
    return [p.ids for p in built]


def prepare(ours, prompts: list[list[int]], n: int, speculate: str):
    """A Job of the prompts on mlx:cell, greedy, float32 K/V, the engine's default chunk, speculation as asked."""
    from kvlayout.runner import job as jobs
    from kvlayout.runner.config import RunConfig

    capacity = sum(len(p) for p in prompts) + len(prompts) * (n + K + 1)  # room for every sequence's drafts
    cfg = RunConfig.from_mapping({
        "layout": {"backend": "mlx", "kind": "cell"},
        "cache": {"capacity": capacity, "kv_dtype": "float32", "max_seqs": max(64, len(prompts))},
        "model": {"path": str(MODEL)},
        "sampling": {"temperature": 0.0},
        "engine": {"speculate": speculate, "speculate_tokens": K},
        "requests": [{"prompt_ids": p, "max_tokens": n} for p in prompts],
    }, source="bench")
    return jobs.prepare(cfg, loaded=ours)


def kv_side(job, runs: list):
    """A side for `interleaved`: one generate, its ids and Stats kept in `runs`; returns its decode seconds."""

    def go() -> float:
        res = job.generate()
        runs.append({"ids": [list(o[0].token_ids) for o in res.outputs], "stats": res.stats.to_json()})
        return res.stats.decode_s

    return go


def mlx_lm_side(model, prompt: list[int], n: int, runs: list):
    from kvlayout.bench import peers
    from kvlayout.bench.real_rows import decode_after_first

    generate_step = peers.mlx_lm("generate").generate_step

    def go() -> float:
        t0 = time.perf_counter()
        ids, dt = decode_after_first(generate_step, prompt, model, n)
        wall = time.perf_counter() - t0
        runs.append({"ids": [ids], "stats": {"decode_tokens": n - 1, "decode_s": dt, "decode_tok_s": (n - 1) / dt,
                                             "generated_tokens": n, "wall_s": wall}})
        return dt

    return go


# -- one (workload, batch) and its figures


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    """"yes" when `a` and `b` (each sequence's ids) agree; else the first sequence and index where not."""
    for s, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            return f"seq {s} @{at}"
    return "yes"


def side_figures(runs: list) -> dict:
    """Medians over the kept rounds, the engine's counters summed, and every round's figures."""
    st = [r["stats"] for r in runs]
    drafted, accepted = sum(s.get("drafted_tokens", 0) for s in st), sum(s.get("accepted_tokens", 0) for s in st)
    return {
        "decode_tok_s": statistics.median(s["decode_tok_s"] for s in st),
        "wall_tok_s": statistics.median(s["generated_tokens"] / s["wall_s"] for s in st),
        "steps_per_token": statistics.median(s["steps"] / s["generated_tokens"] for s in st) if "steps" in st[0]
        else float("nan"),
        "acceptance": accepted / drafted if drafted else float("nan"),
        "drafted_per_token": drafted / sum(s["generated_tokens"] for s in st),
        "rounds": st,
    }


def measure(workload: str, batch: int, n: int, rounds: int, m: dict) -> dict:
    """Every side on one batch of the workload, interleaved; the row of figures."""
    from kvlayout.bench.timing import interleaved

    conversations = [VARIANTS[workload](i, m["tok"]) for i in range(batch)]
    prompts = render(m["tok"], m["ours"][1].vocab_size, conversations)
    runs: dict[str, list] = {side: [] for side in (*SIDES, "mlx-lm")}
    sides = {side: kv_side(prepare(m["ours"], prompts, n, side), runs[side]) for side in SIDES}
    if batch == 1:
        sides["mlx-lm"] = mlx_lm_side(m["theirs"], prompts[0], n, runs["mlx-lm"])
    interleaved(sides, rounds)  # each side keeps its own figures; one warm-up round first
    for side in sides:
        del runs[side][0]  # the warm-up round
    fig = {side: side_figures(runs[side]) for side in sides}
    off, ng = fig["off"], fig["ngram"]
    stable = all(r["ids"] == runs["ngram"][0]["ids"] for r in runs["ngram"])
    row = {"workload": workload, "batch": batch, "prompt_tokens": [len(p) for p in prompts], "max_tokens": n,
           "off": off["decode_tok_s"], "ngram": ng["decode_tok_s"], "ng_off": ng["decode_tok_s"] / off["decode_tok_s"],
           "wall_ratio": ng["wall_tok_s"] / off["wall_tok_s"], "steps_off": off["steps_per_token"],
           "steps_ng": ng["steps_per_token"], "accept": ng["acceptance"], "drafted": ng["drafted_per_token"],
           "same": first_difference(runs["off"][-1]["ids"], runs["ngram"][-1]["ids"]), "ngram_stable": stable,
           "mlx": float("nan"), "ng_mlx": float("nan"), "off_mlx": float("nan"), "same_mlx": "-", "sides": fig,
           "sample_text": m["tok"].decode(runs["ngram"][-1]["ids"][0])}
    if "mlx-lm" in fig:
        mlx = fig["mlx-lm"]["decode_tok_s"]
        row.update(mlx=mlx, ng_mlx=ng["decode_tok_s"] / mlx, off_mlx=off["decode_tok_s"] / mlx,
                   same_mlx=first_difference(runs["off"][-1]["ids"], runs["mlx-lm"][-1]["ids"]))
    return row


COLUMNS = [("workload", "workload", "s"), ("batch", "batch", "d"), ("off tok/s", "off", ".1f"),
           ("ngram tok/s", "ngram", ".1f"), ("ng/off", "ng_off", ".2f"), ("wall ng/off", "wall_ratio", ".2f"),
           ("mlx-lm tok/s", "mlx", ".1f"), ("ng/mlx", "ng_mlx", ".2f"), ("off/mlx", "off_mlx", ".2f"),
           ("steps/tok off", "steps_off", ".3f"), ("steps/tok ng", "steps_ng", ".3f"), ("accept", "accept", ".2f"),
           ("drafted/tok", "drafted", ".2f"), ("same ng=off", "same", "s"), ("off=mlx-lm", "same_mlx", "s")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 tokens, 2 rounds (a smoke run)")
    ap.add_argument("--rounds", type=int, help="kept rounds per side (default 3; --quick 2), after one warm-up")
    ap.add_argument("--only", default="copy,chat", help=f"workloads: {','.join(WORKLOADS)}, or copy (= quote,rename,"
                                                        "form), comma-separated")
    ap.add_argument("--batches", default="1,8,32", help="concurrent sequences, comma-separated")
    ap.add_argument("--max-tokens", type=int, help="tokens per sequence (default 128; --quick 32)")
    ap.add_argument("--quantized", action="store_true", help="the 4-bit checkpoint as is, reference BLAS")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    names = [w for part in a.only.split(",") for w in (COPY if part == "copy" else (part,))]
    if bad := [w for w in names if w not in WORKLOADS]:
        ap.error(f"--only: unknown workload {bad[0]!r}")
    if not (MODEL / "config.json").is_file():
        ap.error(f"no SmolLM2 in {MODEL}; fetch it with: kvlayout init-model {MODEL} --preset smollm2")
    ensure_blas(a.quantized)  # may re-execute this script
    from kvlayout.runner import blas

    n = a.max_tokens or (32 if a.quick else 128)
    rounds = a.rounds or (2 if a.quick else 3)
    started = time.perf_counter()
    ours, theirs, tok, name = load(a.quantized)
    print(f"{name} · BLAS: {blas.in_use()} · {n} tokens a sequence, greedy, no EOS · median of {rounds} rounds"
          f" · speculate_tokens {K}", flush=True)
    m = {"ours": ours, "theirs": theirs, "tok": tok}
    print(common.table(COLUMNS, []), flush=True)
    rows = []
    for workload in names:
        for batch in map(int, a.batches.split(",")):
            rows.append(measure(workload, batch, n, rounds, m))
            print(common.table(COLUMNS, rows[-1:]).splitlines()[-1], flush=True)
    print(f"wall {time.perf_counter() - started:.0f} s")
    common.write_json(a.json, "speculation", model=name, blas=blas.in_use(), max_tokens=n, rounds=rounds,
                      speculate_tokens=K, quantized=a.quantized, rows=rows)


if __name__ == "__main__":
    main()
