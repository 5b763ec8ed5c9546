"""Tensor-parallel `kvlayout run`: one process against N ranks on this machine (mlx.launch, ring, loopback).

    python bench/tensor_parallel.py [--model DIR] [--ranks N] [--requests K] [--tokens T]

Runs the same greedy config alone and under `mlx.launch --backend ring -n N`, one after the
other (twice each, the second run kept), and prints each side's decode tok/s, K/V bytes a cell
and model bytes per rank, whether the token ids are identical, and the bytes each decode step
all-sums (two all_sums per layer, o_proj's and down_proj's: tokens x hidden x dtype bytes each).
On one machine the ranks share its cores: the point of N ranks is N times the memory.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def config_text(model: str | None, requests: int, tokens: int) -> str:
    where = f'path = "{model}"' if model else 'preset = "tiny"'
    reqs = "".join(f'[[requests]]\nprompt_ids = {[(7 * i + 3 * j) % 200 + 10 for j in range(32)]}\n'
                   f"max_tokens = {tokens}\n" for i in range(requests))
    return (f'[layout]\nbackend = "mlx"\nkind = "cell"\n[cache]\ncapacity = 8192\nkv_dtype = "float32"\n'
            f"[model]\n{where}\n[sampling]\ntemperature = 0.0\n{reqs}")


def run(argv: list[str]) -> dict:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode or "exited with code" in done.stderr:
        sys.exit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a model directory (default: the tiny preset)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    kvlayout, launch = shutil.which("kvlayout"), shutil.which("mlx.launch")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "run.toml"
        cfg.write_text(config_text(a.model, a.requests, a.tokens))
        alone = [run([kvlayout, "run", str(cfg), "--json"]) for _ in range(2)][-1]
        ranked = [run([launch, "--backend", "ring", "-n", str(a.ranks), kvlayout, "run", str(cfg), "--json"])
                  for _ in range(2)][-1]
    ids = lambda out: [[s["token_ids"] for s in r["samples"]] for r in out["requests"]]  # noqa: E731
    from kvlayout.models.architectures import read_args
    from kvlayout.models.presets import preset_config

    hf = json.loads((Path(a.model) / "config.json").read_text()) if a.model else preset_config("tiny")
    args = read_args(hf)
    per_token = 2 * args.num_hidden_layers * args.hidden_size * 4  # float32 activations, two all_sums a layer
    print(f"model: {a.model or 'tiny preset'} ({args.num_hidden_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_key_value_heads} KV heads); {a.requests} requests x {a.tokens} tokens greedy")
    print(f"1 process : decode {alone['stats']['decode_tok_s']:.1f} tok/s, wall {alone['stats']['wall_s']:.2f} s, "
          f"K/V {alone['kv_bytes']['per_cell']} B/cell")
    for r in ranked["ranks"]:
        print(f"rank {r['rank']} of {a.ranks}: K/V {r['kv_bytes_per_cell']} B/cell, model {r['model_bytes']} B")
    print(f"{a.ranks} ranks   : decode {ranked['stats']['decode_tok_s']:.1f} tok/s, "
          f"wall {ranked['stats']['wall_s']:.2f} s; "
          f"token ids {'identical' if ids(alone) == ids(ranked) else 'DIFFER'}")
    print(f"all-summed per decode step: {per_token} B per token ({2 * args.num_hidden_layers} all_sums of "
          f"{args.hidden_size * 4} B), {per_token * a.requests} B for {a.requests} sequences")


if __name__ == "__main__":
    main()
