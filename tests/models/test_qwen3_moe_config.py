"""Qwen3-MoE's own config keys, wrong: one ConfigError naming config.json and the key (and one through
the real command: exit 2, one line); and HF's unstacked experts load as mlx-lm's stacked ones."""

from __future__ import annotations

import json
import re
import shutil

import mlx.core as mx
import pytest

from kvlayout.errors import ConfigError
from kvlayout.models.architectures import read_args
from kvlayout.models.loading import load_model
from kvlayout.models.qwen3_moe import Experts
from tests.helpers import refused_in_one_line
from tests.models.families import refusal, with_changes, write_checkpoint
from tests.models.rows_qwen3_moe import QWEN3_MOE, ROWS
from tests.runner.conftest import NoCache

SOURCE = "/m/config.json"
RANGE = "expected a list of layer indices in 0..1"

# name: (changes to the qwen3_moe row's config, what the message must say after "config.json: ")
BAD = {
    "top-k-over-experts": ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 is more than num_experts=4"),
    "top-k-zero": ({"num_experts_per_tok": 0}, "num_experts_per_tok=0: expected an integer >= 1"),
    "experts-missing": ({"num_experts": None}, "missing key 'num_experts'"),
    "experts-negative": ({"num_experts": -1}, "num_experts=-1: expected an integer >= 0"),
    "moe-size-string": ({"moe_intermediate_size": "32"}, "moe_intermediate_size='32'"),
    "mlp-only-out-of-range": ({"mlp_only_layers": [2]}, f"mlp_only_layers=[2]: {RANGE}"),
    "mlp-only-negative": ({"mlp_only_layers": [-1]}, "mlp_only_layers=[-1]: expected a list of layer indices"),
    "mlp-only-not-a-list": ({"mlp_only_layers": 0}, "mlp_only_layers=0: expected a list of layer indices"),
    "sparse-step-zero": ({"decoder_sparse_step": 0}, "decoder_sparse_step=0: expected an integer >= 1"),
    "norm-topk-string": ({"norm_topk_prob": "true"}, "norm_topk_prob='true': expected true or false"),
    "rope-scaling-yarn": (
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
        "rope_scaling type 'yarn' is not supported",
    ),
    "rope-scaling-linear": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    "sliding-window": ({"use_sliding_window": True}, "use_sliding_window=True is not supported"),
}


def _config(changes: dict) -> dict:
    return with_changes(QWEN3_MOE, changes)


@pytest.mark.parametrize("case", BAD)
def test_a_wrong_moe_value_is_one_config_error_naming_the_key(case):
    changes, needle = BAD[case]
    assert f"{SOURCE}: {needle}" in refusal(_config(changes), SOURCE)


def test_the_command_refuses_a_wrong_moe_value_in_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(_config({"num_experts_per_tok": 9})))
    line = refused_in_one_line(capsys, "run", "--model", str(tmp_path), "--prompt", "hi")
    assert f"{tmp_path / 'config.json'}: num_experts_per_tok=9 is more than num_experts=4" in line


def test_the_moe_keys_are_read_with_hfs_defaults():
    args = read_args(_config({"decoder_sparse_step": None, "mlp_only_layers": None, "norm_topk_prob": None,
                              "rope_scaling": {"rope_type": "default"}}), SOURCE)
    assert args.extra == Experts(4, 2, 32, False, 1, ())
    assert args.rope_scaling is None and args.windows == (0, 0)
    assert [args.extra.sparse(i) for i in range(2)] == [True, True]
    assert [read_args(_config({"mlp_only_layers": [0]}), SOURCE).extra.sparse(i) for i in range(2)] == [False, True]
    assert [read_args(_config({"decoder_sparse_step": 2}), SOURCE).extra.sparse(i) for i in range(2)] == [False, True]
    assert not read_args(_config({"num_experts": 0}), SOURCE).extra.sparse(1)  # no experts: every layer dense


def unstacked(model_dir, out):
    """A copy of `model_dir` with its experts stored as HF stores them: one tensor per expert."""
    shutil.copytree(model_dir, out)
    weights = dict(mx.load(str(out / "model.safetensors")))
    for name in [n for n in weights if ".switch_mlp." in n]:
        stacked = weights.pop(name)  # [E, out, in]
        for e in range(stacked.shape[0]):
            weights[name.replace(".switch_mlp.", f".experts.{e}.")] = stacked[e]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def test_hf_unstacked_experts_load_as_mlx_lms_stacked_ones(tmp_path):
    stacked = write_checkpoint(tmp_path / "stacked", ROWS["qwen3_moe_dense_layer"])
    copy = unstacked(stacked, tmp_path / "unstacked")
    names = mx.load(str(copy / "model.safetensors")).keys()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert not any(".switch_mlp." in n for n in names)
    ids = list(range(40, 60))
    want = load_model(stacked)[0](ids, range(len(ids)), NoCache((0, 0)))
    got = load_model(copy)[0](ids, range(len(ids)), NoCache((0, 0)))
    assert mx.array_equal(got, want).item()


def test_a_missing_expert_is_refused_naming_its_tensor(tmp_path):
    copy = unstacked(write_checkpoint(tmp_path / "stacked", ROWS["qwen3_moe"]), tmp_path / "unstacked")
    weights = dict(mx.load(str(copy / "model.safetensors")))
    del weights["model.layers.0.mlp.experts.2.up_proj.weight"]
    mx.save_safetensors(str(copy / "model.safetensors"), weights)
    with pytest.raises(ConfigError, match=re.escape("missing tensor 'model.layers.0.mlp.experts.2.up_proj.weight'")):
        load_model(copy)


def test_the_expert_block_gives_a_token_the_same_output_whatever_shares_its_step():
    """mlx-lm's SwitchGLU sorts the routed tokens once a step has 64 (token, expert) pairs: a token's output
    is bit-identical alone, in a short step (unsorted) and in a long one (sorted), as a flat step needs."""
    from kvlayout.models.architectures import build_model

    model = build_model(read_args(QWEN3_MOE, SOURCE))
    mx.eval(model.parameters())
    block = model.model.layers[0].mlp
    x = mx.random.normal((1, 40, QWEN3_MOE["hidden_size"]), key=mx.random.key(1))  # 80 pairs: sorted
    alone = mx.concatenate([block(x[:, i : i + 1]) for i in range(40)], axis=1)  # [1, 40, hidden]
    assert mx.array_equal(block(x), alone).item()
    assert mx.array_equal(block(x[:, :20]), alone[:, :20]).item()  # 40 pairs: unsorted
