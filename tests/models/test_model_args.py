"""config.json's values, wrong: every key ModelArgs.from_hf reads, a wrong type or range each.

Each row runs the real command (`kvlayout run --model DIR`) on a directory
whose config.json is the tiny preset's with one change: exit 2, one line
naming config.json, the key and what is allowed.
"""

from __future__ import annotations

import json

import pytest

from kvlayout.errors import ConfigError
from kvlayout.models.architectures import read_args
from kvlayout.models.presets import preset_config
from tests.helpers import refused_in_one_line

DROP = object()  # the key removed
INT = "expected an integer >= 1"
POSITIVE = "expected a number > 0"
BOOL = "expected true or false"
IDS = "expected a token id (an integer >= 0), a list of them, or null"
SLIDING = {"sliding_window": 8}
QWEN_SLIDING = {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0}

# name: (changes to the tiny preset's config.json, what the one line must say after "config.json: ")
BAD = {
    "model_type-unknown": ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    "model_type-null": ({"model_type": None}, "model_type=None is not supported"),
    "hidden_size-missing": ({"hidden_size": DROP}, "missing key 'hidden_size'"),
    "hidden_size-string": ({"hidden_size": "abc"}, f"hidden_size='abc': {INT}"),
    "hidden_size-null": ({"hidden_size": None}, f"hidden_size=None: {INT}"),
    "hidden_size-negative": ({"hidden_size": -64}, f"hidden_size=-64: {INT}"),
    "hidden_size-float": ({"hidden_size": 64.0}, f"hidden_size=64.0: {INT}"),
    "hidden_size-bool": ({"hidden_size": True}, f"hidden_size=True: {INT}"),
    "num_hidden_layers-zero": ({"num_hidden_layers": 0}, f"num_hidden_layers=0: {INT}"),
    "num_hidden_layers-string": ({"num_hidden_layers": "2"}, f"num_hidden_layers='2': {INT}"),
    "num_attention_heads-zero": ({"num_attention_heads": 0}, f"num_attention_heads=0: {INT}"),
    "num_attention_heads-more-than-hidden": (
        {"num_attention_heads": 128, "head_dim": None}, "num_attention_heads=128 is more than hidden_size=64"
    ),
    "num_key_value_heads-zero": ({"num_key_value_heads": 0}, f"num_key_value_heads=0: {INT}"),
    "num_key_value_heads-string": ({"num_key_value_heads": "2"}, f"num_key_value_heads='2': {INT}"),
    "num_key_value_heads-not-a-divisor": (
        {"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"
    ),
    "head_dim-zero": ({"head_dim": 0}, f"head_dim=0: {INT}"),
    "head_dim-string": ({"head_dim": "16"}, f"head_dim='16': {INT}"),
    "intermediate_size-negative": ({"intermediate_size": -1}, f"intermediate_size=-1: {INT}"),
    "vocab_size-zero": ({"vocab_size": 0}, f"vocab_size=0: {INT}"),
    "vocab_size-missing": ({"vocab_size": DROP}, "missing key 'vocab_size'"),
    "rms_norm_eps-string": ({"rms_norm_eps": "abc"}, f"rms_norm_eps='abc': {POSITIVE}"),
    "rms_norm_eps-negative": ({"rms_norm_eps": -1e-5}, f"rms_norm_eps=-1e-05: {POSITIVE}"),
    "rms_norm_eps-null": ({"rms_norm_eps": None}, f"rms_norm_eps=None: {POSITIVE}"),
    "rope_theta-zero": ({"rope_theta": 0}, f"rope_theta=0: {POSITIVE}"),
    "rope_theta-bool": ({"rope_theta": True}, f"rope_theta=True: {POSITIVE}"),
    "rope_scaling-string": ({"rope_scaling": "x"}, "rope_scaling='x': expected null or an object"),
    "rope_scaling-unknown-type": ({"rope_scaling": {"rope_type": "yarn"}}, "rope_scaling type 'yarn' is not supported"),
    "rope_scaling-no-factor": ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling: missing key 'factor'"),
    "rope_scaling-factor-string": (
        {"rope_scaling": {"type": "linear", "factor": "2"}}, f"rope_scaling: factor='2': {POSITIVE}"
    ),
    "rope_scaling-llama3-equal-freq-factors": (
        {"rope_scaling": {**LLAMA3, "low_freq_factor": 4.0}},
        "rope_scaling: high_freq_factor=4.0 must be more than low_freq_factor=4.0",
    ),
    "rope_scaling-llama3-old-length-zero": (
        {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 0}},
        f"rope_scaling: original_max_position_embeddings=0: {INT}",
    ),
    "tie_word_embeddings-string": ({"tie_word_embeddings": "false"}, f"tie_word_embeddings='false': {BOOL}"),
    "attention_bias-int": ({"attention_bias": 1}, f"attention_bias=1: {BOOL}"),
    "mlp_bias-null": ({"mlp_bias": None}, f"mlp_bias=None: {BOOL}"),
    "sliding_window-string": ({"sliding_window": "abc"}, "sliding_window='abc': expected an integer >= 0"),
    "sliding_window-negative": ({"sliding_window": -3}, "sliding_window=-3: expected an integer >= 0"),
    "layer_types-string": ({**SLIDING, "layer_types": "sliding"}, "layer_types='sliding': expected a list of"),
    "layer_types-unknown-kind": (
        {**SLIDING, "layer_types": ["sliding_attention", "chunked_attention"]},
        "layer_types[1]='chunked_attention' is not a layer type kvlayout knows",
    ),
    "layer_types-too-short": ({**SLIDING, "layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    "use_sliding_window-string": (
        {"model_type": "qwen2", "use_sliding_window": "yes"}, f"use_sliding_window='yes': {BOOL}"
    ),
    "max_window_layers-negative": (
        {**QWEN_SLIDING, "max_window_layers": -1}, "max_window_layers=-1: expected an integer >= 0"
    ),
    "eos_token_id-string": ({"eos_token_id": "abc"}, f"eos_token_id='abc': {IDS}"),
    "eos_token_id-list-of-strings": ({"eos_token_id": ["abc"]}, f"eos_token_id=['abc']: {IDS}"),
    "eos_token_id-negative": ({"eos_token_id": -1}, f"eos_token_id=-1: {IDS}"),
    "eos_token_id-bool": ({"eos_token_id": True}, f"eos_token_id=True: {IDS}"),
    "eos_token_id-null-in-list": ({"eos_token_id": [1, None]}, f"eos_token_id=[1, None]: {IDS}"),
}


def _config(changes: dict) -> dict:
    cfg = preset_config("tiny")
    for key, value in changes.items():
        if value is DROP:
            del cfg[key]
        else:
            cfg[key] = value
    return cfg


@pytest.mark.parametrize("case", BAD)
def test_a_wrong_config_value_is_one_line_naming_the_file_the_key_and_what_is_allowed(case, tmp_path, capsys):
    changes, needle = BAD[case]
    (tmp_path / "config.json").write_text(json.dumps(_config(changes)))
    line = refused_in_one_line(capsys, "run", "--model", str(tmp_path), "--prompt", "hi")
    assert f"{tmp_path / 'config.json'}: {needle}" in line


# What HF writes and means: these stay accepted, with HF's meaning.
GOOD = {
    "null-kv-heads-are-the-heads": ({"num_key_value_heads": None}, "num_key_value_heads", 4),
    "null-head-dim-is-hidden-over-heads": ({"head_dim": None}, "head_dim", 16),
    "null-eos-is-none": ({"eos_token_id": None}, "eos_token_id", ()),
    "one-eos-id": ({"eos_token_id": 7}, "eos_token_id", (7,)),
    "a-list-of-eos-ids": ({"eos_token_id": [7, 9]}, "eos_token_id", (7, 9)),
    "null-window-is-none": ({"sliding_window": None}, "windows", (0, 0)),
    "zero-window-is-none": ({"sliding_window": 0}, "windows", (0, 0)),
    "an-int-theta": ({"rope_theta": 500000}, "rope_theta", 500000.0),
    "qwen2-ignores-an-unused-window": ({"model_type": "qwen2", "sliding_window": "unused"}, "windows", (0, 0)),
}


@pytest.mark.parametrize("case", GOOD)
def test_values_hf_writes_are_read_as_hf_reads_them(case):
    changes, field, want = GOOD[case]
    assert getattr(read_args(_config(changes)), field) == want


def test_a_refused_config_names_the_source_given():
    with pytest.raises(ConfigError, match=r"^some/config\.json: hidden_size='abc'"):
        read_args(_config({"hidden_size": "abc"}), source="some/config.json")
