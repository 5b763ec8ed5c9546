"""Quantized directories the model tests share, each written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.quantized import convert_tiny, embed_8bit, gguf_shaped

# name -> how it is written. mlx_lm.convert: bits and group size, tied or not; a group of
# 128 splits only down_proj's 128 inputs, so convert leaves every other layer in floats.
QUANTIZED = {
    "4bit_g32_untied": lambda out: convert_tiny(out, 4, 32),
    "4bit_g64_tied": lambda out: convert_tiny(out, 4, 64, tied=True),
    "8bit_g32_tied": lambda out: convert_tiny(out, 8, 32, tied=True),
    "8bit_g64_untied": lambda out: convert_tiny(out, 8, 64),
    "4bit_g32_embedding_8bit_tied": lambda out: convert_tiny(out, 4, 32, tied=True, predicate=embed_8bit),
    "3bit_g128_only_down_proj": lambda out: convert_tiny(out, 3, 128),
    "gguf_import_shape": gguf_shaped,
}


@pytest.fixture(scope="session")
def quantized_dir(tmp_path_factory):
    """quantized_dir(name) -> the directory QUANTIZED[name] writes (once; treat it as read-only)."""
    root = tmp_path_factory.mktemp("quantized")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = QUANTIZED[name](root / name)
        return made[name]

    return get
