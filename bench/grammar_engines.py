r"""Grammar engines for structured output (issue 31): llguidance vs xgrammar vs outlines-core, measured.

For each engine, on a real tokenizer (SmolLM2-135M, 49152 tokens), this measures:
- tokenizer preparation (once per engine, reported apart) and per-grammar compile time;
- the time to fill the allowed-token bitmask ([ceil(V/32)] int32) at each step of a walk over a valid
  output, token by token (fill mask, check the real next token is allowed, advance), median and p99 in us;
- whether every step's mask allowed the real next token (and EOS at the end), whether a rollback of
  k tokens gives back the mask seen k steps earlier (what speculative decoding needs), and whether
  the engines agree on the number of allowed tokens at each step (disagreements are listed, not hidden).

Grammars: a small JSON schema, a nested one (array of objects, enum), an OpenAI tool-call style schema,
and a date regex. Whitespace is left flexible in all three engines; the instances are compact JSON.

The engines are not project dependencies, so run this from a throwaway venv (xgrammar pulls torch):

    python -m venv /tmp/ge && /tmp/ge/bin/pip install llguidance xgrammar outlines-core tokenizers numpy
    kvlayout init-model /tmp/ge/smollm2 --preset smollm2      # the project's python: writes tokenizer.json
    /tmp/ge/bin/python bench/grammar_engines.py --tokenizer /tmp/ge/smollm2 --json /tmp/ge/grammar.json

Measured 2026-12-02 (2-core x86_64 CPU; llguidance 1.9.1, xgrammar 0.2.9, outlines-core 0.2.14), median
mask time per token over the four grammars / p99 / per-grammar compile / installed on top of tokenizers
and numpy:

    llguidance      28-40 us / <= 0.45 ms / ~1 ms (first mask after it up to ~2 ms) / 7 MB, no dependencies
    xgrammar         7-15 us / <= 0.13 ms / 1-11 ms (tokenizer setup 3.1 s)      / 5.6 GB: torch, transformers
    outlines-core     2-4 us / <= 0.11 ms / 14-63 ms, growing with the schema    / 5 MB, no dependencies

Every engine allowed every real next token and gave the same mask back after a rollback of 4. They
disagree on counts where llguidance keeps forced text (keys, enum values) to its canonical tokens,
xgrammar lets DEL (0x7f) into JSON strings, and llguidance / outlines-core read regex `\d` as Unicode
digits (xgrammar: ASCII). Choice for issue 31: llguidance. Mask time is at most ~1% of a 3-60 ms step
for any of them; xgrammar's weight (torch imported by its matcher) rules it out; llguidance compiles in
~1 ms (outlines-core builds a whole-vocabulary automaton per schema and covers only what becomes a
regex), keeps per-sequence matchers with `rollback(k)` and draft-token checks (speculative decoding),
fills a batch's masks in parallel off the GIL, and applies its bitmask to MLX logits (`llguidance.mlx`).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np


def closed_object(**properties: dict) -> dict:
    """A JSON schema object with exactly these properties, every one required (as OpenAI's strict mode)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


SMALL = closed_object(name={"type": "string"}, age={"type": "integer"})
ITEM = closed_object(sku={"type": "string"}, qty={"type": "integer"},
                     status={"enum": ["pending", "shipped", "delivered"]})
NESTED = closed_object(order_id={"type": "integer"}, items={"type": "array", "items": ITEM})
ARGS = closed_object(city={"type": "string"}, days={"type": "integer"}, metric={"type": "boolean"},
                     threshold={"type": "number"})
TOOL = closed_object(name={"enum": ["get_weather", "search_web", "send_email"]}, arguments=ARGS)
# name, kind, source, a valid instance (compact JSON, or the regex's text)
CASES = [
    ("json_small", "json", SMALL, {"name": "Ada Lovelace", "age": 36}),
    ("json_nested", "json", NESTED, {"order_id": 1042, "items": [
        {"sku": "AB-12", "qty": 3, "status": "shipped"}, {"sku": "ZZ-9", "qty": 1, "status": "pending"}]}),
    ("json_tool_call", "json", TOOL, {"name": "get_weather", "arguments": {
        "city": "Paris", "days": 3, "metric": True, "threshold": 12.5}}),
    ("regex_date", "regex", r"\d{4}-\d{2}-\d{2}", "2026-12-02"),
]
WHITESPACE = r"[\x20\x0A\x0D\x09]*"  # outlines-core's default is "[ ]?"; this matches the other two's flexibility
ROLLBACK_K = 4


def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level alphabet, inverted: the printable char each byte is spelt with -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def load_vocab(tok_dir: Path) -> dict:
    """Token bytes per id (b"" for special tokens), the special ids, EOS: one view shared by the engines
    that are not handed tokenizer.json itself (xgrammar, outlines-core)."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    dec = byte_decoder()
    vocab = tj["model"]["vocab"]
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    size = max(vocab.values()) + 1
    tokens = [b""] * size
    for text, i in vocab.items():
        if i not in special:
            tokens[i] = bytes(dec[ch] for ch in text)
    eos = vocab[cfg["eos_token"]]
    return {"path": str(tok_dir / "tokenizer.json"), "tokens": tokens, "special": special, "eos": eos,
            "size": size}


class LLGuidance:
    name = "llguidance"

    def prepare(self, v: dict) -> None:
        import llguidance
        import llguidance.numpy  # noqa: F401  (fill_next_token_bitmask)

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(v["path"], eos_token=v["eos"])

    def compile(self, kind: str, src) -> object:
        m = self.ll.LLMatcher
        grammar = m.grammar_from_json_schema(src) if kind == "json" else m.grammar_from_regex(src)
        matcher = m(self.tok, grammar, log_level=0)  # the grammar is built here: part of compile
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def matcher(self, grammar) -> object:
        return self.ll.LLMatcher(self.tok, grammar, log_level=0)

    def fill(self, m, mask: np.ndarray) -> None:
        self.ll.numpy.fill_next_token_bitmask(m, mask, 0)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def rollback(self, m, k: int) -> bool:
        return m.rollback(k)


class XGrammar:
    name = "xgrammar"

    def prepare(self, v: dict) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo(v["tokens"], vocab_type=xgr.VocabType.RAW, vocab_size=v["size"],
                                 stop_token_ids=[v["eos"]])
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # no cache: each compile is measured
        self.size = v["size"]

    def compile(self, kind: str, src) -> object:
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(src), any_whitespace=True)
        return self.compiler.compile_regex(src)

    def matcher(self, grammar) -> object:
        m = self.xgr.GrammarMatcher(grammar, max_rollback_tokens=32)
        m.bm = self.xgr.allocate_token_bitmask(1, self.size)  # torch [1, ceil(V/32)] int32
        return m

    def fill(self, m, mask: np.ndarray) -> None:
        m.fill_next_token_bitmask(m.bm, 0)
        mask[:] = m.bm.numpy()  # a copy of 6 KiB: inside the timing, where the server would pay it too

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)

    def rollback(self, m, k: int) -> bool:
        m.rollback(k)
        return True


class OutlinesCore:
    name = "outlines-core"

    def prepare(self, v: dict) -> None:
        import outlines_core as oc

        self.oc = oc
        table: dict[bytes, list[int]] = {}
        for i, b in enumerate(v["tokens"]):
            if b and i != v["eos"]:  # special tokens are left out: never allowed
                table.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(v["eos"], table)

    def compile(self, kind: str, src) -> object:
        regex = src
        if kind == "json":
            regex = self.oc.json_schema.build_regex_from_schema(json.dumps(src), WHITESPACE)
        return self.oc.Index(regex, self.vocab)  # the DFA over the vocabulary: all the work is here

    def matcher(self, grammar) -> object:
        return self.oc.Guide(grammar, max_rollback=32)

    def fill(self, m, mask: np.ndarray) -> None:
        m.write_mask_into(mask.ctypes.data, mask.size, 4)

    def advance(self, m, token: int) -> bool:
        m.advance(token, return_tokens=False)
        return True

    def rollback(self, m, k: int) -> bool:
        m.rollback_state(k)
        return True


def mask_bits(mask: np.ndarray, size: int) -> np.ndarray:
    """[ceil(V/32)] int32 -> [V] bool: bit j of word i is token 32 i + j."""
    return np.unpackbits(mask.view(np.uint8), bitorder="little")[:size].astype(bool)


def walk(engine, grammar, tokens: list[int], v: dict) -> dict:
    """One pass over a valid output: per step, the fill time, the allowed count (special tokens
    excluded), whether the real next token (EOS at the end) was allowed; then a rollback check."""
    m = engine.matcher(grammar)
    mask = np.zeros((1, (v["size"] + 31) // 32), dtype=np.int32)
    normal = np.array([bool(b) for b in v["tokens"]])
    times, counts, misses, masks = [], [], [], []
    for step, nxt in enumerate(tokens + [v["eos"]]):
        mask.fill(0)
        t0 = time.perf_counter_ns()
        engine.fill(m, mask)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        bits = mask_bits(mask[0], v["size"])
        masks.append(bits)
        counts.append(int((bits & normal).sum()))
        if not bits[nxt]:
            misses.append(step)
        if step < len(tokens) and not engine.advance(m, nxt):
            misses.append(f"advance@{step}")
            break
    rollback_ok = None
    if not misses and len(tokens) > ROLLBACK_K:
        rollback_ok = engine.rollback(m, ROLLBACK_K)
        engine.fill(m, mask)
        rollback_ok = bool(rollback_ok and (mask_bits(mask[0], v["size"]) == masks[-1 - ROLLBACK_K]).all())
    return {"times": times, "counts": counts, "misses": misses, "rollback_ok": rollback_ok}


def bench_engine(engine, v: dict, encoded: dict, reps: int) -> list[dict]:
    """Prepare once, then per case: compile, and `reps` walks (the first a warm-up, left out of the times)."""
    t0 = time.perf_counter()
    engine.prepare(v)
    prep_ms = (time.perf_counter() - t0) * 1e3
    rows = []
    for name, kind, src, _ in CASES:
        t0 = time.perf_counter()
        grammar = engine.compile(kind, src)
        compile_ms = (time.perf_counter() - t0) * 1e3
        runs = [walk(engine, grammar, encoded[name], v) for _ in range(reps + 1)]
        times = np.array([t for r in runs[1:] for t in r["times"]])
        cold = np.array(runs[0]["times"])  # the first walk after compile: lazy engines build states here
        rows.append({
            "engine": engine.name, "case": name, "prep_ms": prep_ms, "compile_ms": compile_ms,
            "steps": len(runs[0]["times"]), "mask_med_us": float(np.median(times)),
            "mask_p99_us": float(np.percentile(times, 99)), "mask_max_us": float(times.max()),
            "cold_max_us": float(cold.max()), "cold_total_ms": float(cold.sum() / 1e3),
            "all_allowed": not runs[0]["misses"], "misses": runs[0]["misses"],
            "rollback_ok": runs[0]["rollback_ok"], "counts": runs[0]["counts"],
        })
    return rows


def disagreements(rows: list[dict]) -> dict[str, list]:
    """Per case, the steps where the engines' allowed counts differ: [step, {engine: count}]."""
    out: dict[str, list] = {}
    for name, *_ in CASES:
        by = {r["engine"]: r["counts"] for r in rows if r["case"] == name}
        n = min(len(c) for c in by.values())
        out[name] = [[s, {e: c[s] for e, c in by.items()}] for s in range(n)
                     if len({c[s] for c in by.values()}) > 1]
    return out


def markdown(rows: list[dict], diff: dict[str, list]) -> str:
    head = ("| engine | case | prep ms | compile ms | steps | mask med us | mask p99 us | mask max us "
            "| cold max us | cold walk ms | all allowed | rollback ok | count disagreements |")
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['case']} | {r['prep_ms']:.0f} | {r['compile_ms']:.1f} | {r['steps']} "
            f"| {r['mask_med_us']:.1f} | {r['mask_p99_us']:.1f} | {r['mask_max_us']:.1f} "
            f"| {r['cold_max_us']:.0f} | {r['cold_total_ms']:.2f} "
            f"| {'yes' if r['all_allowed'] else 'NO ' + str(r['misses'])} | {r['rollback_ok']} "
            f"| {len(diff[r['case']])}/{r['steps']} |")
    lines.append("\nAllowed-token counts (special tokens excluded) where the engines differ, first 6 per case:\n")
    for case, steps in diff.items():
        for s, counts in steps[:6]:
            lines.append(f"- {case} step {s}: " + ", ".join(f"{e}={c}" for e, c in counts.items()))
    return "\n".join(lines)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("llguidance", "xgrammar", "outlines-core", "tokenizers", "numpy", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=Path("/tmp/ge/smollm2"), help="dir with tokenizer.json")
    ap.add_argument("--reps", type=int, default=20, help="timed walks per case (after one warm-up)")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    v = load_vocab(args.tokenizer)
    tok = Tokenizer.from_file(v["path"])
    texts = {n: inst if k == "regex" else json.dumps(inst, separators=(",", ":")) for n, k, _, inst in CASES}
    encoded = {n: tok.encode(t, add_special_tokens=False).ids for n, t in texts.items()}
    engines = {e.name: e for e in (LLGuidance(), XGrammar(), OutlinesCore())}
    rows = [r for name in args.engines.split(",") for r in bench_engine(engines[name], v, encoded, args.reps)]
    diff = disagreements(rows)
    print(markdown(rows, diff))
    if args.json:
        meta = {"platform": platform.platform(), "machine": platform.machine(), "versions": versions(),
                "vocab": v["size"], "texts": texts, "tokens": encoded}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows, "disagreements": diff}, indent=1))


if __name__ == "__main__":
    main()
