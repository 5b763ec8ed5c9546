"""Phi-3's config.json: what kvlayout's phi3 refuses (one ConfigError naming the file and the key) and
what it reads as Hugging Face does (the window on every layer, the rotated dims)."""

from __future__ import annotations

import json

import pytest

from kvlayout.models.architectures import read_args
from tests.helpers import refused_in_one_line
from tests.models.families import ALL, refusal  # (not rows_phi3 first: families imports every rows module)

SOURCE = "some/config.json"
DROP = object()  # the key removed


def _config(changes: dict, scaling: dict | None = None) -> dict:
    """The "phi3" row's config with `changes`; with `scaling`, the LongRoPE row's instead, its
    rope_scaling changed by `scaling`."""
    cfg = dict(ALL["phi3" if scaling is None else "phi3_partial_longrope"].config)
    if scaling is not None:
        cfg["rope_scaling"] = _changed(cfg["rope_scaling"], scaling)
    return _changed(cfg, changes)


def _changed(cfg: dict, changes: dict) -> dict:
    out = {**cfg, **changes}
    return {k: v for k, v in out.items() if v is not DROP}


# name: (config, the start of the one line after "some/config.json: ")
BAD = {
    "unknown-rope-type": (_config({"rope_scaling": {"type": "yarn", "factor": 2.0}}),
                          "rope_scaling type 'yarn' is not supported"),
    "dynamic-rope-type": (_config({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
                          "rope_scaling type 'dynamic' is not supported"),
    "long-factor-too-short": (_config({}, {"long_factor": [1.0, 2.0]}),
                              "rope_scaling: long_factor has 2 entries; expected 8"),
    "short-factor-too-long": (_config({}, {"short_factor": [1.0] * 9}),
                              "rope_scaling: short_factor has 9 entries; expected 8"),
    "long-factor-missing": (_config({}, {"long_factor": DROP}), "rope_scaling: missing key 'long_factor'"),
    "long-factor-not-a-list": (_config({}, {"long_factor": 2.0}), "rope_scaling: long_factor=2.0"),
    "long-factor-zero": (_config({}, {"long_factor": [0.0] * 8}), "rope_scaling: long_factor=[0.0"),
    "attention-factor": (_config({}, {"attention_factor": 1.2}), "rope_scaling: attention_factor=1.2"),
    "longrope-without-original-length": (_config({"original_max_position_embeddings": DROP}, {}),
                                         "missing key 'original_max_position_embeddings'"),
    "longrope-traditional": (_config({"rope_traditional": True}, {}), "rope_traditional=True"),
    "linear-without-factor": (_config({"rope_scaling": {"type": "linear"}}), "rope_scaling: missing key 'factor'"),
    # transformers 5's spelling is read as rope_scaling (args.lift_rope_parameters), and checked as that.
    "rope-parameters-only": (_config({"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0] * 16}}),
                             "rope_scaling: missing key"),
    "attention-bias": (_config({"attention_bias": True}), "attention_bias=True is not supported"),
    "mlp-bias": (_config({"mlp_bias": True}), "mlp_bias=True is not supported"),
    "hidden-act": (_config({"hidden_act": "gelu"}), "hidden_act='gelu' is not supported"),
    "head-dim": (_config({"head_dim": 64}), "head_dim=64 is not supported"),
    "partial-rotary-zero": (_config({"partial_rotary_factor": 0}), "partial_rotary_factor=0"),
    "partial-rotary-odd-dims": (_config({"partial_rotary_factor": 0.1}), "partial_rotary_factor=0.1 rotates 3"),
    "sliding-window-string": (_config({"sliding_window": "64"}), "sliding_window='64'"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_config_phi3_does_not_run_is_one_config_error_naming_the_key(case):
    cfg, needle = BAD[case]
    message = refusal(cfg, SOURCE)
    assert message.startswith(f"{SOURCE}: {needle}"), message


def test_the_command_refuses_a_biased_phi3_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_config({"attention_bias": True})))
    line = refused_in_one_line(capsys, "run", "--model", str(tmp_path), "--prompt", "hi")
    assert f"{tmp_path / 'config.json'}: attention_bias=True is not supported" in line


# What a Phi-3 config says, as kvlayout reads it: (changes, field, want)
GOOD = {
    "a-window-on-every-layer": ({"sliding_window": 2047}, "windows", (2047, 2047)),
    "null-window-is-none": ({"sliding_window": None}, "windows", (0, 0)),
    "no-window-is-none": ({}, "windows", (0, 0)),
    "head-dim-is-hidden-over-heads": ({}, "head_dim", 32),
    "hf-eps-default": ({"rms_norm_eps": DROP}, "rms_norm_eps", 1e-5),
    "default-rope-parameters-are-none": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                                         "rope_scaling", None),
    "rotated-dims": ({"partial_rotary_factor": 0.75}, "extra.dims", 24),
    "rope-type-spelled-rope-type": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling",
                                    {"rope_type": "linear", "factor": 2.0}),
}


@pytest.mark.parametrize("case", GOOD)
def test_a_phi3_config_is_read_as_hf_reads_it(case):
    changes, field, want = GOOD[case]
    args = read_args(_config(changes), SOURCE)
    for name in field.split("."):
        args = getattr(args, name)
    assert args == want


def test_longrope_keeps_its_pretrained_length():
    args = read_args(_config({}, {}), SOURCE)
    assert (args.extra.dims, args.extra.original_max_position_embeddings) == (16, 64)
