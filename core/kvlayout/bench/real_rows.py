"""Rows 8, 9 and 13 (decode, chat, lockstep): a model the user has (`kvlayout bench --model DIR`) vs mlx-lm on it.

Both sides load the same directory (quantized or not) with their own
loaders. Prompts are rendered by mlx-lm's tokenizer (the model's chat
template when it has one), so kvlayout's own template rendering is not what
is measured: both sides get the same token ids, generate greedily with no
EOS (every sample runs its max_tokens, so both do the same work), and the
token ids they produce are compared.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvlayout.bench import peers
from kvlayout.bench.model_rows import IdsOnly, load_both, run_config
from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved

ANSWER = "In short: it depends, but the usual answer is the simplest one."  # row 9's earlier turns
HOST = "mlx:seq host path"  # row 8's side without tokens drawn ahead
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three prime numbers.",
    "What does a KV cache store during transformer inference, and why does it make decoding faster?",
    "Translate 'good morning' into Spanish.",
    "Explain in simple words what a black hole is and how it forms from a star that runs out of fuel.",
    "What is 12 times 12?",
    "Give one tip for writing readable Python code, such as how to name functions and variables well.",
]


def user_model(ctx: dict) -> dict:
    """The model of `--model DIR` (run_suite checked it is a directory), loaded once by each side.

    Prompts are rendered by mlx-lm's tokenizer when the directory has a
    `tokenizer.json` (so kvlayout's own template rendering is not what is
    measured); else by kvlayout's (the byte tokenizer of a seeded preset).
    """
    if "user" not in ctx:
        model_dir = Path(ctx["user_model"])
        ours, theirs, tokenizer = load_both(model_dir)
        if (model_dir / "tokenizer.json").is_file():
            tokenizer = peers.mlx_lm("utils").load_tokenizer(model_dir)
        ctx["user"] = dict(dir=model_dir, ours=ours, theirs=theirs, tokenizer=tokenizer)
    return ctx["user"]


def chat_ids(tokenizer, question: str, turns: int = 0) -> list[int]:
    """`question` after the shared system prompt and `turns` earlier exchanges (a conversation's
    history: QUESTIONS answered with ANSWER), through the model's chat template (plain text without one)."""
    history = []
    for q in QUESTIONS[:turns]:
        history += [{"role": "user", "content": q}, {"role": "assistant", "content": ANSWER}]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode("\n".join([SYSTEM, *(m["content"] for m in history), question, ""])))


def decode_after_first(generate_step, prompt: list[int], model, n: int, **kwargs) -> tuple[list[int], float]:
    """mlx-lm's `generate_step` over `prompt` for `n` tokens: (token ids, seconds from the first
    sampled token, the prompt in, to the last): its decode time."""
    ids, first = [], None
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n, **kwargs):
        ids.append(int(token))
        if first is None:
            first = time.perf_counter()
    return ids, time.perf_counter() - first


