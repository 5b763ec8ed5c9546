"""gpt-oss's own config keys, wrong: one ConfigError naming config.json and the key (and one through the
real command: exit 2, one line); the rows' random attention sinks matter; HF's fused experts load as
mlx-lm's split ones; YaRN's `truncate` as HF reads it."""

from __future__ import annotations

import json
import math
import re
import shutil

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from kvlayout.errors import ConfigError
from kvlayout.models.architectures import read_args
from kvlayout.models.gpt_oss import Experts, make_rope
from kvlayout.models.loading import load_model
from tests.helpers import refused_in_one_line
from tests.models.families import refusal, with_changes, write_checkpoint
from tests.models.rows_gpt_oss import GPT_OSS, ROWS, YARN
from tests.models.test_families import PREFIX, PROMPT
from tests.runner.conftest import NoCache

SOURCE = "/m/config.json"
IDS = PROMPT + PREFIX

# name: (changes to the gpt_oss row's config (None: key removed), what the message must say after "config.json: ")
BAD = {
    "unknown-layer-type": ({"layer_types": ["sliding_attention", "chunked_attention"] * 2},
                           "layer_types[1]='chunked_attention' is not a layer type kvlayout knows"),
    "odd-layers-no-layer-types": ({"num_hidden_layers": 3, "layer_types": None},
                                  "layer_types is missing and num_hidden_layers=3 is odd"),
    "layer-types-too-short": ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries"),
    "rope-dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}},
                     "rope_scaling type 'dynamic' is not supported"),
    "rope-longrope": ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling type 'longrope'"),
    "rope-missing": ({"rope_scaling": None}, "missing key 'rope_scaling'"),
    "yarn-no-original-length": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                "rope_scaling: missing key 'original_max_position_embeddings'"),
    "yarn-truncate-string": ({"rope_scaling": {**YARN, "truncate": "false"}},
                             "rope_scaling: truncate='false': expected true or false"),
    "yarn-attention-factor": ({"rope_scaling": {**YARN, "attention_factor": 1.2}},
                              "rope_scaling: attention_factor=1.2 is not supported"),
    "yarn-mscale-alone": ({"rope_scaling": {**YARN, "mscale": 0.7}},
                          "rope_scaling: mscale=0.7 with mscale_all_dim=None"),
    "top-k-over-experts": ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than num_local_experts=4"),
    "top-k-zero": ({"num_experts_per_tok": 0}, "num_experts_per_tok=0: expected an integer >= 1"),
    "window-zero": ({"sliding_window": 0}, "sliding_window=0: expected an integer >= 1"),
    "tied-head": ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported"),
    "no-attention-bias": ({"attention_bias": False}, "attention_bias=False is not supported"),
    "swiglu-limit": ({"swiglu_limit": 10.0}, "swiglu_limit=10.0 is not supported"),
}


def _config(changes: dict) -> dict:
    return with_changes(GPT_OSS, changes)


@pytest.mark.parametrize("case", BAD)
def test_a_wrong_gpt_oss_value_is_one_config_error_naming_the_key(case):
    changes, needle = BAD[case]
    assert f"{SOURCE}: {needle}" in refusal(_config(changes), SOURCE)


def test_the_command_refuses_a_wrong_gpt_oss_value_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_config({"num_hidden_layers": 5, "layer_types": None})))
    line = refused_in_one_line(capsys, "run", "--model", str(tmp_path), "--prompt", "hi")
    assert f"{tmp_path / 'config.json'}: layer_types is missing and num_hidden_layers=5 is odd" in line


def test_the_keys_are_read_with_hfs_and_mlx_lms_defaults():
    args = read_args(_config({"layer_types": None, "head_dim": None, "sliding_window": None,
                              "num_local_experts": None, "num_experts_per_tok": None, "hidden_size": 512}), SOURCE)
    kinds = ("sliding_attention", "full_attention") * 2
    assert args.extra == Experts(128, 4, kinds, 128)
    assert args.head_dim == 64 and args.windows == (128, 0, 128, 0)
    assert args.attention_bias and not args.tie_word_embeddings and args.rope_scaling is None
    full = read_args(_config({"layer_types": ["full_attention"] * 4}), SOURCE)
    assert full.windows == (0, 0, 0, 0)
    assert read_args(GPT_OSS, SOURCE).windows == (5, 0, 5, 0)


@pytest.fixture(scope="module")
def sinks_dirs(tmp_path_factory):
    """name -> (the row written with mlx-lm's zero sinks, the row as it is: random sinks)."""
    root, made = tmp_path_factory.mktemp("gpt_oss"), {}

    def get(name: str):
        if name not in made:
            zero = write_checkpoint(root / f"{name}_zero", attrs.evolve(ROWS[name], tweak=None))
            made[name] = zero, write_checkpoint(root / name, ROWS[name])
        return made[name]

    return get


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_q4"])
def test_the_rows_sinks_matter(sinks_dirs, name):
    """The rows' random sinks change the logits (so tests/models/test_families.py's agreement with
    mlx-lm on them checks the sinks)."""
    zero, sinks = sinks_dirs(name)
    ours, args, _ = load_model(sinks)
    got = ours(IDS, range(len(IDS)), NoCache(args.windows))  # [T, V]
    without = load_model(zero)[0](IDS, range(len(IDS)), NoCache(args.windows))
    assert mx.abs(got - without).max().item() > 1e-2


