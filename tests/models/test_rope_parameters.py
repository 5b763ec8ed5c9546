"""transformers 5 nests RoPE settings under `rope_parameters` (Gemma 3: one per layer type); they are
read as the older top-level keys, so such a config runs what the older spelling runs."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx

from kvlayout.models.architectures import read_args
from kvlayout.models.loading import load_model
from tests.models.families import ALL, write_checkpoint
from tests.runner.conftest import NoCache

IDS = [(5 * i + 3) % 256 for i in range(40)]


def test_a_nested_yarn_gives_the_logits_of_the_top_level_one(tmp_path):
    older = write_checkpoint(tmp_path / "older", ALL["qwen3_tied_yarn"])
    newer = shutil.copytree(older, tmp_path / "newer")
    cfg = json.loads((newer / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_theta": cfg.pop("rope_theta")}
    (newer / "config.json").write_text(json.dumps(cfg))
    want, args, _ = load_model(older)
    got, got_args, _ = load_model(newer)
    assert got_args.rope_scaling["rope_type"] == "yarn" and got_args.rope_theta == args.rope_theta
    ids, cache = IDS, NoCache(args.windows)
    assert mx.array_equal(got(ids, range(len(ids)), cache), want(ids, range(len(ids)), cache)).item()


def test_gemma3_reads_its_per_layer_type_rope_parameters():
    base = dict(ALL["gemma3_text"].config)
    base.pop("rope_theta", None)
    base.pop("rope_local_base_freq", None)
    nested = {**base, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
    }}
    args = read_args(nested)
    assert args.rope_theta == 5e5 and args.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert args.extra.rope_local_base_freq == 2e4
    assert read_args({**nested, "rope_theta": 7e5}).rope_theta == 7e5  # a top-level key wins


def test_a_default_rope_parameters_is_no_scaling():
    cfg = {**ALL["qwen3"].config, "rope_parameters": {"rope_type": "default", "rope_theta": 3e5}}
    cfg.pop("rope_theta")
    args = read_args(cfg)
    assert args.rope_scaling is None and args.rope_theta == 3e5
