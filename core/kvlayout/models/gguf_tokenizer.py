"""The tokenizer files of a model directory, built from a GGUF's vocabulary.

`tokenizer.json` is built with the `tokenizers` library from the GGUF's
tokens and merges (byte-level BPE, the `gpt2` tokenizer model), so the
`tokenizers` library alone, transformers' AutoTokenizer and mlx-lm all read
it. How text is split before BPE is named by `tokenizer.ggml.pre`; each name
we know is mapped to the Hugging Face pre-tokenizer that splits the same way
llama.cpp does (llama-vocab.cpp). Tokens of type "control" become special
added tokens (`<|im_start|>` encodes to one id and is skipped on decode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvlayout.errors import ConfigError
from kvlayout.models.gguf_file import meta_scalar

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
CONTROL, USER_DEFINED = 3, 4


def _gpt2(prefix: bool):
    # GPT-2's own split: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
    return pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=True)


def _digits_then_gpt2(prefix: bool):
    # llama.cpp splits every number code point off first (`\p{N}`), then applies GPT-2's
    # split to what is left, so " 2024" is " ", "2", "0", "2", "4". HF writes SmolLM2's
    # tokenizer.json as exactly this sequence.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2(prefix)])


# tokenizer.ggml.pre -> pre-tokenizer: the names llama.cpp handles with one of these two rules.
PRE_TOKENIZERS = {
    "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2,
    "starcoder": _digits_then_gpt2,
    "refact": _digits_then_gpt2,
}


def build_tokenizer(meta: Mapping[str, Any], source: str) -> Tokenizer:
    """The `tokenizers` Tokenizer the GGUF metadata `meta` describes; ConfigError names what it cannot build."""
    kind = meta_scalar(meta, "tokenizer.ggml.model", source, str, None)
    if kind != "gpt2":
        raise ConfigError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; kvlayout builds 'gpt2' "
            "(byte-level BPE) tokenizers"
        )
    pre = meta_scalar(meta, "tokenizer.ggml.pre", source, str, None)
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    for key, strings in (("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.merges", merges)):
        if not strings or not isinstance(strings, list):
            raise ConfigError(f"{source}: metadata {key!r} is missing, empty or not a list of strings; "
                              "a gpt2 tokenizer needs it")
    for name, i in special_ids(meta, source).items():
        if name in ("bos", "eos") and i >= len(tokens):
            raise ConfigError(
                f"{source}: metadata 'tokenizer.ggml.{name}_token_id' is {i}; "
                f"tokenizer.ggml.tokens has {len(tokens)} entries"
            )
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise ConfigError(
                f"{source}: token {token!r} appears twice in tokenizer.ggml.tokens (ids {vocab[token]} and {i})"
            )
        vocab[token] = i
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise ConfigError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not a pair of known tokens")
        pairs.append((left, right))

    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    prefix = meta_scalar(meta, "tokenizer.ggml.add_space_prefix", source, bool, False)
    tok.pre_tokenizer = PRE_TOKENIZERS[pre](prefix)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens, source)

    types = meta.get("tokenizer.ggml.token_type")
    types = [] if types is None else [int(t) for t in types]
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    )
    return tok


def _post_processor(meta: Mapping[str, Any], tokens: list[str], source: str):
    """BOS/EOS around every encoding when the GGUF asks for them, as llama.cpp adds them."""
    ids = special_ids(meta, source)
    bos, eos = ids.get("bos"), ids.get("eos")
    add_bos = meta_scalar(meta, "tokenizer.ggml.add_bos_token", source, bool, False) and bos is not None
    add_eos = meta_scalar(meta, "tokenizer.ggml.add_eos_token", source, bool, False) and eos is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    head = [tokens[bos]] if add_bos else []
    tail = [tokens[eos]] if add_eos else []
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([*head, "$A", *tail, *head, "$B:1", *tail])
    specials = sorted({(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on})
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


# llama.cpp's names for the special tokens (tokenizer.ggml.NAME_token_id) -> Hugging Face's.
SPECIALS = {"bos": "bos", "eos": "eos", "unknown": "unk", "padding": "pad"}


def special_ids(meta: Mapping[str, Any], source: str) -> dict[str, int]:
    """The special token ids the GGUF names, by llama.cpp's name ("bos", "eos", "unknown", "padding").

    The one place they are read: config.json, generation_config.json,
    tokenizer_config.json and the post-processor all take them from here.
    """
    ids = {}
    for name in SPECIALS:
        i = meta_scalar(meta, f"tokenizer.ggml.{name}_token_id", source, int, None)
        if i is not None and i >= 0:  # llama.cpp writes -1 (LLAMA_TOKEN_NULL) for "none"
            ids[name] = i
    return ids


def tokenizer_config(meta: Mapping[str, Any], source: str) -> dict[str, Any]:
    """tokenizer_config.json: what transformers' AutoTokenizer (and so mlx-lm) reads beside tokenizer.json."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, i in special_ids(meta, source).items():
        if i < len(tokens):  # an unknown or padding id past the vocabulary names no token: left out
            cfg[SPECIALS[name] + "_token"] = tokens[i]
    cfg["add_bos_token"] = meta_scalar(meta, "tokenizer.ggml.add_bos_token", source, bool, False)
    cfg["add_eos_token"] = meta_scalar(meta, "tokenizer.ggml.add_eos_token", source, bool, False)
    template = meta_scalar(meta, "tokenizer.chat_template", source, str, None)
    if template is not None:
        cfg["chat_template"] = template
    context = meta_scalar(meta, "llama.context_length", source, int, None)
    if context is not None:
        cfg["model_max_length"] = context
    return cfg


def generation_config(meta: Mapping[str, Any], source: str) -> dict[str, Any]:
    """generation_config.json: the ids generation starts and stops on (config.json takes its bos/eos from here)."""
    ids = special_ids(meta, source)
    return {f"{SPECIALS[name]}_token_id": ids[name] for name in ("bos", "eos", "padding") if name in ids}
