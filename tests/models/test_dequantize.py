"""Quantized checkpoints dequantized at load are what `mlx_lm.convert --dequantize` writes, and generate
what mlx-lm generates on that written directory: the oracle is always the directory mlx-lm's own convert
wrote and mlx-lm's own loader and `generate_step` on it, never kvlayout's code.

The random checkpoints are the tiny preset quantized by `mlx_lm.convert -q` (tests/models/conftest.py),
plus a float16 one (its scales and biases float16, so the order "cast to the dtype, then unpack" shows)
and one with mixed bits from convert's own recipe. SmolLM2 is the cached real model (4-bit, an 8-bit
embedding, a tied head, float16 scales).
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import pytest
from mlx.utils import tree_flatten

import kvlayout
from kvlayout.mlx.pool import DTYPES
from kvlayout.models import smollm2
from kvlayout.models.loading import load_model
from kvlayout.models.quantization import dequantize_model, dequantized_nbytes, packed_bits, packed_modules
from kvlayout.runner import job
from tests.helpers import cli_env
from tests.helpers import kvlayout as kvlayout_command
from tests.models.conftest import QUANTIZED
from tests.models.quantized import convert_tiny, mlx_lm_dequantized, mlx_lm_greedy, packings
from tests.models.test_smollm2 import CHAT_IDS
from tests.runner.conftest import make_config

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]  # "Hello, world"
# Beside conftest's: half-precision scales, and convert's mixed 3/6-bit recipe.
MORE = {
    "4bit_g32_float16_tied": lambda out: convert_tiny(out, 4, 32, tied=True, dtype="float16"),
    "mixed_3_6_g32_bfloat16": lambda out: convert_tiny(out, 3, 32, predicate="mixed_3_6", dtype="bfloat16"),
}
# gguf_import_shape has no tokenizer, which mlx_lm.convert needs; 4bit_g32_embedding_8bit_tied has its packing.
CHECKPOINTS = [name for name in QUANTIZED if name != "gguf_import_shape"] + list(MORE)


@pytest.fixture(scope="module")
def checkpoint(quantized_dir, tmp_path_factory):
    """checkpoint(name) -> (the quantized directory, mlx-lm's dequantized float32 copy of it), each written once."""
    root = tmp_path_factory.mktemp("dequantized")
    made = {}

    def get(name: str):
        if name not in made:
            quantized = MORE[name](root / name) if name in MORE else quantized_dir(name)
            made[name] = quantized, mlx_lm_dequantized(quantized, root / f"{name}-dequantized")
        return made[name]

    return get


@pytest.fixture(scope="module", autouse=True)
def _layouts_installed():
    for kind in ("seq", "cell"):
        kvlayout.resolve("mlx", kind)  # the real plugins, through the registry


def assert_same_tensors(model, directory) -> None:
    """The model's parameters are the directory's tensors: the same names, dtypes and bits."""
    written = mx.load(str(directory / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert sorted(params) == sorted(written)
    for name, want in written.items():
        got = params[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert mx.array_equal(got, want).item(), name  # exactly, not within a tolerance


def load_dequantized(model_dir, dtype: str | None = None):
    """The model of `model_dir` loaded (cast to `dtype`), then unpacked into float layers of it, as a run does."""
    model, _, _ = load_model(model_dir, dtype)
    dequantize_model(model, DTYPES[dtype or "float32"])
    return model


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_weights_dequantized_at_load_are_bit_identical_to_mlx_lm_convert_dequantize(checkpoint, name):
    quantized, dequantized = checkpoint(name)
    model = load_dequantized(quantized)
    assert not any(packings(model).values())  # every layer a float one now
    assert model.dtype == mx.float32
    assert_same_tensors(model, dequantized)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_the_float32_size_a_budget_is_held_against_is_what_mlx_lm_writes(checkpoint, name):
    quantized, dequantized = checkpoint(name)
    model, _, _ = load_model(quantized)
    written = mx.load(str(dequantized / "model.safetensors"))
    assert dequantized_nbytes(model, mx.float32) == sum(t.nbytes for t in written.values())


def test_dequantizing_into_float16_is_bit_identical_to_convert_with_dtype_float16(checkpoint, tmp_path):
    quantized, _ = checkpoint("mixed_3_6_g32_bfloat16")
    model = load_dequantized(quantized, "float16")
    assert model.dtype == mx.float16
    assert_same_tensors(model, mlx_lm_dequantized(quantized, tmp_path / "f16", "float16"))


def test_a_float_directory_loads_the_same_with_or_without_dequantize(checkpoint):
    _, dequantized = checkpoint("4bit_g64_tied")
    model = load_dequantized(dequantized)
    assert_same_tensors(model, dequantized)


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_greedy_tokens_dequantized_at_load_equal_mlx_lm_on_its_dequantized_directory(checkpoint, name, layout):
    quantized, dequantized = checkpoint(name)
    cfg = make_config(quantized, layout, requests=[{"prompt_ids": PROMPT, "max_tokens": 6}],
                      model={"dequantize": True})
    result = job.run(cfg)  # loads the quantized directory the way `kvlayout run` does
    assert result.stats.model.endswith("-bit dequantized to float32)")
    got = result.outputs[0][0].token_ids
    assert got == mlx_lm_greedy(dequantized, PROMPT, 6, eos=[257])
    assert len(got) >= 3  # a few real tokens were compared, not an immediate stop


# -- SmolLM2 ----------------------------------------------------------------------------------

SMOL_TOKENS = 6


@pytest.fixture(scope="module")
def smollm2_dequantized(tmp_path_factory):
    """(the cached SmolLM2 directory, mlx-lm's float32 copy of it, mlx-lm's greedy tokens on the copy).

    Found (or fetched once and cached) as every SmolLM2 test finds it: a run that cannot have it
    fails saying why (`kvlayout init-model DIR --preset smollm2` fetches it)."""
    model_dir = smollm2.smollm2_dir(progress=lambda line: None)
    copy = mlx_lm_dequantized(model_dir, tmp_path_factory.mktemp("smollm2") / "float32")
    return model_dir, copy, mlx_lm_greedy(copy, CHAT_IDS, SMOL_TOKENS)


def test_smollm2_dequantized_at_load_is_bit_identical_to_mlx_lm_convert_dequantize(smollm2_dequantized):
    model_dir, copy, _ = smollm2_dequantized
    model = load_dequantized(model_dir)
    assert_same_tensors(model, copy)


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
def test_smollm2_run_by_default_dequantizes_on_a_fast_blas_and_says_what_mlx_lm_says_on_the_copy(
    layout, tmp_path, smollm2_dequantized
):
    # The command as a user runs it: it preloads the OpenBLAS it finds (kvlayout.runner.blas), and
    # [model] dequantize, left at "auto", then unpacks the weights. mlx-lm's tokens (this process,
    # the bundled BLAS) are the oracle: the same ids whichever BLAS multiplies.
    model_dir, _, want = smollm2_dequantized
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'[model]\npath = "{model_dir}"\n[cache]\ncapacity = 256\n[sampling]\ntemperature = 0.0\n'
        f"[[requests]]\nprompt_ids = {CHAT_IDS}\nmax_tokens = {SMOL_TOKENS}\n"
    )
    done = kvlayout_command("run", str(cfg), "--json", "--layout", layout, env=cli_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["blas"].startswith("OpenBLAS "), out["blas"]
    assert out["model"] == f"{model_dir} (4/8-bit dequantized to float32)"
    sample = out["requests"][0]["samples"][0]
    assert sample["token_ids"] == want
    assert sample["text"].startswith("The capital of France")


# -- Qwen3-MoE: mlx-lm's packed experts (QuantizedSwitchLinear) ---------------------------------


def moe_checkpoint(out, name: str, mode: str | None = None):
    """A tests/models/rows_qwen3_moe.py row as mlx-lm writes it (mode "mxfp4": the float row packed by
    mlx-lm's quantize_model in that mode, its own quant_predicate keeping the router affine 8-bit), with a
    two-word tokenizer.json, which mlx_lm.convert needs."""
    from tokenizers import Tokenizer, models

    from tests.models.families import mlx_lm_model, write_checkpoint
    from tests.models.rows_qwen3_moe import ROWS

    row = ROWS[name]
    if mode is None:
        write_checkpoint(out, row)
    else:
        model, config = mlx_lm_utils.quantize_model(mlx_lm_model(dict(row.config)), dict(row.config), 32, 4, mode=mode)
        out.mkdir(parents=True)
        mlx_lm_utils.save_model(out, model)
        mlx_lm_utils.save_config(config, out / "config.json")
    Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")).save(str(out / "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """moe(mode) -> (the packed qwen3_moe directory, mlx-lm's float32 dequantized copy of it)."""
    root, made = tmp_path_factory.mktemp("moe"), {}

    def get(mode: str | None):
        if mode not in made:
            packed = moe_checkpoint(root / f"{mode}", "qwen3_moe_q4_mixed", mode)
            made[mode] = packed, mlx_lm_dequantized(packed, root / f"{mode}-dequantized")
        return made[mode]

    return get


def test_moe_experts_dequantized_at_load_are_bit_identical_to_mlx_lm_convert_dequantize(moe):
    packed, dequantized = moe(None)
    model, _, _ = load_model(packed)
    experts = packed_modules(model)["model.layers.0.mlp.switch_mlp.down_proj"]
    assert (experts.bits, experts.group_size, experts.weight.shape) == (8, 32, (4, 64, 8))
    assert packed_bits(model) == "4/8-bit"
    written = mx.load(str(dequantized / "model.safetensors"))
    assert dequantized_nbytes(model, mx.float32) == sum(t.nbytes for t in written.values())
    dequantize_model(model, mx.float32)
    assert not packed_modules(model)
    assert_same_tensors(model, dequantized)


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
def test_moe_greedy_tokens_dequantized_at_load_equal_mlx_lm_on_its_dequantized_directory(moe, layout):
    packed, dequantized = moe(None)
    cfg = make_config(packed, layout, requests=[{"prompt_ids": PROMPT, "max_tokens": 6}], model={"dequantize": True})
    result = job.run(cfg)
    assert result.stats.model.endswith("(4/8-bit dequantized to float32)")
    assert result.outputs[0][0].token_ids == mlx_lm_greedy(dequantized, PROMPT, 6, eos=[])


def test_an_mxfp4_checkpoint_gives_mlx_lms_logits_packed_and_its_values_dequantized(moe):
    """mlx-lm's dequantize leaves mxfp4 weights bfloat16 (mx.dequantize's default for uint8 scales); kvlayout
    unpacks into the dtype asked for, the same values (bfloat16 holds every mxfp4 value exactly)."""
    packed, dequantized = moe("mxfp4")
    assert json.loads((packed / "config.json").read_text())["quantization"]["mode"] == "mxfp4"
    model, args, _ = load_model(packed)
    experts = packed_modules(model)["model.layers.1.mlp.switch_mlp.up_proj"]
    assert (experts.mode, experts.bits, experts.group_size) == ("mxfp4", 4, 32)
    assert packed_modules(model)["model.layers.1.mlp.gate"].mode == "affine"  # mlx-lm's predicate: 8-bit affine
    theirs, _ = mlx_lm_utils.load_model(packed)
    ids = PROMPT + PROMPT
    from tests.runner.conftest import NoCache

    got = model(ids, range(len(ids)), NoCache(args.windows))  # [T, V]
    assert mx.abs(got - theirs(mx.array(ids)[None])[0]).max().item() < 1e-4
    written = mx.load(str(dequantized / "model.safetensors"))
    assert dequantized_nbytes(model, mx.float32) == sum(t.size * 4 for t in written.values())
    dequantize_model(model, mx.float32)
    params = dict(tree_flatten(model.parameters()))
    assert sorted(params) == sorted(written)
    for name, want in written.items():
        assert params[name].dtype == mx.float32 and mx.array_equal(params[name], want.astype(mx.float32)).item(), name


def test_a_llama_run_never_imports_mlx_lm(quantized_dir):
    """The expert classes are looked up, never imported: quantize/dequantize a Llama without mlx-lm."""
    import subprocess
    import sys

    code = (
        "import sys, mlx.core as mx\n"
        "from kvlayout.models.loading import load_model\n"
        "from kvlayout.models.quantization import dequantize_model, dequantized_nbytes, packed_bits\n"
        f"m, _, _ = load_model({str(quantized_dir('4bit_g32_untied'))!r})\n"
        "assert packed_bits(m) == '4-bit' and dequantized_nbytes(m, mx.float32) > 0\n"
        "dequantize_model(m, mx.float32)\n"
        "assert 'mlx_lm' not in sys.modules, 'mlx_lm imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_biased_experts_unpack_as_mlx_lm_dequantize_model_unpacks_them(mode):
    """gpt-oss's experts carry a bias: the float SwitchLinear rebuilt keeps it, as mlx-lm's own
    dequantize_model does (its dtype aside: mlx-lm leaves mxfp4 weights bfloat16)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    def packed():
        mx.random.seed(4)
        holder = nn.Module()
        holder.experts = SwitchLinear(64, 16, 3, bias=True)
        holder.experts.bias = mx.random.normal((3, 16))
        nn.quantize(holder, 32, 4, mode=mode)
        return holder

    ours, theirs = packed(), mlx_lm_utils.dequantize_model(packed())
    assert type(packed_modules(ours)["experts"]).__name__ == "QuantizedSwitchLinear"
    dequantize_model(ours, mx.float32)
    assert type(ours.experts) is SwitchLinear
    want = dict(tree_flatten(theirs.parameters()))
    got = dict(tree_flatten(ours.parameters()))
    assert sorted(got) == sorted(want) == ["experts.bias", "experts.weight"]
    for name in want:
        assert got[name].dtype == mx.float32
        assert mx.array_equal(got[name], want[name].astype(mx.float32)).item(), name