def fused(model_dir, out):
    """A copy of `model_dir` with its experts as HF stores them: gate and up interleaved in one
    `gate_up_proj` `[E, hidden, 2 * I]` (`x @ W`), `down_proj` `[E, I, hidden]`, biases `*_proj_bias`."""
    shutil.copytree(model_dir, out)
    weights = dict(mx.load(str(out / "model.safetensors")))
    for prefix in sorted({n.rsplit(".experts.", 1)[0] for n in weights if ".experts." in n}):
        e = f"{prefix}.experts"
        gate, up = weights.pop(f"{e}.gate_proj.weight"), weights.pop(f"{e}.up_proj.weight")  # [E, I, hidden]
        weights[f"{e}.gate_up_proj"] = mx.stack([gate, up], axis=2).flatten(1, 2).swapaxes(1, 2)  # [E, hidden, 2I]
        gate_b, up_b = weights.pop(f"{e}.gate_proj.bias"), weights.pop(f"{e}.up_proj.bias")  # [E, I]
        weights[f"{e}.gate_up_proj_bias"] = mx.stack([gate_b, up_b], axis=2).flatten(1, 2)  # [E, 2I]
        weights[f"{e}.down_proj"] = weights.pop(f"{e}.down_proj.weight").swapaxes(1, 2)  # [E, I, hidden]
        weights[f"{e}.down_proj_bias"] = weights.pop(f"{e}.down_proj.bias")
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def test_hf_fused_experts_load_as_mlx_lms_split_ones(sinks_dirs, tmp_path):
    _, split = sinks_dirs("gpt_oss")
    copy = fused(split, tmp_path / "fused")
    names = mx.load(str(copy / "model.safetensors")).keys()
    assert "model.layers.3.mlp.experts.gate_up_proj" in names
    assert not any(n.endswith("gate_proj.weight") for n in names)
    want, args, _ = load_model(split)
    got = load_model(copy)[0]
    assert mx.array_equal(got(IDS, range(len(IDS)), NoCache(args.windows)),
                          want(IDS, range(len(IDS)), NoCache(args.windows))).item()


def test_hf_mxfp4_blocks_and_a_wrong_fused_shape_are_refused(sinks_dirs, tmp_path):
    copy = fused(sinks_dirs("gpt_oss")[0], tmp_path / "fused")
    weights = dict(mx.load(str(copy / "model.safetensors")))
    weights["model.layers.0.mlp.experts.down_proj"] = weights["model.layers.0.mlp.experts.down_proj"][:, :32]
    mx.save_safetensors(str(copy / "model.safetensors"), weights)
    with pytest.raises(ConfigError, match=re.escape("model.layers.0.mlp.experts.down_proj has shape (4, 32, 64)")):
        load_model(copy)
    del weights["model.layers.0.mlp.experts.down_proj"]
    weights["model.layers.0.mlp.experts.down_proj_blocks"] = mx.zeros((4, 64, 2, 16), dtype=mx.uint8)
    weights["model.layers.0.mlp.experts.down_proj_scales"] = mx.zeros((4, 64, 2), dtype=mx.uint8)
    mx.save_safetensors(str(copy / "model.safetensors"), weights)
    with pytest.raises(ConfigError, match=r"down_proj_blocks is OpenAI's MXFP4 packing.*mlx_lm\.convert"):
        load_model(copy)


def hf_yarn(x: np.ndarray, positions: np.ndarray, cfg: dict, base: float) -> np.ndarray:
    """HF's YaRN (`_compute_yarn_parameters`, `apply_rotary_pos_emb`), transcribed: `x` `[T, D]`."""
    dim, factor, old = x.shape[-1], cfg["factor"], cfg["original_max_position_embeddings"]

    def correction(rot):
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(cfg["beta_fast"]), correction(cfg["beta_slow"])
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    attention = 0.1 * math.log(factor) + 1.0
    angles = positions[:, None] * inv_freq[None]  # [T, D/2]
    cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
    rotated = np.concatenate([-x[:, dim // 2:], x[:, : dim // 2]], -1)
    return (x * cos + rotated * sin) * attention


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_rotates_as_hf_reads_truncate(truncate):
    """truncate true: HF's floor/ceil, which is mlx-lm's YarnRoPE; false: HF's unrounded range, which
    mlx-lm (ignoring the key) does not compute and kvlayout does."""
    cfg = {**YARN, "truncate": truncate}
    args = read_args({**GPT_OSS, "rope_scaling": cfg}, SOURCE)
    positions = np.arange(0, 400, 7)  # [T]
    x = np.random.default_rng(2).standard_normal((len(positions), args.head_dim)).astype(np.float32)  # [T, D]
    q = mx.array(x)[None, None]  # [1, 1, T, D]
    got = np.array(make_rope(args)(q, mx.array(positions.astype(np.int32)))[0, 0])
    want = hf_yarn(x.astype(np.float64), positions.astype(np.float64), cfg, args.rope_theta)
    assert np.abs(got - want).max() < 2e-3
    theirs = initialize_rope(args.head_dim, args.rope_theta, False, cfg)
    mlx_lm = np.array(mx.concatenate([theirs(q[:, :, i : i + 1], offset=int(p)) for i, p in enumerate(positions)], 2))
    assert (np.abs(mlx_lm[0, 0] - want).max() < 2e-3) == truncate
