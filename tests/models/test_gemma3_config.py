"""Gemma 3's config.json: what kvlayout's gemma3 refuses (one ConfigError naming the file and the key, and
one through the real command: exit 2, one line), how it reads the layer kinds and the multimodal
text half, and a multimodal checkpoint as HF ships it (tied head, vision tower) loading as mlx-lm's."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle
import pytest

from kvlayout.models.architectures import read_args
from kvlayout.models.loading import load_model
from tests.helpers import refused_in_one_line
from tests.models.families import refusal, write_checkpoint
from tests.models.rows_gemma3 import GEMMA3_TEXT, ROWS, TEXT_CONFIG
from tests.runner.conftest import NoCache

SOURCE = "some/config.json"
DROP = object()  # the key removed
SLIDING, FULL = "sliding_attention", "full_attention"
KINDS = [SLIDING, SLIDING, FULL] * 2  # the rows' pattern 3 over 6 layers


def _config(changes: dict) -> dict:
    out = {**GEMMA3_TEXT, **changes}
    return {k: v for k, v in out.items() if v is not DROP}


def _multimodal(text_changes: dict, **top) -> dict:
    text = {k: v for k, v in {**TEXT_CONFIG, **text_changes}.items() if v is not DROP}
    return {"model_type": "gemma3", "vocab_size": 258, "text_config": text, **top}


# name: (config, the start of the one line after "some/config.json: ")
BAD = {
    "attn-softcapping": (_config({"attn_logit_softcapping": 50.0}), "attn_logit_softcapping=50.0 is not supported"),
    "final-softcapping": (_config({"final_logit_softcapping": 30.0}), "final_logit_softcapping=30.0 is not supported"),
    "unknown-layer-type": (_config({"layer_types": [SLIDING, "chunked_attention"] + KINDS[2:]}),
                           "layer_types[1]='chunked_attention' is not a layer type"),
    "layer-types-too-short": (_config({"layer_types": KINDS[:5]}), "layer_types has 5 entries"),
    "layer-types-disagree": (_config({"layer_types": [SLIDING] * 6}),
                             "layer_types[2]='sliding_attention' disagrees with sliding_window_pattern=3"),
    "pattern-zero": (_config({"sliding_window_pattern": 0}), "sliding_window_pattern=0: expected an integer >= 1"),
    "pattern-string": (_config({"sliding_window_pattern": "3"}), "sliding_window_pattern='3'"),
    "pattern-spellings-disagree": (_config({"_sliding_window_pattern": 6}),
                                   "sliding_window_pattern=3 but _sliding_window_pattern=6"),
    "window-missing": (_config({"sliding_window": DROP}), "missing key 'sliding_window'"),
    "window-zero": (_config({"sliding_window": 0}), "sliding_window=0: expected an integer >= 1"),
    "dynamic-rope": (_config({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
                     "rope_scaling type 'dynamic' is not supported"),
    "longrope": (_config({"rope_scaling": {"type": "longrope", "factor": 2.0}}),
                 "rope_scaling type 'longrope' is not supported"),
    "linear-without-factor": (_config({"rope_scaling": {"rope_type": "linear"}}), "rope_scaling: missing key 'factor'"),
    "linear-factor-zero": (_config({"rope_scaling": {"rope_type": "linear", "factor": 0}}), "rope_scaling: factor=0"),
    "scalar-string": (_config({"query_pre_attn_scalar": "32"}), "query_pre_attn_scalar='32'"),
    "local-base-zero": (_config({"rope_local_base_freq": 0}), "rope_local_base_freq=0"),
    "kv-heads-missing": (_config({"num_key_value_heads": DROP}), "missing key 'num_key_value_heads'"),
    "hidden-activation": (_config({"hidden_activation": "gelu"}), "hidden_activation='gelu' is not supported"),
    "bidirectional": (_config({"use_bidirectional_attention": True}), "use_bidirectional_attention=True"),
    "no-text-config": ({"model_type": "gemma3", "vocab_size": 258}, "text_config=None: expected an object"),
    "multimodal-softcapping": (_multimodal({"final_logit_softcapping": 30.0}),
                               "text_config: final_logit_softcapping=30.0 is not supported"),
    "multimodal-pattern-zero": (_multimodal({"sliding_window_pattern": 0}), "text_config: sliding_window_pattern=0"),
    "multimodal-vocab-disagrees": (_multimodal({"vocab_size": 300}), "vocab_size=258 but text_config.vocab_size=300"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_config_gemma3_does_not_run_is_one_config_error_naming_the_key(case):
    cfg, needle = BAD[case]
    message = refusal(cfg, SOURCE)
    assert message.startswith(f"{SOURCE}: {needle}"), message


def test_the_command_refuses_a_softcapped_gemma3_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_config({"attn_logit_softcapping": 50.0})))
    line = refused_in_one_line(capsys, "run", "--model", str(tmp_path), "--prompt", "hi")
    assert f"{tmp_path / 'config.json'}: attn_logit_softcapping=50.0 is not supported" in line


# What a Gemma 3 config says, as kvlayout reads it: (config, field, want)
GOOD = {
    "pattern": (_config({}), "windows", (6, 6, 0, 6, 6, 0)),
    "layer-types-agreeing": (_config({"layer_types": KINDS}), "windows", (6, 6, 0, 6, 6, 0)),
    "layer-types-alone": (_config({"sliding_window_pattern": DROP, "layer_types": [FULL] + [SLIDING] * 5}),
                          "windows", (0, 6, 6, 6, 6, 6)),
    "hf-private-pattern": (_config({"sliding_window_pattern": DROP, "_sliding_window_pattern": 2}),
                           "windows", (6, 0, 6, 0, 6, 0)),
    "default-pattern-6": (_config({"sliding_window_pattern": DROP}), "windows", (6, 6, 6, 6, 6, 0)),
    "pattern-1-all-global": (_config({"sliding_window_pattern": 1}), "windows", (0,) * 6),
    "softcapping-null": (_config({"attn_logit_softcapping": None, "final_logit_softcapping": None}),
                         "extra.query_pre_attn_scalar", 32.0),
    "mlx-lm-defaults": (_config({"head_dim": DROP, "query_pre_attn_scalar": DROP, "rope_local_base_freq": DROP,
                                 "rope_theta": DROP}),
                        "head_dim extra.query_pre_attn_scalar extra.rope_local_base_freq rope_theta",
                        (256, 256.0, 10000.0, 1000000.0)),
    "multimodal-defaults": (_multimodal({}), "model_type vocab_size num_attention_heads num_key_value_heads",
                            ("gemma3", 258, 8, 4)),
    "multimodal-vocab-default": (_multimodal({}, vocab_size=DROP) | {"vocab_size": None}, "vocab_size", 262208),
    "multimodal-eos-from-top": (_multimodal({}, eos_token_id=[1, 106]), "eos_token_id", (1, 106)),
    "yarn": (_config({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}),
             "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
}


def _field(args, path: str):
    for name in path.split("."):
        args = getattr(args, name)
    return args


@pytest.mark.parametrize("case", GOOD)
def test_a_gemma3_config_is_read_as_mlx_lm_and_hf_read_it(case):
    cfg, fields, want = GOOD[case]
    args = read_args(cfg, SOURCE)
    got = tuple(_field(args, f) for f in fields.split())
    assert got == (want if len(got) > 1 else (want,))


def test_a_multimodal_checkpoint_as_hf_ships_it_loads_as_mlx_lm_loads_it(tmp_path):
    """No lm_head (the head tied) and a vision tower beside the language model: both read from the tensors
    (mlx-lm's sanitize), the tower dropped, the logits mlx-lm's."""
    model_dir = write_checkpoint(tmp_path / "gemma3", ROWS["gemma3"])
    weights = dict(mx.load(str(model_dir / "model.safetensors")))
    del weights["language_model.lm_head.weight"]
    weights["vision_tower.patch.weight"] = mx.zeros((4, 4))
    weights["multi_modal_projector.proj.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    ours, args, _ = load_model(model_dir)
    theirs, _ = mlx_lm_utils.load_model(model_dir)
    assert args.tie_word_embeddings and "lm_head" not in ours.language_model
    assert ours.model is ours.language_model.model and ours.dtype == mx.float32
    ids = list(range(30))
    got = ours(ids, range(len(ids)), NoCache(args.windows))  # [T, V]
    want = theirs(mx.array(ids)[None])[0]  # [T, V]
    assert mx.abs(got - want).max().item() < 1e-4
