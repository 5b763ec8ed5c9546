"""The GGUF header reader against MLX's own GGUF writer and reader."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout.errors import ConfigError
from kvlayout.models.gguf_file import read_header
from tests.models import gguf_builders as gb


@pytest.fixture
def tiny_gguf(tmp_path):
    cfg, weights = gb.tiny_llama()
    return gb.write_gguf(tmp_path / "m.gguf", gb.gguf_tensors(cfg, weights), gb.metadata(cfg))


def test_metadata_and_shapes_agree_with_mx_load(tiny_gguf):
    header = read_header(tiny_gguf)
    arrays, meta = mx.load(str(tiny_gguf), return_metadata=True)
    assert header.version == 3
    assert {k: v.shape for k, v in header.tensors.items()} == {k: tuple(v.shape) for k, v in arrays.items()}
    assert {t.ggml_type for t in header.tensors.values()} == {"F32"}
    assert meta.keys() == header.metadata.keys()
    for key, value in meta.items():
        mine = header.metadata[key]
        assert (np.array(value).tolist() if isinstance(value, mx.array) else value) == np.asarray(mine).tolist()


def test_a_tensor_type_is_named_as_ggml_names_it(tiny_gguf):
    gb.retype(tiny_gguf, "blk.1.ffn_up.weight", 12)  # what a Q4_K_M file holds
    assert read_header(tiny_gguf).tensors["blk.1.ffn_up.weight"].ggml_type == "Q4_K"


def test_a_truncated_header_is_named_not_read_past(tiny_gguf):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:3000])  # inside the vocabulary
    with pytest.raises(ConfigError, match=r"m\.gguf: truncated GGUF header"):
        read_header(tiny_gguf)
