"""A model directory's JSON files, damaged: each a one-line error naming the file, from the command too."""

from __future__ import annotations

import shutil

import pytest

from tests.chat_dirs import chat_model_dir
from tests.helpers import refused_in_one_line

FILES = ("config.json", "tokenizer_config.json", "generation_config.json")
DAMAGE = {
    "a-json-array": (b"[1, 2]", "expected a JSON object {...}, got a JSON array"),
    "a-json-string": (b'"llama"', "expected a JSON object {...}, got a JSON string"),
    "not-utf8": (b'{"model_type": "\xff"}', "not UTF-8 text"),
    "not-json": (b'{"model_type": ', "not valid JSON"),
}


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat") / "m", generation_eos=[2])


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_a_damaged_json_file_is_one_line_naming_it(name, damage, chat_dir, tmp_path, capsys):
    model_dir = shutil.copytree(chat_dir, tmp_path / "m")
    content, needle = DAMAGE[damage]
    (model_dir / name).write_bytes(content)
    line = refused_in_one_line(capsys, "run", "--model", str(model_dir), "--prompt", "hi")
    assert f"{model_dir / name}: {needle}" in line
