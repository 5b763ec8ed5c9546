"""Quantized directories load as mlx-lm loads them: the same layers packed, the same logits, the same
greedy tokens under both layouts (mlx-lm on the same directory is the oracle)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils
import numpy as np
import pytest

import kvlayout
from kvlayout.models.loading import load_model
from kvlayout.runner import job
from tests.models.conftest import QUANTIZED
from tests.models.quantized import edit_config, mlx_lm_greedy, packings
from tests.runner.conftest import NoCache, make_config

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"
IDS = [int(t) for t in np.random.default_rng(0).integers(0, 256, 24)]


@pytest.fixture(scope="module", autouse=True)
def _layouts_installed():
    for kind in ("seq", "cell"):
        kvlayout.resolve("mlx", kind)  # the real plugins, through the registry


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_layers_packed_and_how_are_the_ones_mlx_lm_packs(quantized_dir, name):
    ours, _, _ = load_model(quantized_dir(name))
    theirs, _ = mlx_lm_utils.load_model(quantized_dir(name))
    assert packings(ours) == packings(theirs)
    assert any(packings(ours).values())


@pytest.mark.parametrize("name", QUANTIZED)
def test_logits_equal_mlx_lm_on_the_same_quantized_directory(quantized_dir, name):
    ours, args, _ = load_model(quantized_dir(name))
    theirs, _ = mlx_lm_utils.load_model(quantized_dir(name))
    got = ours(IDS, range(len(IDS)), NoCache(args.windows))  # [T, V]
    want = theirs(mx.array(IDS)[None])[0]  # [T, V]
    assert mx.abs(got - want).max().item() < 1e-4


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
@pytest.mark.parametrize("name", QUANTIZED)
def test_greedy_tokens_equal_mlx_lm_on_the_same_quantized_directory(quantized_dir, name, layout):
    model_dir = quantized_dir(name)
    # Kept packed (on the CPU "auto" would unpack it: tests/models/test_dequantize.py has that path).
    cfg = make_config(model_dir, layout, requests=[{"prompt_ids": PROMPT, "max_tokens": 6}],
                      model={"dequantize": False})
    result = job.run(cfg)  # loads the directory the way `kvlayout run` does
    got = result.outputs[0][0].token_ids
    assert result.stats.kv_dtype == "float32"
    assert got == mlx_lm_greedy(model_dir, PROMPT, 6, eos=[257])
    assert len(got) >= 3  # a few real tokens were compared, not an immediate stop


def test_the_model_dtype_is_the_compute_dtype_not_the_packed_words(quantized_dir):
    model, _, _ = load_model(quantized_dir("4bit_g32_embedding_8bit_tied"))
    assert model.model.embed_tokens.weight.dtype == mx.uint32
    assert model.dtype == mx.float32


def test_casting_converts_the_floats_and_leaves_the_packed_words(quantized_dir):
    model_dir = quantized_dir("4bit_g64_tied")
    stored = dict(mx.load(str(model_dir / "model.safetensors")))
    model, _, _ = load_model(model_dir, "bfloat16")
    assert model.dtype == mx.bfloat16
    from mlx.utils import tree_flatten

    for name, param in tree_flatten(model.parameters()):
        if stored[name].dtype == mx.uint32:
            assert param.dtype == mx.uint32 and mx.array_equal(param, stored[name]).item(), name
        else:
            assert param.dtype == mx.bfloat16, name


def test_quantization_config_alone_is_read_when_quantization_is_absent(quantized_dir, tmp_path):
    """mlx-lm writes the section twice; a tool that keeps only Hugging Face's key still loads."""
    original = quantized_dir("4bit_g32_embedding_8bit_tied")
    copy = shutil.copytree(original, tmp_path / "m")
    edit_config(copy, quantization=None)
    ours, args, _ = load_model(copy)
    theirs, _ = mlx_lm_utils.load_model(original)
    assert packings(ours) == packings(theirs)
    got = ours(IDS, range(len(IDS)), NoCache(args.windows))
    assert mx.abs(got - theirs(mx.array(IDS)[None])[0]).max().item() < 1e-4
