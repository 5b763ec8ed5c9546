"""A bad quantization section or a packed tensor that disagrees with it is refused in one line,
naming config.json (or the directory) and the key or tensor; the good shapes load."""

from __future__ import annotations

import re
import shutil

import mlx.core as mx
import pytest

from kvlayout.errors import ConfigError
from kvlayout.models.loading import load_model
from kvlayout.models.quantization import AFFINE_BITS, GROUP_SIZES
from tests.models.quantized import GGUF_QUANTIZATION, edit_config, packings

BASE = "4bit_g32_untied"  # every layer packed 4-bit, group 32; lm_head untied
Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.fixture
def copy(quantized_dir, tmp_path):
    """copy(name) -> a private copy of a shared quantized directory, free to edit."""
    return lambda name=BASE: shutil.copytree(quantized_dir(name), tmp_path / name)


def refused(model_dir, pattern: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_model(model_dir)
    message = str(err.value)
    assert "\n" not in message
    assert re.search(pattern, message), message
    return message


def test_the_bits_and_group_sizes_accepted_are_the_ones_mlx_packs():
    """MLX is the oracle: a value is in our tables iff mx.quantize accepts it."""

    def packs(group_size, bits):
        try:
            mx.eval(mx.quantize(mx.zeros((1, 128)), group_size, bits))
            return True
        except ValueError:
            return False

    assert {b for b in range(1, 17) if packs(64, b)} == set(AFFINE_BITS)
    assert {g for g in (8, 16, 32, 64, 128, 256, 512) if packs(g, 4)} == set(GROUP_SIZES)


@pytest.mark.parametrize(
    "section, pattern",
    [
        (4, r"config\.json: quantization: expected a mapping \(group_size, bits\), got int"),
        ({"group_size": 32, "bits": 7}, r"config\.json: quantization\.bits=7: MLX packs 1, 2, 3, 4, 5, 6 or 8 bits"),
        ({"group_size": 32, "bits": "4"}, r"config\.json: quantization\.bits='4': expected an integer, got str"),
        ({"group_size": 32, "bits": True}, r"config\.json: quantization\.bits=True: expected an integer"),
        (
            {"group_size": 16, "bits": 4},
            r"config\.json: quantization\.group_size=16: MLX packs groups of 32, 64 or 128 inputs",
        ),
        ({"group_size": 32}, r"config\.json: missing required key 'quantization\.bits'"),
        ({"group_size": 32, "bits": 4, "mode": "nvfp4"}, r"quantization\.mode='nvfp4' is not supported; .* affine"),
        ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, r"quantization\.group_size=64: mode 'mxfp4' packs with"),
        ({"group_size": 32, "bits": 8, "mode": "mxfp4"}, r"quantization\.bits=8: mode 'mxfp4' packs with bits=4"),
        ({"group_size": 32, "bits": 4, "fancy": 1}, r'quantization\["fancy"\]=1: expected a module path mapped'),
        (
            {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 9}},
            r'quantization\["model\.embed_tokens"\]\.bits=9: MLX packs',
        ),
        (
            {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bitz": 8}},
            r"""unknown key 'quantization\["model\.embed_tokens"\]\.bitz'""",
        ),
        (
            {"group_size": 32, "bits": 4, "model.embed_token": {"group_size": 32, "bits": 8}},
            r'quantization\["model\.embed_token"\] names no Linear or Embedding of this model',
        ),
    ],
)
def test_a_bad_quantization_section_is_refused_naming_config_json_and_the_key(copy, section, pattern):
    model_dir = copy()
    edit_config(model_dir, quantization=section)
    refused(model_dir, pattern)


def test_a_group_size_that_does_not_divide_a_layers_input_is_refused_naming_the_layer(copy):
    model_dir = copy()
    edit_config(model_dir, quantization={"group_size": 128, "bits": 4})  # the tiny model's inputs are 64 wide
    refused(model_dir, r"config\.json: quantization\.group_size=128 does not divide the input dimension 64 of \S+")


def test_hugging_face_quantization_methods_are_refused_naming_the_method(copy):
    model_dir = copy()
    edit_config(model_dir, quantization=None, quantization_config={"quant_method": "awq", "bits": 4})
    refused(model_dir, r"config\.json: quantization_config\.quant_method='awq' is not supported")


