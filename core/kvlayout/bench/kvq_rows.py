"""Row 11 (kvq): quantized K/V cells ("q8", "q4") against float K/V and against mlx-lm's QuantizedKVCache.

Two models: the tiny preset with head_dim 64 (its own head_dim of 16 no
group size divides) and SmolLM2-135M-Instruct (or `--model DIR`). On each:

- bytes a cell takes, measured from the pools of a filled cache, and how
  many 1k-token sequences a fixed K/V budget holds at each kv_dtype;
- decode tok/s of 1, 8 and 32 sequences on `mlx:cell`, q8 and q4 against
  float32 (what kv_dtype "auto" picks on the CPU), the same prompts; how
  many greedy answers match float's token for token;
- one sequence on `mlx:seq` at q8/q4 against mlx-lm's generate_step over a
  QuantizedKVCache of the same bits and group size (decode time);
- 16 requests on `mlx:cell` at q4, batched, against mlx-lm's quantized
  server path: `mlx_lm.server --kv-bits` serves one request at a time
  ("Disables batching"), i.e. one generate_step per request after the other,
  measured here in process with quantized_kv_start 0 so both quantize from
  the first token (the server's default 5000 would leave short prompts in
  float);
- the largest logit error against float K/V, teacher-forced: the same
  prompt-and-answer tokens through a float and a quantized cache.

Every sample runs its max_tokens (no EOS), so both sides do the same work.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.bench import peers
from kvlayout.bench.model_rows import load_both, run_config
from kvlayout.bench.real_rows import QUESTIONS, chat_ids, decode_after_first
from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved
from kvlayout.config import QUANTIZED_KV_BITS, CacheConfig
from kvlayout.mlx import cell_bytes

QUANTIZED = tuple(QUANTIZED_KV_BITS)  # "q8", "q4"
FLOAT = "float32"  # kv_dtype "auto" on the CPU
GROUP = 64
BUDGET = 1 << 30  # the K/V budget the "fits" figures divide
SEQ_LEN = 1024


def kvq_models(ctx: dict) -> list[tuple[str, Path]]:
    """(name, directory) of both models: the tiny preset at head_dim 64, written once, and SmolLM2 (or --model)."""
    from kvlayout.bench.serve_rows import serve_model
    from kvlayout.models.presets import write_preset

    tiny = Path(ctx["model_dir"]).parent / "tiny_d64"
    if not tiny.exists():
        write_preset(tiny, "tiny", head_dim=64)
    real = serve_model(ctx)
    short = "smollm2" if ctx.get("user_model") is None else real.name[:12]  # the table's case column is narrow
    return [("tiny-d64", tiny), (short, real)]


def prompts_for(tokenizer, n: int, chat: bool) -> list[list[int]]:
    """`n` prompts: chat-templated questions (a real model's tokenizer), else byte strings of varied length."""
    if chat:
        return [chat_ids(tokenizer, q) for q in (QUESTIONS * -(-n // len(QUESTIONS)))[:n]]
    return [[(7 * j + 11 * i + 3) % 256 for j in range(24 + 5 * (i % 8))] for i in range(n)]


def with_kv(cfg, kv_dtype: str):
    """`cfg` (a RunConfig from `run_config`) with its cache's kv_dtype set."""
    return attrs.evolve(cfg, cache=attrs.evolve(cfg.cache, kv_dtype=kv_dtype))


def measured_cell_bytes(config: CacheConfig, cells: int = 512) -> float:
    """Bytes a cell takes in a real mlx:cell cache of `config` filled with `cells` cells: the pools'
    nbytes over their slots (not the formula: what the arrays hold)."""
    from kvlayout import build

    cache = build("mlx", "cell", config)
    seq = cache.as_batch_control().seq_new()
    ok = cache.as_batch_control().declare_step([seq] * cells)
    assert ok
    for i in range(config.n_layers):
        lc = config.layer(i)
        x = mx.zeros((1, lc.n_kv_heads, cells, lc.head_dim))
        spec = cache.update_and_fetch(i, range(cells), x, x)
        del spec
    pools = cache.key_pools + cache.value_pools
    return sum(p.nbytes for p in pools) / pools[0].slots


@attrs.frozen
class KvqModel:
    """One model of the row, loaded once for both sides."""

    name: str
    model_dir: Path
    ours: tuple  # kvlayout's (model, args)
    theirs: object  # mlx-lm's model
    tokenizer: object
    chat: bool  # a real model's tokenizer: prompts are chat-templated questions

    @property
    def args(self):
        return self.ours[1]

    def prompts(self, n: int) -> list[list[int]]:
        return prompts_for(self.tokenizer, n, self.chat)


def load_kvq_model(name: str, model_dir: Path) -> KvqModel:
    ours, theirs, tokenizer = load_both(model_dir)
    chat = (model_dir / "tokenizer.json").is_file()
    if chat:
        tokenizer = peers.mlx_lm("utils").load_tokenizer(model_dir)
    return KvqModel(name, model_dir, ours, theirs, tokenizer, chat)


def row_kvq(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    # mlx-lm's side first, so a missing extra refuses before any model is written or loaded.
    generate_step = peers.mlx_lm("generate").generate_step
    QuantizedKVCache = peers.mlx_lm("models.cache").QuantizedKVCache
    out: list[Row] = []
    notes: list[str] = []
    models = kvq_models(ctx)
    for name, model_dir in models:
        print(f"[kvq: {name}]", file=sys.stderr)
        model = load_kvq_model(name, model_dir)
        notes.append(bytes_note(model))
        answers: dict[tuple[str, int], list[list[int]]] = {}  # greedy answers by (kv_dtype, sequences)
        for n in z["kvq_ns"]:
            out += decode_rows(z, model, n, answers)
        out += [single_seq_row(z, model, d, generate_step, QuantizedKVCache) for d in QUANTIZED]
        out.append(server_row(z, model, generate_step, QuantizedKVCache))
        notes.append(agreement_note(z, model, answers))
    return kvq_work(z, models[1][0], notes), out


def bytes_note(model: KvqModel) -> str:
    """Bytes per cell, measured from the pools against the formula, and what a fixed budget holds."""
    args = model.args
    layers = args.layer_configs()[:1] if len(set(args.layer_configs())) == 1 else args.layer_configs()
    sizes = {}
    for dtype in ("float32", "float16", *QUANTIZED):
        cfg = CacheConfig(capacity=1024, n_layers=args.num_hidden_layers, layers=layers, kv_dtype=dtype,
                          initial_capacity=512, kv_group_size=GROUP)
        sizes[dtype] = (measured_cell_bytes(cfg), cell_bytes(cfg))
    fits = {d: BUDGET // (SEQ_LEN * int(b)) for d, (b, _) in sizes.items()}
    return (
        f"{model.name}: bytes/cell (measured = formula) "
        + ", ".join(f"{d} {b:.0f}{'' if b == f else f' (formula {f})'}" for d, (b, f) in sizes.items())
        + f"; 1k-token sequences in {BUDGET >> 20} MiB of K/V: "
        + ", ".join(f"{d} {n}" for d, n in fits.items())
        + f" (q4 {fits['q4'] / fits['float16']:.2f}x float16's, q8 {fits['q8'] / fits['float16']:.2f}x)"
    )


def decode_rows(z: dict, model: KvqModel, n: int, answers: dict[tuple[str, int], list[list[int]]]) -> list[Row]:
    """Decode of `n` sequences on mlx:cell, q8 and q4 against float, the same prompts; files every side's
    greedy answers in `answers` under (kv_dtype, n)."""
    from kvlayout.runner import job as jobs

    k = z["kvq_tokens"]
    prompts = model.prompts(n)
    reqs = [{"prompt_ids": p, "max_tokens": k} for p in prompts]
    base = run_config(model.model_dir, "mlx:cell", reqs, sum(map(len, prompts)) + n * k, chunk=512)
    prepared = {d: jobs.prepare(with_kv(base, d), loaded=model.ours) for d in (FLOAT, *QUANTIZED)}

    def side(d):
        def go():
            res = prepared[d].generate()
            answers[d, n] = [list(o[0].token_ids) for o in res.outputs]
            return res.stats.decode_s
        return go

    t = interleaved({d: side(d) for d in (FLOAT, *QUANTIZED)}, z["kvq_repeats"])
    float_tok_s = n * (k - 1) / statistics.median(t[FLOAT])
    rows = []
    for d in QUANTIZED:
        tok_s = n * (k - 1) / statistics.median(t[d])
        same = sum(a == b for a, b in zip(answers[d, n], answers[FLOAT, n]))
        rows.append(Row.from_times(
            "11 kvq", f"{model.name} {n} seq: cell {d} vs {FLOAT}", t, d, FLOAT,
            f"{tok_s:.1f} vs {float_tok_s:.1f} decode tok/s ({tok_s / float_tok_s:.2f}x); "
            f"{same}/{n} answers identical to float's",
            model=model.name, sequences=n, tok_s=tok_s, baseline_tok_s=float_tok_s, identical_answers=same,
        ))
    return rows


def single_seq_row(z: dict, model: KvqModel, d: str, generate_step, QuantizedKVCache) -> Row:
    """One sequence: mlx:seq at `d` (q8 or q4) against mlx-lm's QuantizedKVCache of the same bits and group size."""
    from kvlayout.runner import job as jobs

    prompt = model.prompts(1)[0]
    n1 = z["kvq_single_tokens"]
    bits = QUANTIZED_KV_BITS[d]
    cfg = with_kv(run_config(model.model_dir, "mlx:seq", [{"prompt_ids": prompt, "max_tokens": n1}],
                             len(prompt) + n1), d)
    prepared_seq = jobs.prepare(cfg, loaded=model.ours)
    got: dict[str, list[int]] = {}

    def ours_side():
        res = prepared_seq.generate()
        got["ours"] = list(res.outputs[0][0].token_ids)
        return res.stats.decode_s

    def theirs_side():
        cache = [QuantizedKVCache(group_size=GROUP, bits=bits) for _ in model.theirs.layers]
        got["theirs"], dt = decode_after_first(generate_step, prompt, model.theirs, n1, prompt_cache=cache)
        return dt

    t = interleaved({"ours": ours_side, "theirs": theirs_side}, z["kvq_repeats"])
    a, b = (n1 - 1) / statistics.median(t["ours"]), (n1 - 1) / statistics.median(t["theirs"])
    same = got["ours"] == got["theirs"]
    return Row(
        "11 kvq", f"{model.name} 1 seq: seq {d} vs mlx-lm", f"mlx:seq {d}", f"mlx-lm QuantizedKV {bits}b",
        t["ours"], t["theirs"],
        f"{a:.1f} vs {b:.1f} decode tok/s ({a / b:.2f}x); ids {'identical' if same else 'DIFFER'}",
        {"model": model.name, "tok_s": a, "baseline_tok_s": b, "identical": same},
    )


def server_row(z: dict, model: KvqModel, generate_step, QuantizedKVCache) -> Row:
    """16 requests at q4: batched cells against mlx-lm's one-at-a-time quantized server path."""
    from kvlayout.runner import job as jobs

    k, m = z["kvq_tokens"], z["kvq_server_n"]
    prompts = model.prompts(m)
    reqs = [{"prompt_ids": p, "max_tokens": k} for p in prompts]
    batched = jobs.prepare(
        with_kv(run_config(model.model_dir, "mlx:cell", reqs, sum(map(len, prompts)) + m * k, 512), "q4"),
        loaded=model.ours)
    got16: dict[str, list[list[int]]] = {}

    def batched_side():
        t0 = time.perf_counter()
        res = batched.generate()
        got16["ours"] = [list(o[0].token_ids) for o in res.outputs]
        return time.perf_counter() - t0

    def one_at_a_time():
        t0 = time.perf_counter()
        got16["theirs"] = []
        for p in prompts:
            cache = [QuantizedKVCache(group_size=GROUP, bits=4) for _ in model.theirs.layers]
            got16["theirs"].append([int(x) for x, _ in generate_step(mx.array(p), model.theirs, max_tokens=k,
                                                                    prompt_cache=cache)])
        return time.perf_counter() - t0

    t = interleaved({"ours": batched_side, "theirs": one_at_a_time}, z["kvq_repeats"])
    a, b = m * k / statistics.median(t["ours"]), m * k / statistics.median(t["theirs"])
    same = sum(x == y for x, y in zip(got16["ours"], got16["theirs"]))
    return Row(
        "11 kvq", f"{model.name} {m} req q4: cell vs 1-at-a-time", "mlx:cell q4", "mlx-lm kv_bits=4 serial",
        t["ours"], t["theirs"],
        f"{a:.1f} vs {b:.1f} gen tok/s ({a / b:.2f}x throughput, prompts included); "
        f"{same}/{m} answers identical",
        {"model": model.name, "tok_s": a, "baseline_tok_s": b, "identical_answers": same},
    )


def agreement_note(z: dict, model: KvqModel, answers: dict[tuple[str, int], list[list[int]]]) -> str:
    """Agreement with float K/V: tokens matching float's answers, and the largest logit error,
    teacher-forced over those answers."""
    k, n = z["kvq_tokens"], max(z["kvq_ns"])
    forced = [p + a for p, a in zip(model.prompts(n), answers[FLOAT, n])][: z["kvq_forced"]]
    errors = {d: logit_error(model.ours[0], model.args, forced, d) for d in QUANTIZED}
    match = {d: token_match(answers[d, n], answers[FLOAT, n]) for d in QUANTIZED}
    return (
        f"{model.name}: against float K/V over {n} greedy answers of {k} tokens, tokens matching float's "
        + ", ".join(f"{d} {match[d]:.1%}" for d in QUANTIZED)
        + f"; largest |logit error| teacher-forced over {len(forced)} sequences "
        + ", ".join(f"{d} {e:.3g} (mean {m_:.3g})" for d, (e, m_) in errors.items())
    )


def kvq_work(z: dict, real: str, notes: list[str]) -> str:
    """The row's description of the work on the tiny preset and the `real` model, with every model's notes."""
    return (
        f"tiny preset at head_dim 64 and {real}: kv_group_size {GROUP}; decode rows: "
        f"{'/'.join(map(str, z['kvq_ns']))} requests on mlx:cell (chat-templated questions for a chat model, byte "
        f"strings for the tiny one), {z['kvq_tokens']} tokens each greedy, no EOS, decode time = Stats.decode_s; "
        f"1-seq rows: {z['kvq_single_tokens']} tokens, time after the first token; the {z['kvq_server_n']}-request "
        "row: wall time, prompts included, mlx-lm one generate_step after another (mlx_lm.server --kv-bits serves so), "
        "quantized from the first token. "
        + " | ".join(notes)
    )


def logit_error(model, args, sequences: list[list[int]], kv_dtype: str) -> tuple[float, float]:
    """(largest, mean) |logit difference| over every position of `sequences`, each one prefill through a
    float32 mlx:seq cache and one through a `kv_dtype` one."""
    from kvlayout import build

    largest, total, count = 0.0, 0.0, 0
    for ids in sequences:
        logits = {}
        for d in (FLOAT, kv_dtype):
            layers = args.layer_configs()
            config = CacheConfig(capacity=len(ids), n_layers=args.num_hidden_layers, layers=layers[:1]
                                 if len(set(layers)) == 1 else layers, kv_dtype=d,
                                 initial_capacity=len(ids))
            logits[d] = np.array(model(ids, range(len(ids)), build("mlx", "seq", config)).astype(mx.float32))
        diff = np.abs(logits[kv_dtype] - logits[FLOAT])
        largest, total, count = max(largest, float(diff.max())), total + float(diff.sum()), count + diff.size
    return largest, total / count


def token_match(got: list[list[int]], want: list[list[int]]) -> float:
    """Share of positions where `got`'s greedy token equals `want`'s, counting to the first difference
    of each answer (after it, the answers continue from other histories)."""
    same = total = 0
    for a, b in zip(got, want):
        run = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same, total = same + run, total + len(b)
    return same / total if total else 1.0
