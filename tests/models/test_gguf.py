"""`init-model --from-gguf`: small GGUF files written as llama.cpp would, converted and checked.

The oracles: mlx-lm reading a directory of the original HF weights (it never
sees the GGUF), llama.cpp's rope permutation and GGML block formats as
written in tests/models/gguf_builders.py, and hand-worked examples.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import pytest

from kvlayout.cli import main
from kvlayout.models.gguf import convert_gguf, unpermute_rope_rows
from kvlayout.models.gguf_file import read_header
from kvlayout.models.loading import load_model, save_model
from tests.models import gguf_builders as gb
from tests.runner.conftest import NoCache


def test_unpermute_undoes_llama_cpp_row_order_by_hand():
    # llama.cpp keeps each head's rotary pairs (i, i + D/2) adjacent: GGUF row 2i is HF row i
    # and GGUF row 2i + 1 is HF row i + D/2. So HF order lists a head's even GGUF rows first.
    one_head = mx.arange(6).reshape(6, 1)  # D = 6
    assert unpermute_rope_rows(one_head, 1).reshape(-1).tolist() == [0, 2, 4, 1, 3, 5]
    two_heads = mx.arange(8).reshape(8, 1)  # D = 4
    assert unpermute_rope_rows(two_heads, 2).reshape(-1).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_unpermute_inverts_llama_cpp_permute_on_every_column():
    w = np.random.default_rng(0).standard_normal((3 * 16, 5)).astype(np.float32)
    back = unpermute_rope_rows(mx.array(gb.llama_cpp_permute(w, 3)), 3)
    np.testing.assert_array_equal(np.array(back), w)


@pytest.mark.parametrize("kind", ["f32_untied", "f16_tied", "f32_linear_rope"])
def test_a_float_gguf_becomes_a_directory_kvlayout_loads_with_mlx_lms_logits(kind, tmp_path):
    scaling = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}} if kind == "f32_linear_rope" else {}
    cfg, weights = gb.tiny_llama(tie_word_embeddings=kind == "f16_tied", **scaling)
    if kind == "f16_tied":  # llama.cpp's F16 files keep the norms in float32
        weights = {k: w if w.ndim == 1 else w.astype(np.float16) for k, w in weights.items()}
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": mx.array(4.0)} if scaling else {}
    gguf = gb.write_gguf(tmp_path / "m.gguf", gb.gguf_tensors(cfg, weights), gb.metadata(cfg, **meta))
    out = convert_gguf(gguf, tmp_path / "converted")
    save_model(tmp_path / "oracle", cfg, {k: mx.array(w.astype(np.float32)) for k, w in weights.items()})

    converted = json.loads((out / "config.json").read_text())
    assert "quantization" not in converted and converted["tie_word_embeddings"] == (kind == "f16_tied")
    assert converted["torch_dtype"] == ("float16" if kind == "f16_tied" else "float32")
    q = mx.load(str(out / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.array(q), weights["model.layers.1.self_attn.q_proj.weight"])

    ours, args, _ = load_model(out, dtype="float32")
    theirs, _ = mlx_lm_utils.load_model(tmp_path / "oracle")
    ids = [int(t) for t in np.random.default_rng(1).integers(0, cfg["vocab_size"], 24)]
    got = ours(ids, range(len(ids)), NoCache(args.windows))  # [T, V]
    want = theirs(mx.array(ids)[None])[0]  # [T, V]
    assert mx.abs(got - want).max().item() < 1e-4


def test_q4_0_and_q8_0_blocks_stay_quantized_exactly_as_ggml_decodes_them(tmp_path):
    cfg, weights = gb.tiny_llama(tie_word_embeddings=True)
    tensors = gb.gguf_tensors(cfg, weights)
    types = {n: gb.GGML_Q4_0 for n, w in tensors.items() if w.ndim == 2} | {"token_embd.weight": gb.GGML_Q8_0}
    gguf = gb.write_gguf(tmp_path / "m.gguf", tensors, gb.metadata(cfg), types)
    assert read_header(gguf).tensors["blk.0.attn_q.weight"].ggml_type == "Q4_0"
    out = convert_gguf(gguf, tmp_path / "converted")

    quant = json.loads((out / "config.json").read_text())["quantization"]
    assert quant == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    model, _ = mlx_lm_utils.load_model(out)  # mlx-lm builds QuantizedLinear / QuantizedEmbedding from it
    modules = dict(model.named_modules())
    for name, w in tensors.items():
        if name not in types:
            continue
        hf = gb.gguf_name_to_hf(name)
        m = modules[hf]
        got = np.array(mx.dequantize(m.weight, m.scales, m.biases, group_size=32, bits=m.bits), dtype=np.float32)
        if ".q_proj" in hf or ".k_proj" in hf:  # back to the GGUF's row order by llama.cpp's own permute
            got = gb.llama_cpp_permute(got, cfg["num_attention_heads" if ".q_proj" in hf else "num_key_value_heads"])
        want = gb.DECODERS[types[name]](gb.ENCODERS[types[name]](w), w.shape[1])
        # MLX dequantizes in float16 (scale * q + bias); ggml in float32 (d * (q - 8)).
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, cfg["vocab_size"]) and bool(mx.isfinite(logits).all())


def test_the_toy_tokenizer_splits_digits_merges_and_keeps_control_tokens_whole(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    cfg, weights = gb.tiny_llama()
    gguf = gb.write_gguf(tmp_path / "m.gguf", gb.gguf_tensors(cfg, weights), gb.metadata(cfg))
    out = convert_gguf(gguf, tmp_path / "converted")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    byte = gb.ALPHABET.index
    # Worked by hand: "the" merges h+e only ("Ġt" needs the space); " the" merges all the way;
    # digits always split one by one (tokenizer.ggml.pre "smollm"); <|im_end|> is one control token.
    text = "the the 2024<|im_end|>"
    want = [byte("t"), gb.TOKENS.index("he"), gb.TOKENS.index("Ġthe"), byte("Ġ"),
            byte("2"), byte("0"), byte("2"), byte("4"), gb.EOS]
    assert tok.encode(text).ids == want
    assert tok.decode(want, skip_special_tokens=True) == "the the 2024"
    assert tok.decode(want, skip_special_tokens=False) == text

    hf = AutoTokenizer.from_pretrained(str(out))  # what mlx_lm.load reads
    assert hf.encode(text) == want and hf.eos_token == "<|im_end|>" and hf.bos_token == "<|endoftext|>"
    chat = hf.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False)
    assert chat == "the<|im_end|>"
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": gb.BOS, "eos_token_id": gb.EOS}


def _refused(tmp_path, capsys, gguf: Path) -> str:
    """Convert through the CLI: exit 2, one line naming the file, nothing written."""
    assert main(["init-model", str(tmp_path / "out"), "--from-gguf", str(gguf)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlayout: error: ") and str(gguf) in lines[0], captured.err
    assert not (tmp_path / "out").exists()
    return lines[0]


def _variant(tmp_path, drop=None, transpose=None, meta=None, extra=None, retype=None) -> Path:
    cfg, weights = gb.tiny_llama()
    tensors = gb.gguf_tensors(cfg, weights)
    tensors.pop(drop, None)
    if transpose:
        tensors[transpose] = np.ascontiguousarray(tensors[transpose].T)
    tensors |= extra or {}
    path = gb.write_gguf(tmp_path / "bad.gguf", tensors, gb.metadata(cfg, **(meta or {})))
    if retype:
        gb.retype(path, *retype)
    return path


REFUSALS = {
    "missing-tensor": (dict(drop="blk.1.ffn_up.weight"), "tensor 'blk.1.ffn_up.weight' is missing"),
    "wrong-shape": (
        dict(transpose="blk.0.ffn_down.weight"),
        "tensor 'blk.0.ffn_down.weight' has shape (128, 64), the metadata implies (64, 128)",
    ),
    "unknown-architecture": (dict(meta={"general.architecture": "gemma2"}), "general.architecture is 'gemma2'"),
    "k-quant-tensor": (dict(retype=("blk.0.ffn_gate.weight", 14)), "tensor 'blk.0.ffn_gate.weight' has type Q6_K"),
    "unknown-tokenizer-model": (dict(meta={"tokenizer.ggml.model": "llama"}), "tokenizer.ggml.model 'llama'"),
    "unknown-pre-tokenizer": (dict(meta={"tokenizer.ggml.pre": "deepseek-llm"}), "tokenizer.ggml.pre 'deepseek-llm'"),
    "stray-tensor": (
        dict(extra={"rope_freqs.weight": np.ones(8, np.float32)}),
        "tensor 'rope_freqs.weight' is not part of a llama model",
    ),
    "rope-scaling": (dict(meta={"llama.rope.scaling.type": "yarn"}), "llama.rope.scaling.type 'yarn'"),
    "missing-hyperparameter": (
        dict(meta={"llama.feed_forward_length": None}),
        "metadata 'llama.feed_forward_length' is missing",
    ),
    # The config it implies is checked as any config.json is (ModelArgs.from_hf).
    "no-heads": (
        dict(meta={"llama.attention.head_count": mx.array(0, dtype=mx.uint32), "llama.attention.key_length": None}),
        "its config.json: num_attention_heads=0: expected an integer >= 1",
    ),
    "kv-heads-not-a-divisor": (
        dict(meta={"llama.attention.head_count_kv": mx.array(3, dtype=mx.uint32)}),
        "its config.json: num_attention_heads=4 is not a multiple of num_key_value_heads=3",
    ),
    "zero-rms-epsilon": (
        dict(meta={"llama.attention.layer_norm_rms_epsilon": mx.array(0.0, dtype=mx.float32)}),
        "its config.json: rms_norm_eps=0.0: expected a number > 0",
    ),
    # Each metadata value is read by one accessor, of one kind.
    "eos-id-a-string": (
        dict(meta={"tokenizer.ggml.eos_token_id": "2"}),
        "metadata 'tokenizer.ggml.eos_token_id' is '2'; expected an integer",
    ),
    "add-bos-a-string": (
        dict(meta={"tokenizer.ggml.add_bos_token": "yes"}),
        "metadata 'tokenizer.ggml.add_bos_token' is 'yes'; expected true or false",
    ),
    "hidden-size-a-float": (
        dict(meta={"llama.embedding_length": mx.array(64.0, dtype=mx.float32)}),
        "metadata 'llama.embedding_length' is 64.0; expected an integer",
    ),
    "per-layer-heads": (
        dict(meta={"llama.attention.head_count_kv": mx.array([2, 2], dtype=mx.uint32)}),
        "metadata 'llama.attention.head_count_kv' is an array",
    ),
    "eos-id-past-the-vocabulary": (
        dict(meta={"tokenizer.ggml.eos_token_id": mx.array(10**6, dtype=mx.uint32)}),
        "metadata 'tokenizer.ggml.eos_token_id' is 1000000; tokenizer.ggml.tokens has",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_a_gguf_we_cannot_convert_is_refused_in_one_line_naming_what_and_where(case, tmp_path, capsys):
    kwargs, needle = REFUSALS[case]
    assert needle in _refused(tmp_path, capsys, _variant(tmp_path, **kwargs))


def test_a_file_that_is_not_gguf_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "model.gguf"
    path.write_text("not a model\n")
    assert "not a GGUF file" in _refused(tmp_path, capsys, path)


def test_init_model_from_gguf_writes_every_file_mlx_lm_and_transformers_read(tmp_path, capsys):
    cfg, weights = gb.tiny_llama()
    gguf = gb.write_gguf(tmp_path / "m.gguf", gb.gguf_tensors(cfg, weights), gb.metadata(cfg))
    assert main(["init-model", str(tmp_path / "m"), "--from-gguf", str(gguf)]) == 0
    assert {p.name for p in (tmp_path / "m").iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
    }
    assert str(tmp_path / "m") in capsys.readouterr().out
