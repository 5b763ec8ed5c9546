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

from typing import Any, Mapping

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from kvlayout.errors import ConfigError

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


def _scalar(meta: Mapping[str, Any], key: str, default=None):
    value = meta.get(key, default)
    return value.item() if hasattr(value, "item") else value


def build_tokenizer(meta: Mapping[str, Any], source: str) -> Tokenizer:
    """The `tokenizers` Tokenizer the GGUF metadata `meta` describes; ConfigError names what it cannot build."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(
            f"{source}: tokenizer.ggml.model {kind!r} is not supported; kvlayout builds 'gpt2' "
            "(byte-level BPE) tokenizers"
        )
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ConfigError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens = list(meta.get("tokenizer.ggml.tokens", []))
    merges = list(meta.get("tokenizer.ggml.merges", []))
    if not tokens or not merges:
        missing = "tokenizer.ggml.tokens" if not tokens else "tokenizer.ggml.merges"
        raise ConfigError(f"{source}: metadata {missing!r} is missing or empty; a gpt2 tokenizer needs it")
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in vocab:
            raise ConfigError(f"{source}: token {token!r} appears twice in tokenizer.ggml.tokens (ids {vocab[token]} and {i})")
        vocab[token] = i
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise ConfigError(f"{source}: tokenizer.ggml.merges entry {merge!r} is not a pair of known tokens")
        pairs.append((left, right))

    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    prefix = bool(_scalar(meta, "tokenizer.ggml.add_space_prefix", False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre](prefix)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = _post_processor(meta, tokens)

    types = meta.get("tokenizer.ggml.token_type")
    types = [] if types is None else [int(t) for t in types]
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    )
    tok.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    )
    return tok


def _post_processor(meta: Mapping[str, Any], tokens: list[str]):
    """BOS/EOS around every encoding when the GGUF asks for them, as llama.cpp adds them."""
    bos, eos = _scalar(meta, "tokenizer.ggml.bos_token_id"), _scalar(meta, "tokenizer.ggml.eos_token_id")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return processors.ByteLevel(trim_offsets=False)
    head = [tokens[bos]] if add_bos else []
    tail = [tokens[eos]] if add_eos else []
    single = " ".join([*head, "$A", *tail])
    pair = " ".join([*head, "$A", *tail, *head, "$B:1", *tail])
    specials = sorted({(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on})
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def tokenizer_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: what transformers' AutoTokenizer (and so mlx-lm) reads beside tokenizer.json."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name in ("bos", "eos", "unknown", "padding"):
        i = _scalar(meta, f"tokenizer.ggml.{name}_token_id")
        if i is not None and 0 <= i < len(tokens):
            cfg[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = tokens[i]
    cfg["add_bos_token"] = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", False))
    if "tokenizer.chat_template" in meta:
        cfg["chat_template"] = meta["tokenizer.chat_template"]
    if "llama.context_length" in meta:
        cfg["model_max_length"] = int(_scalar(meta, "llama.context_length"))
    return cfg


def generation_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: the ids generation starts and stops on."""
    out = {}
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        i = _scalar(meta, f"tokenizer.ggml.{name}_token_id")
        if i is not None:
            out[key] = int(i)
    return out