def test_a_packed_weight_of_the_wrong_shape_is_refused_naming_it_and_the_packing(copy):
    model_dir = copy()
    weights = dict(mx.load(str(model_dir / "model.safetensors")))
    weights[f"{Q_PROJ}.weight"] = mx.zeros((64, 16), dtype=mx.uint32)  # 8-bit words where 4-bit are declared
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    refused(
        model_dir,
        rf"tensor '{re.escape(Q_PROJ)}\.weight' has shape \(64, 16\), config\.json implies \(64, 8\) "
        r"\(packed 4-bit in groups of 32, as its quantization section says\)",
    )


def test_a_packed_weight_stored_as_floats_is_refused_naming_its_dtype(copy):
    model_dir = copy()
    weights = dict(mx.load(str(model_dir / "model.safetensors")))
    weights[f"{Q_PROJ}.weight"] = mx.zeros((64, 8))
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    refused(model_dir, rf"tensor '{re.escape(Q_PROJ)}\.weight' is float32, config\.json implies uint32 \(packed 4-bit")


def test_a_quantized_checkpoint_without_a_section_says_config_json_lacks_one(copy):
    model_dir = copy()
    edit_config(model_dir, quantization=None, quantization_config=None)
    refused(
        model_dir,
        r"unexpected tensor '\S+\.biases' \(and \d+ more\); "
        r"the checkpoint is quantized but config\.json has no quantization section",
    )


def test_a_layer_the_section_names_is_packed_even_without_scales_so_their_absence_is_named(copy):
    model_dir = copy()
    section = {"group_size": 32, "bits": 4, "lm_head": {"group_size": 32, "bits": 4}}
    weights = {k: v for k, v in mx.load(str(model_dir / "model.safetensors")).items() if not k.startswith("lm_head.s")}
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    edit_config(model_dir, quantization=section)
    refused(model_dir, r"missing tensor 'lm_head\.scales'")


def test_a_layer_left_in_floats_by_false_loads_and_must_not_carry_scales(copy, tmp_path):
    model_dir = copy()
    edit_config(model_dir, quantization={"group_size": 32, "bits": 4, "lm_head": False})
    refused(
        model_dir, r"unexpected tensor 'lm_head\.biases' \(and 1 more\); the checkpoint does not match config\.json"
    )

    # With lm_head stored in floats, false is honoured: every other layer packed, the head not.
    from mlx.utils import tree_flatten

    from kvlayout.models.presets import build_preset

    floats = dict(tree_flatten(build_preset("tiny", seed=3)[0].parameters()))
    weights = {k: v for k, v in mx.load(str(model_dir / "model.safetensors")).items() if not k.startswith("lm_head.")}
    weights["lm_head.weight"] = floats["lm_head.weight"]
    mx.save_safetensors(str(model_dir / "model.safetensors"), weights)
    model, _, _ = load_model(model_dir)
    packed = packings(model)
    assert packed["lm_head"] is None
    assert packed[Q_PROJ] == (4, 32) and packed["model.embed_tokens"] == (4, 32)


def test_the_gguf_imports_section_is_read_as_written(quantized_dir):
    import json

    model_dir = quantized_dir("gguf_import_shape")
    assert json.loads((model_dir / "config.json").read_text())["quantization"] == GGUF_QUANTIZATION
    model, _, _ = load_model(model_dir)
    packed = packings(model)
    assert packed["model.embed_tokens"] == (8, 32)
    assert {v for k, v in packed.items() if k != "model.embed_tokens"} == {(4, 32)}


def test_mxfp4_is_accepted_with_the_one_packing_mlx_gives_it():
    """MLX is the oracle: mx.quantize's mxfp4 takes groups of 32 and 4 bits, nothing else."""
    from kvlayout.models.quantization import MXFP4

    def packs(group_size, bits):
        try:
            mx.eval(mx.quantize(mx.zeros((1, 128)), group_size, bits, mode="mxfp4"))
            return True
        except ValueError:
            return False

    accepted = [(g, b) for g in (16, 32, 64, 128) for b in (2, 4, 8) if packs(g, b)]
    assert accepted == [(MXFP4["group_size"], MXFP4["bits"])]
