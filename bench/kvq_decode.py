"""Decode tok/s of quantized K/V (q8, q4) against float32 on `mlx:cell`, the tiny preset at head_dim 64.

    python bench/kvq_decode.py [--repeats 5] [--tokens 16]

The decode rows of `kvlayout bench kvq` (row 11) for its tiny model alone, in seconds rather
than the row's forty minutes (its SmolLM2 half): 1, 8 and 32 requests of byte prompts, greedy,
no EOS, decode time = Stats.decode_s, the three kv_dtypes interleaved in one process.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvlayout.bench.kvq_rows import prompts_for, with_kv
from kvlayout.bench.model_rows import load_both, run_config
from kvlayout.bench.timing import interleaved
from kvlayout.models.presets import write_preset
from kvlayout.runner import job as jobs

DTYPES = ("float32", "q8", "q4")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_preset(Path(tmp) / "tiny_d64", "tiny", head_dim=64)
        ours, _, tokenizer = load_both(model)
        for n in (1, 8, 32):
            prompts = prompts_for(tokenizer, n, chat=False)
            reqs = [{"prompt_ids": p, "max_tokens": a.tokens} for p in prompts]
            base = run_config(model, "mlx:cell", reqs, sum(map(len, prompts)) + n * a.tokens, chunk=512)
            prepared = {d: jobs.prepare(with_kv(base, d), loaded=ours) for d in DTYPES}
            t = interleaved({d: (lambda d=d: prepared[d].generate().stats.decode_s) for d in DTYPES}, a.repeats)
            f = statistics.median(t["float32"])
            ratios = ", ".join(f"{d} {f / statistics.median(t[d]):.2f}x" for d in DTYPES[1:])
            print(f"{n:>2} sequences: {ratios} float32's decode tok/s (float32 {n * (a.tokens - 1) / f:.0f} tok/s)")


if __name__ == "__main__":
    main()
