"""Hand-made tokenizer directories, as a Hugging Face model directory holds them.

`bpe()` trains a small byte-level BPE (SmolLM2's kind: ChatML specials, a
ByteLevel pre-tokenizer and decoder) on text with accents, CJK and emoji, so
multi-byte characters span several tokens. `byte_fallback()` is Llama's
kind: a SentencePiece-style BPE whose unknown characters fall back to
`<0xNN>` byte tokens. `write_tokenizer(dir, ...)` adds `tokenizer.json` and
`tokenizer_config.json` (with a chat template) to a directory;
`chat_model_dir` makes a tiny model directory whose vocabulary is the BPE's.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = 0, 1, 2

# SmolLM2-135M-Instruct's template, as its tokenizer_config.json has it.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The KV cache keeps keys and values of every token the model has seen.",
    "Un café crème, s'il vous plaît; déjà vu à Montréal. Ça coûte trois euros.",
    "日本語のテキストと中文文本，還有한국어 문장도 있습니다。",
    "Emoji: 😀 🎉 👩‍💻 🇫🇷 ❤️ — and a snowman ☃ beside ümlauts in Grüße.",
    "system user assistant: answer in one line, please. Paris is the capital of France.",
]
MULTIBYTE = [
    "Grüße aus Köln, café crème, naïve façade",
    "日本語のテキスト，中文文本",
    "😀🎉 👩‍💻 family 👨‍👩‍👧 flag 🇫🇷",
    "mixed: a😀b日c é\u0301 ☃",
]


def bpe(vocab_size: int = 600) -> Tokenizer:
    """A byte-level BPE with the ChatML specials at ids 0, 1, 2."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS * 4, trainer)
    return tk


def byte_fallback() -> Tokenizer:
    """A Llama-style tokenizer: "▁" for spaces, a few ASCII words, every other character as <0xNN> bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "e", "i", "l", "m", "x", "d", "f", "g", "y", "▁m", "▁a", "ix", "ed", "▁mix"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "m"), ("i", "x"), ("e", "d"), ("▁m", "ix")]
    # ▁a is a piece of its own, with no merge leading to it.
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tk.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tk


def write_tokenizer(model_dir: Path, tokenizer: Tokenizer | None = None, template: str | list | None = CHATML,
                    **config) -> Path:
    """tokenizer.json and tokenizer_config.json (bos/eos tokens, the chat template) into `model_dir`."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (tokenizer or bpe()).save(str(model_dir / "tokenizer.json"))
    tc = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
          "tokenizer_class": "GPT2Tokenizer", **config}
    if template is not None:
        tc["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tc))
    return model_dir


def chat_model_dir(model_dir: Path, template: str | list | None = CHATML, generation_eos=None, **overrides) -> Path:
    """The tiny preset over the BPE's vocabulary, with tokenizer files (and generation_config.json's eos ids)."""
    from kvlayout.models.presets import write_preset

    tk = bpe()
    write_preset(model_dir, "tiny", vocab_size=tk.get_vocab_size(), bos_token_id=IM_START,
                 eos_token_id=ENDOFTEXT, **overrides)
    write_tokenizer(model_dir, tk, template)
    if generation_eos is not None:
        (Path(model_dir) / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return Path(model_dir)
