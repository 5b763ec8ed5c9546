"""Tokenizers: a directory's `tokenizer.json` through the `tokenizers` library, or bytes.

Both give the same small surface: `encode(text)` -> ids, `decode(ids)` ->
text, the ids that end a sample (`eos_ids`) and the model's chat template
(`chat_template`, a `models.chat.ChatTemplate`, or None). A directory
without `tokenizer.json` gets the byte tokenizer only when its model's
vocabulary is the byte vocabulary; any other is refused, naming what is
missing (a 32000-id model decoding through bytes would "generate" nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvlayout.errors import ConfigError, one_line
from kvlayout.models.chat import ChatTemplate, read_chat_template
from kvlayout.models.config_values import token_ids
from kvlayout.models.files import read_json_object, read_text

BYTE_VOCAB = 258  # 256 bytes, then BOS and EOS
BYTE_BOS, BYTE_EOS = 256, 257
GENERATION_CONFIG = "generation_config.json"


class ByteTokenizer:
    """One token per UTF-8 byte; ids >= 256 are specials and decode to nothing. No chat template."""

    chat_template: ChatTemplate | None = None

    def __init__(self, eos_ids: Sequence[int] = (BYTE_EOS,)):
        self.eos_ids = frozenset(eos_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` read by the `tokenizers` library (no transformers needed); ConfigError naming
    the file when the library cannot read it."""

    def __init__(self, path: Path, eos_ids: Sequence[int], chat_template: ChatTemplate | None = None):
        from tokenizers import Tokenizer

        read_text(path)  # bytes that are not UTF-8 are named as in every other file of the directory
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # `tokenizers` raises a bare Exception for any file it cannot read
            why = one_line(exc)
            raise ConfigError(f"{path}: not a tokenizer the tokenizers library reads ({why})") from None
        self.eos_ids = frozenset(eos_ids)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text`; special tokens written in it (`<|im_start|>`) are parsed as one id each.

        `add_special_tokens` adds what the tokenizer's post-processor adds (BOS
        for Llama), like transformers' default. A rendered chat is encoded
        without them, as `apply_chat_template` does: a template that wants a
        BOS writes `{{ bos_token }}` itself.
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def eos_ids_of(model_dir: Path, config_eos: Sequence[int] = ()) -> list[int]:
    """Every id that ends a sample: config.json's `eos_token_id` (given) and generation_config.json's.

    Chat models often stop on an end-of-turn id that only generation_config.json
    names (`<|im_end|>` beside `<|endoftext|>`), as transformers' generate does.
    """
    ids = list(config_eos)
    path = Path(model_dir) / GENERATION_CONFIG
    if path.is_file():
        ids += token_ids(read_json_object(path).get("eos_token_id"), "eos_token_id", str(path))
    return list(dict.fromkeys(ids))


def load_tokenizer(model_dir: Path, eos_ids: Sequence[int], vocab_size: int):
    """The directory's tokenizer, ending samples on `eos_ids` (config.json's) and generation_config.json's.

    `tokenizer.json` when there is one (with the directory's chat template),
    else bytes, which only a byte-vocabulary model (`vocab_size`, config.json's)
    may use: ConfigError otherwise.
    """
    model_dir = Path(model_dir)
    eos = eos_ids_of(model_dir, eos_ids)
    if (model_dir / "tokenizer.json").is_file():
        return HFTokenizer(model_dir / "tokenizer.json", eos, read_chat_template(model_dir))
    if vocab_size != BYTE_VOCAB:
        raise ConfigError(
            f"{model_dir}: tokenizer.json is missing, and the model's vocabulary ({vocab_size} ids in config.json) "
            f"is not the byte vocabulary ({BYTE_VOCAB}); copy the model's tokenizer.json into the directory"
        )
    return ByteTokenizer(eos or (BYTE_EOS,))
