"""The architectures beyond Llama beside mlx-lm: `kvlayout bench --model DIR` on a random checkpoint of each.

Each family is written by mlx-lm itself (its `Model` class with random
weights, `save_model` / `save_config`, float32) at a real model's layer
shapes with fewer layers, with SmolLM2's tokenizer (49,152 ids: a realistic
LM head, and chat prompts through its template). Then `kvlayout bench
--model DIR --rows decode,chat` runs in its own process per family: row 8
(single-sequence decode, mlx:seq and mlx:cell vs mlx-lm's generate_step) and
row 9 (32 ragged chat requests sharing a system prompt, mlx:cell vs mlx-lm's
batch_generate), both sides in that one process, interleaved, token ids
compared. Also K/V bytes held per token at a 4k-token context: every layer's
K and V (the cell layout keeps each token in every layer), against a window's
worth for sliding layers (mlx:seq's ring layers, mlx-lm's RotatingKVCache).

    python bench/families.py [--families qwen3,gemma3_text,...] [--out DIR] [--quick]

Needs SmolLM2 (fetched and converted once by `kvlayout run`'s default model:
`kvlayout.models.smollm2`) and the bench extra (mlx-lm).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

VOCAB = 49152  # SmolLM2's tokenizer
COMMON = {"vocab_size": VOCAB, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False}
# model_type -> (what it is shaped like, its config): a real model's layer shapes, fewer layers.
SHAPES = {
    # The control: Qwen3-0.6B's shape as a Llama (no q/k norms), kvlayout's oldest family, so a gap both
    # show is the engine's (host cost per step), not the architecture's.
    "llama": ("Qwen3-0.6B layers as Llama, 8 of 28", {
        "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0}),
    "qwen3": ("Qwen3-0.6B layers, 8 of 28", {
        "model_type": "qwen3", "hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0}),
    "qwen3_moe": ("Qwen3-30B-A3B layers at half width, 4 of 48, 32 of 128 experts", {
        "model_type": "qwen3_moe", "hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 3072,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "rope_theta": 1000000.0,
        "num_experts": 32, "num_experts_per_tok": 8, "moe_intermediate_size": 384, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True}),
    "gemma3_text": ("Gemma-3-1B layers, 6 of 26 (5 sliding of 512, 1 global)", {
        "model_type": "gemma3_text", "hidden_size": 1152, "num_hidden_layers": 6, "intermediate_size": 6912,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
        "sliding_window_pattern": 6}),
    "phi3": ("Phi-3-mini layers, 2 of 32", {
        "model_type": "phi3", "hidden_size": 3072, "num_hidden_layers": 2, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 32, "rope_theta": 10000.0}),
    "gpt_oss": ("gpt-oss-20b layers, 4 of 24, 8 of 32 experts", {
        "model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 4, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
        "num_local_experts": 8, "num_experts_per_tok": 4, "rope_theta": 150000.0,
        # gpt-oss's YaRN, but truncate true: mlx-lm always rounds the correction range, HF (and kvlayout)
        # only then, so both sides compute the same RoPE and the ids can be compared.
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": True},
        "layer_types": ["sliding_attention", "full_attention"] * 2}),
}
CONTEXT = 4096  # tokens, for K/V bytes held per token


def write(out: Path, config: dict, tokenizer_dir: Path) -> Path:
    """mlx-lm's random model for `config`, saved as mlx-lm saves one, with SmolLM2's tokenizer."""
    import mlx_lm.utils as mlx_lm_utils

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mlx_lm_utils.save_model(out, model)
    mlx_lm_utils.save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def kv_bytes_per_token(model_dir: Path) -> dict[str, float]:
    """K+V bytes per token at CONTEXT tokens (float32): held by mlx:cell (measured on its tables), by
    mlx:seq and mlx-lm (a sliding layer holds its window only)."""
    from kvlayout.models.architectures import read_args
    from kvlayout.models.loading import read_config

    args = read_args(read_config(model_dir))
    per_layer = 2 * args.num_key_value_heads * args.head_dim * 4
    windowed = sum(per_layer * (min(w, CONTEXT) if w else CONTEXT) for w in args.windows) / CONTEXT
    return {"cell": cell_bytes_in_use([w or 0 for w in args.windows], per_layer), "seq_and_mlx_lm": windowed}


def cell_bytes_in_use(windows: list[int], per_layer: int) -> float:
    """K+V bytes per token the cell layout holds for one sequence of CONTEXT tokens, prefilled in
    512-token steps, as its next decode step is declared: each layer group's cells in use, read off
    its tables (kvlayout_cell.layer_groups; a window's table keeps the last window)."""
    from kvlayout.registry import make_plugin_manager
    from kvlayout_cell.layer_groups import LayerGroups

    groups = LayerGroups(windows, capacity=CONTEXT + 1024, max_seqs=1, pm=make_plugin_manager())
    s = groups.seq_new()
    for start in range(0, CONTEXT, 512):
        positions = list(range(start, min(start + 512, CONTEXT)))
        assert groups.declare_step([s] * len(positions))
        for layer in range(groups.n_layers):
            groups.place_step(layer, positions)
    assert groups.declare_step([s])  # the next decode step: what left every window is retired
    held = groups.cells_by_window()
    return sum(per_layer * held[w] for w in groups.layer_windows) / CONTEXT


def bench(model_dir: Path, out: Path, quick: bool) -> list[dict]:
    cmd = [shutil.which("kvlayout") or "kvlayout", "bench", "--model", str(model_dir), "--rows", "decode,chat",
           "--out", str(out), *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout, file=sys.stderr)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr}")
    return json.loads((out / "bench.json").read_text())["rows"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--out", type=Path, default=None, help="keep the checkpoints and bench.json files here")
    parser.add_argument("--quick", action="store_true", help="kvlayout bench --quick (a smoke test)")
    opts = parser.parse_args()
    from kvlayout.models import smollm2

    tokenizer_dir = smollm2.smollm2_dir()
    root = opts.out or Path(tempfile.mkdtemp(prefix="kvlayout-families-"))
    summary = []
    for name in opts.families.split(","):
        shape, config = SHAPES[name]
        model_dir = write(root / name / "model", {**COMMON, **config}, tokenizer_dir)
        rows = bench(model_dir, root / name, opts.quick)
        kv = kv_bytes_per_token(model_dir)
        summary.append({"family": name, "shape": shape, "kv_bytes_per_token": kv, "rows": rows})
        print(f"{name} ({shape}): K/V bytes a token at {CONTEXT} tokens: mlx:cell {kv['cell']:.0f}, "
              f"mlx:seq and mlx-lm {kv['seq_and_mlx_lm']:.0f}")
        for row in rows:
            for r in row["results"]:
                print(f"  {r['row']}: {r['case']} vs {r['b']}: {r['note']}")
        if opts.out is None:
            shutil.rmtree(model_dir)
    (root / "families.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
