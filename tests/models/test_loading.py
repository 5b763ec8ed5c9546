"""Model directories in the Hugging Face layout: written by init-model, by hand, or broken."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvlayout.errors import ConfigError
from kvlayout.models.loading import load_model
from kvlayout.models.presets import preset_config
from kvlayout.models.tokenizer import ByteTokenizer, HFTokenizer
from tests.runner.conftest import NoCache


def _hand_written(path, drop=None, reshape=None, shards=2):
    """A llama checkpoint written tensor by tensor under HF names, split over `shards` files."""
    cfg = preset_config("tiny", tie_word_embeddings=True)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    layers, vocab = cfg["num_hidden_layers"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    rng = np.random.default_rng(7)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            # HF checkpoints of older transformers carry this buffer; it must be ignored.
            p + "self_attn.rotary_emb.inv_freq": (cfg["head_dim"] // 2,),
        }
    if reshape:
        shapes[reshape] = tuple(reversed(shapes[reshape]))
    tensors = {k: (0.2 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items() if k != drop}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    for n in range(shards):
        part = {k: tensors[k] for k in names[n::shards]}
        save_file(part, str(path / f"model-{n + 1:05d}-of-{shards:05d}.safetensors"), metadata={"format": "pt"})
    return tensors


def test_loads_a_directory_written_by_init_model(tiny_dir):
    model, args, tok = load_model(tiny_dir)
    assert args.model_type == "llama" and args.num_hidden_layers == 2
    assert isinstance(tok, ByteTokenizer)
    assert model([1, 2, 3], [0, 1, 2], NoCache(args.windows)).shape == (3, args.vocab_size)


def test_loads_a_sharded_directory_written_by_hand_with_hf_names(tmp_path):
    tensors = _hand_written(tmp_path / "m")
    model, args, _ = load_model(tmp_path / "m")
    assert args.tie_word_embeddings
    got = np.array(model.model.layers[1].self_attn.k_proj.weight)
    np.testing.assert_array_equal(got, tensors["model.layers.1.self_attn.k_proj.weight"])


def test_a_missing_tensor_fails_naming_it(tmp_path):
    _hand_written(tmp_path / "m", drop="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ConfigError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(tmp_path / "m")


def test_a_mismatched_tensor_fails_naming_it_and_both_shapes(tmp_path):
    _hand_written(tmp_path / "m", reshape="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(
        ConfigError,
        match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(128, 64\), config\.json implies \(64, 128\)",
    ):
        load_model(tmp_path / "m")


def test_a_missing_directory_says_how_to_make_one(tmp_path):
    with pytest.raises(ConfigError, match="init-model"):
        load_model(tmp_path / "nowhere")


def _config_only(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(preset_config("tiny")))
    return path


@pytest.mark.parametrize("names", [["pytorch_model.bin"], ["model.pt"], ["weights.pth"],
                                   ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]])
def test_pickled_pytorch_weights_are_named_as_not_read_with_how_to_convert_them(tmp_path, names):
    model_dir = _config_only(tmp_path / "m")
    for name in names:
        (model_dir / name).write_bytes(b"\x80\x02not read")  # a pickle's opening bytes
    with pytest.raises(ConfigError) as raised:
        load_model(model_dir)
    message = str(raised.value)
    assert "\n" not in message and "no *.safetensors file" in message and names[0] in message
    assert "not read" in message and "save_pretrained(" in message and "safe_serialization=True" in message
    assert str(model_dir) in message.partition("save_pretrained(")[2]  # the conversion names the directory to fix
    assert (f"and {len(names) - 1} more" in message) == (len(names) > 1)


def test_a_directory_without_any_weights_gets_no_conversion_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"no \*\.safetensors file") as raised:
        load_model(_config_only(tmp_path / "m"))
    assert "not read" not in str(raised.value)


def test_an_unsupported_model_type_is_named(tmp_path):
    _hand_written(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        load_model(tmp_path / "m")


def test_tokenizer_json_is_used_when_present(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    _hand_written(tmp_path / "m")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(tmp_path / "m" / "tokenizer.json"))
    _, _, tok = load_model(tmp_path / "m")
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [1, 2]
    assert tok.decode([1, 2]) == "hello world"
