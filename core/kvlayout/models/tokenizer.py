"""Tokenizers: a directory's `tokenizer.json` through the `tokenizers` library, or bytes.

Both give the same small surface: `encode(text)` -> ids, `decode(ids)` ->
text, the ids that end a sample (`eos_ids`) and the model's chat template
(`chat_template`, a `models.chat.ChatTemplate`, or None). A directory
without `tokenizer.json` gets the byte tokenizer only when its model's
vocabulary is the byte vocabulary; any other is refused, naming what is
missing (a 32000-id model decoding through bytes would "generate" nothing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from kvlayout.checks import finite_number
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

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), cheap to take (the server's length check): exact here."""
        return len(text.encode("utf-8"))

    special_texts: tuple[str, ...] = ()  # no text encodes to a special id

    def token_bytes(self, token: int) -> bytes:
        """The bytes `token` stands for: its byte, none for a special id."""
        return bytes([token]) if 0 <= token < 256 else b""

    def encode_literal(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens)


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
        self._bound: tuple[int, bytes] | None = None  # byte_level_bound's, taken on first use
        self._literal = None  # encode_literal's tokenizer, made on first use
        self._byte_of: dict[str, int] | None = None  # token_bytes' table (GPT-2's for a byte-level BPE), on first use

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

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The texts `encode` turns into a special id (`<|im_end|>`)."""
        return tuple(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special)

    @property
    def json_text(self) -> str:
        """The tokenizer as tokenizer.json holds it (a grammar library builds its own view from it)."""
        return self._tok.to_str()

    def token_bytes(self, token: int) -> bytes:
        """The bytes `token` stands for, which may be part of a character (a byte-level BPE's
        pieces, SentencePiece's `<0xE2>`): what a logprob reports beside the token's text. A
        special token's is its text; an id outside the vocabulary has none."""
        if self._byte_of is None:  # the decoder alone says it (the whole tokenizer.json is megabytes to parse)
            decoder = self._tok.decoder
            byte_level = decoder is not None and b"ByteLevel" in decoder.__getstate__()
            self._byte_of = byte_alphabet() if byte_level else {}
        piece = self._tok.id_to_token(token)
        if piece is None:
            return b""
        if self._byte_of and all(c in self._byte_of for c in piece):
            return bytes(self._byte_of[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece writes a space as U+2581

    def encode_literal(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of `text` read as plain text: `<|im_end|>` written in it is the characters, not the
        special id (a user's chat message, models.chat). A second tokenizer, so that `encode` on
        another thread never sees the switch."""
        if self._literal is None:
            from tokenizers import Tokenizer

            literal = Tokenizer.from_str(self._tok.to_str())
            literal.encode_special_tokens = True
            self._literal = literal
        return self._literal.encode(text, add_special_tokens=add_special_tokens).ids

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), cheap to take (the server's length check; 0 where no
        cheap bound is known): see `byte_level_bound`."""
        if self._bound is None:
            self._bound = byte_level_bound(json.loads(self._tok.to_str()), self._tok.get_vocab(with_added_tokens=True))
        longest, dropped = self._bound
        if not longest:
            return 0
        return -(-len(text.encode("utf-8").translate(None, dropped)) // longest)


# Pre-tokenizers that split text without dropping any of it.
LOSSLESS_SPLITS = {"ByteLevel", "Digits", "Punctuation", "Split"}


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE's
    vocabulary, to the byte. (tokenizers' ByteLevel.alphabet() lists the characters in no order.)"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def byte_level_bound(spec: dict, vocab: dict[str, int]) -> tuple[int, bytes]:
    """For a byte-level BPE tokenizer (tokenizer.json `spec`): (L, D), L the UTF-8 length of its
    longest vocabulary entry or added token, D the bytes its vocabulary lacks. Each byte of a text
    not in D lands in exactly one token (a byte the vocabulary lacks is silently dropped: SmolLM2's
    lacks some control bytes) and no token covers more than L of them, so a text with B bytes
    outside D takes at least ceil(B / L) tokens. A byte-level entry's characters stand for one byte
    each and take one or two in UTF-8, so counting L in UTF-8 never makes it too small. (0, b"")
    where nothing so simple holds: a normalizer (it may shorten the text), a pre-tokenizer that
    drops text (whitespace splitting), a model other than BPE (WordPiece's one unknown token covers
    a whole word; SentencePiece's)."""
    from tokenizers.pre_tokenizers import ByteLevel

    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    byte_level = any(step.get("type") == "ByteLevel" for step in steps)
    lossless = all(step.get("type") in LOSSLESS_SPLITS and step.get("behavior") != "Removed" for step in steps)
    if spec.get("normalizer") is not None or not (byte_level and lossless) or spec["model"].get("type") != "BPE":
        return 0, b""
    char_of = {b: c for c, b in byte_alphabet().items()}
    assert set(char_of.values()) == set(ByteLevel.alphabet())
    dropped = bytes(b for b, c in char_of.items() if c not in vocab)
    return max(len(token.encode("utf-8")) for token in vocab), dropped


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


def sampling_defaults(model_dir: Path | None) -> dict[str, float]:
    """The sampling generation_config.json asks for (`temperature`, `top_p`, each when it names one),
    as a server defaults to (vLLM's reading); {} without the file. ConfigError naming the file for a
    value out of range."""
    path = None if model_dir is None else Path(model_dir) / GENERATION_CONFIG
    if path is None or not path.is_file():
        return {}
    config = read_json_object(path)
    out = {key: finite_number(f"{path}: {key}", config[key], ConfigError, low, high, from_json=True)
           for key, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)) if config.get(key) is not None}
    if out.get("top_p") == 0.0:
        raise ConfigError(f"{path}: top_p is 0; expected a number in (0, 1]")
    return out


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