def row_decode(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout.runner import job as jobs

    generate_step = peers.mlx_lm("generate").generate_step
    m = user_model(ctx)
    n = z["model_tokens"]
    prompt = chat_ids(m["tokenizer"], QUESTIONS[0])
    # The third side is mlx:seq on the host path (no token drawn ahead: engines.ahead), to show what
    # queueing the next forward before reading the token buys on this model.
    sides = {"mlx:seq": ("mlx:seq", True), "mlx:cell": ("mlx:cell", True), HOST: ("mlx:seq", False)}
    prepared = {
        side: jobs.prepare(run_config(m["dir"], lay, [{"prompt_ids": prompt, "max_tokens": n}], len(prompt) + n,
                                      pipeline=pipeline), loaded=m["ours"])
        for side, (lay, pipeline) in sides.items()
    }
    got: dict[str, list[int]] = {}

    def ours_side(side):
        def go():
            res = prepared[side].generate()
            got[side] = list(res.outputs[0][0].token_ids)
            return res.stats.decode_s  # the n - 1 forwards after the first token
        return go

    def theirs_side():
        got["mlx-lm"], dt = decode_after_first(generate_step, prompt, m["theirs"], n)
        return dt

    t = interleaved({**{side: ours_side(side) for side in sides}, "mlx-lm": theirs_side}, z["model_repeats"])
    out = []
    theirs_tok_s = (n - 1) / statistics.median(t["mlx-lm"])
    for lay in ("mlx:seq", "mlx:cell"):
        same = got[lay] == got["mlx-lm"]
        ours_tok_s = (n - 1) / statistics.median(t[lay])
        out.append(Row.from_times(
            "8 decode", f"{lay}: {n} tokens", t, lay, "mlx-lm",
            f"{ours_tok_s:.1f} vs {theirs_tok_s:.1f} decode tok/s ({ours_tok_s / theirs_tok_s:.2f}x); "
            f"ids {'identical' if same else 'DIFFER'}",
            identical=same, tok_s=ours_tok_s, baseline_tok_s=theirs_tok_s,
        ))
    same = got["mlx:seq"] == got[HOST]
    ahead_tok_s, host_tok_s = (n - 1) / statistics.median(t["mlx:seq"]), (n - 1) / statistics.median(t[HOST])
    out.append(Row.from_times(
        "8 decode", f"mlx:seq drawing ahead vs host path: {n} tokens", t, "mlx:seq", HOST,
        f"{ahead_tok_s:.1f} vs {host_tok_s:.1f} decode tok/s; ids {'identical' if same else 'DIFFER'}",
        identical=same, tok_s=ahead_tok_s, baseline_tok_s=host_tok_s,
    ))
    work = (f"{m['dir']}: one chat-templated question ({len(prompt)} prompt tokens), {n} tokens greedy, no EOS; "
            "decode time = after the first sampled token (kvlayout: Stats.decode_s, the decode steps; mlx-lm: "
            "from generate_step's first yield to its last), so A/B is the inverse of the decode tok/s ratio; "
            "host path = [engine] pipeline = false (each step waits for its logits before the next is built).")
    return work, out


def row_chat(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    from kvlayout.runner import job as jobs

    batch_generate = peers.mlx_lm("generate").batch_generate
    m = user_model(ctx)
    n, k = z["chat_n"], z["chat_tokens"]
    # Ragged, as a server's conversations are: request i carries i % 8 earlier exchanges.
    prompts = [chat_ids(m["tokenizer"], q, i % len(QUESTIONS))
               for i, q in enumerate((QUESTIONS * -(-n // len(QUESTIONS)))[:n])]
    reqs = [{"prompt_ids": p, "max_tokens": k} for p in prompts]
    cap = sum(len(p) for p in prompts) + n * k
    prepared = jobs.prepare(run_config(m["dir"], "mlx:cell", reqs, cap, chunk=512), loaded=m["ours"])
    got: dict[str, list[list[int]]] = {}

    def ours_side():
        t0 = time.perf_counter()
        res = prepared.generate()
        dt = time.perf_counter() - t0
        got["ours"] = [list(o[0].token_ids) for o in res.outputs]
        return dt

    def theirs_side():
        t0 = time.perf_counter()
        r = batch_generate(m["theirs"], IdsOnly(), prompts, max_tokens=k, return_token_ids=True)
        dt = time.perf_counter() - t0
        got["theirs"] = [list(map(int, ids)) for ids in r.token_ids]
        return dt

    t = interleaved({"mlx:cell": ours_side, "batch_generate": theirs_side}, z["model_repeats"])
    same = got["ours"] == got["theirs"]
    ours, theirs = n * k / statistics.median(t["mlx:cell"]), n * k / statistics.median(t["batch_generate"])
    lengths = sorted(len(p) for p in prompts)
    row = Row.from_times(
        "9 chat", f"mlx:cell: {n} chat requests", t, "mlx:cell", "batch_generate",
        f"{ours:.1f} vs {theirs:.1f} gen tok/s ({ours / theirs:.2f}x throughput); outputs "
        f"{'identical' if same else 'DIFFER'}",
        identical=same, tok_s=ours, baseline_tok_s=theirs,
    )
    work = (f"{m['dir']}: {n} chat requests sharing a system prompt, request i with i % 8 earlier exchanges "
            f"(prompts {lengths[0]}..{lengths[-1]} tokens), "
            f"{k} tokens each greedy, no EOS; wall time prompt included; mlx:cell with engine.prefill_chunk 512 vs "
            "mlx-lm batch_generate with its defaults; the same prompt ids on both sides.")
    return work, [row]


def lockstep_theirs(model, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    """mlx-lm's own model and KV cache running `prompts` (all one length) as one `[N, L]` batch, then
    `n - 1` decode steps of `[N, 1]` tokens, greedy, each step queued before the previous token is
    read (as generate_step does): (each row's token ids, seconds of the decode steps). With every
    row one length there is no padding and no mask: each sequence attends its own contiguous K/V,
    the per-sequence ideal of a batched decode step."""
    cache = peers.mlx_lm("models.cache").make_prompt_cache(model)
    y = mx.argmax(model(mx.array(prompts), cache=cache)[:, -1, :], axis=-1)  # [N]
    mx.eval(y)
    steps = []
    t0 = time.perf_counter()
    for _ in range(n - 1):
        nxt = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)  # [N]
        mx.async_eval(nxt)
        steps.append(y.tolist())  # read while the next step computes
        y = nxt
    steps.append(y.tolist())
    dt = time.perf_counter() - t0
    return [list(row) for row in zip(*steps)], dt


def row_lockstep(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    """Row 13: N sequences of one prompt length decoding in lockstep on the user's model, `mlx:cell`
    against mlx-lm's model and cache on the same `[N, L]` batch (no padding: the ideal step)."""
    from kvlayout.runner import job as jobs

    m = user_model(ctx)
    n = z["lockstep_tokens"]
    vocab = m["ours"][1].vocab_size
    rng = np.random.default_rng(13)
    out = []
    for seqs, length in z["lockstep"]:
        prompts = [rng.integers(0, vocab, size=length).tolist() for _ in range(seqs)]  # distinct: nothing shared
        reqs = [{"prompt_ids": p, "max_tokens": n} for p in prompts]
        prepared = jobs.prepare(run_config(m["dir"], "mlx:cell", reqs, seqs * (length + n), chunk=seqs * length),
                                loaded=m["ours"])
        got: dict[str, list[list[int]]] = {}

        def ours_side():
            res = prepared.generate()
            got["ours"] = [list(o[0].token_ids) for o in res.outputs]
            return res.stats.decode_s  # the n - 1 decode steps after the prompts' step

        def theirs_side():
            got["theirs"], dt = lockstep_theirs(m["theirs"], prompts, n)
            return dt

        t = interleaved({"mlx:cell": ours_side, "mlx-lm batch": theirs_side}, z["model_repeats"])
        same = got["ours"] == got["theirs"]
        step = {side: statistics.median(ts) / (n - 1) for side, ts in t.items()}
        out.append(Row.from_times(
            "13 lockstep", f"N={seqs} L={length}: mlx:cell step", t, "mlx:cell", "mlx-lm batch",
            f"{step['mlx:cell'] * 1e3:.1f} vs {step['mlx-lm batch'] * 1e3:.1f} ms a decode step; goal <= 1.3; "
            f"ids {'identical' if same else 'DIFFER'}",
            identical=same, seqs=seqs, prompt=length,
        ))
    work = (f"{m['dir']}: N distinct random prompts of L tokens each, all prefilled in one step, then {n - 1} decode "
            "steps of all N, greedy, no EOS; the decode steps' time (kvlayout: Stats.decode_s; mlx-lm: its model and "
            "KV cache on the [N, L] batch, then [N, 1] steps queued a step ahead, as generate_step does). Equal "
            "lengths leave mlx-lm's batch unpadded and unmasked: each sequence attends its own contiguous K/V, the "
            "per-sequence ideal of a whole model step.")
    return work, out
