"""Which tokenizer a model directory gets, and which ids end its samples."""

from __future__ import annotations

import pytest

from kvlayout.errors import ConfigError
from kvlayout.models.loading import load_model
from kvlayout.models.presets import write_preset
from kvlayout.models.tokenizer import BYTE_EOS, BYTE_VOCAB, ByteTokenizer, HFTokenizer, load_tokenizer
from tests.chat_dirs import ENDOFTEXT, IM_END, bpe, chat_model_dir

VOCAB = bpe().get_vocab_size()  # the chat directories' vocabulary


def test_eos_ids_are_the_union_of_config_and_generation_config(tmp_path):
    chat_model_dir(tmp_path / "m", generation_eos=[IM_END, ENDOFTEXT])
    _, args, tok = load_model(tmp_path / "m")
    assert args.eos_token_id == (ENDOFTEXT,)
    assert tok.eos_ids == {ENDOFTEXT, IM_END}


def test_generation_config_may_give_a_single_id(tmp_path):
    chat_model_dir(tmp_path / "m", generation_eos=IM_END)
    assert load_tokenizer(tmp_path / "m", [ENDOFTEXT], VOCAB).eos_ids == {ENDOFTEXT, IM_END}


def test_a_bad_generation_config_eos_is_named(tmp_path):
    chat_model_dir(tmp_path / "m", generation_eos="<|im_end|>")
    with pytest.raises(ConfigError, match=r"generation_config\.json: eos_token_id='<\|im_end\|>'"):
        load_tokenizer(tmp_path / "m", [ENDOFTEXT], VOCAB)


def test_a_byte_vocabulary_directory_without_tokenizer_json_gets_bytes(tiny_dir):
    tok = load_tokenizer(tiny_dir, [], BYTE_VOCAB)
    assert isinstance(tok, ByteTokenizer) and tok.eos_ids == {BYTE_EOS}
    assert tok.chat_template is None


def test_a_directory_with_tokenizer_json_gets_it(tmp_path):
    chat_model_dir(tmp_path / "m")
    assert isinstance(load_tokenizer(tmp_path / "m", [ENDOFTEXT], VOCAB), HFTokenizer)


def test_another_vocabulary_without_tokenizer_json_is_refused_naming_what_is_missing(tmp_path):
    write_preset(tmp_path / "m", "tiny", vocab_size=32000)
    with pytest.raises(ConfigError) as err:
        load_model(tmp_path / "m")
    message = str(err.value)
    assert str(tmp_path / "m") in message and "tokenizer.json is missing" in message
    assert "32000" in message and "\n" not in message


DAMAGED_TOKENIZERS = {
    "empty": (b"", "EOF while parsing"),
    "truncated": (b'{"version": "1.0", "model": {', "EOF while parsing"),
    "an-array": (b"[1, 2]", "invalid type: sequence"),
    "no-model": (b"{}", "Model missing"),
}
# (Bytes that are not UTF-8 are refused before the tokenizers library sees them, as in every other
# file of a model directory: tests/core/test_cli_bad_input.py has that row.)


@pytest.mark.parametrize("case", DAMAGED_TOKENIZERS)
def test_a_damaged_tokenizer_json_is_one_line_naming_it(case, tmp_path, capsys):
    from tests.helpers import refused_in_one_line

    content, needle = DAMAGED_TOKENIZERS[case]
    chat_model_dir(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_bytes(content)
    line = refused_in_one_line(capsys, "run", "--model", str(tmp_path / "m"), "--prompt", "hi")
    assert f"{tmp_path / 'm' / 'tokenizer.json'}: not a tokenizer the tokenizers library reads (" in line
    assert needle in line
