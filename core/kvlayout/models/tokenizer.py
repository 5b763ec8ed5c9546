"""Tokenizers: `tokenizer.json` through the `tokenizers` library, else bytes.

Both give the same small surface: encode(text) -> ids, decode(ids) -> text,
and the ids that end a sample (`eos_ids`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

BYTE_VOCAB = 258  # 256 bytes, then BOS and EOS
BYTE_BOS, BYTE_EOS = 256, 257


class ByteTokenizer:
    """One token per UTF-8 byte; ids >= 256 are specials and decode to nothing."""

    def __init__(self, eos_ids: Sequence[int] = (BYTE_EOS,)):
        self.eos_ids = frozenset(eos_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` read by the `tokenizers` library (no transformers needed)."""

    def __init__(self, path: Path, eos_ids: Sequence[int]):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.eos_ids = frozenset(eos_ids)

    def encode(self, text: str) -> list[int]:
        # Specials as the tokenizer's post-processor adds them (BOS for Llama), like
        # transformers' default; chat templates are out of scope.
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: Path | None, eos_ids: Sequence[int]):
    """`tokenizer.json` when the directory has one, else bytes (ends on `eos_ids`)."""
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir / "tokenizer.json", eos_ids)
    return ByteTokenizer(eos_ids or (BYTE_EOS,))
