"""Small GGUF files as llama.cpp would write them, for the conversion tests.

Written with `mx.save_gguf` (MLX's own writer, independent of our header
reader). llama.cpp's side is re-done here from its definitions, not from our
converter: HF names -> GGUF names, the rope row permutation of
convert_hf_to_gguf.py (`reshape(n_head, 2, D/2, ...)`, swap the two inner
axes), and the GGML block encodings of Q4_0 and Q8_0 (ggml-quants.c), which
save_gguf cannot write: their bytes are saved as an int8 tensor whose type and
first dimension are then patched in the header.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import pre_tokenizers

from kvlayout.models.presets import preset_config, random_weights

GGML_Q4_0, GGML_Q8_0 = 2, 8

# A toy byte-level BPE: the 256 byte symbols, three merges, two control tokens.
ALPHABET = sorted(pre_tokenizers.ByteLevel.alphabet())
MERGES = ["Ġ t", "h e", "Ġt he"]
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
TOKENS = ALPHABET + ["Ġt", "he", "Ġthe"] + SPECIALS
BOS, EOS = len(TOKENS) - 2, len(TOKENS) - 1

HF_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def tiny_llama(**overrides: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(HF config, float32 HF weights) of the tiny preset over the toy vocabulary."""
    cfg = preset_config(
        "tiny", vocab_size=len(TOKENS), bos_token_id=BOS, eos_token_id=EOS, rope_theta=50000.0, **overrides
    )
    return cfg, {k: np.array(v) for k, v in random_weights(cfg, seed=5).items()}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF q/k rows -> GGUF rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    module, _, part = hf.rpartition(".")
    if module.startswith("model.layers."):
        n, _, rest = module.removeprefix("model.layers.").partition(".")
        return f"blk.{n}.{HF_TO_GGUF[rest]}.{part}"
    return f"{HF_TO_GGUF[module]}.{part}"


def gguf_name_to_hf(name: str) -> str:
    """'blk.0.attn_q.weight' -> 'model.layers.0.self_attn.q_proj' (the module, for named_modules())."""
    back = {g: h for h, g in HF_TO_GGUF.items()}
    stem = name.removesuffix(".weight")
    if stem.startswith("blk."):
        _, n, rest = stem.split(".", 2)
        return f"model.layers.{n}.{back[rest]}"
    return back[stem]


def metadata(cfg: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The llama.* and tokenizer.* keys llama.cpp writes for `cfg`; an override of None drops a key."""
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "llama.block_count": u32(cfg["num_hidden_layers"]),
        "llama.context_length": u32(cfg["max_position_embeddings"]),
        "llama.embedding_length": u32(cfg["hidden_size"]),
        "llama.feed_forward_length": u32(cfg["intermediate_size"]),
        "llama.attention.head_count": u32(cfg["num_attention_heads"]),
        "llama.attention.head_count_kv": u32(cfg["num_key_value_heads"]),
        "llama.attention.key_length": u32(cfg["head_dim"]),
        "llama.rope.dimension_count": u32(cfg["head_dim"]),
        "llama.rope.freq_base": mx.array(cfg["rope_theta"], dtype=mx.float32),
        "llama.attention.layer_norm_rms_epsilon": mx.array(cfg["rms_norm_eps"], dtype=mx.float32),
        "llama.vocab_size": u32(cfg["vocab_size"]),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": mx.array([1] * (len(TOKENS) - 2) + [3, 3], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(BOS),
        "tokenizer.ggml.eos_token_id": u32(EOS),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def gguf_tensors(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The HF weights under GGUF names, q/k rows permuted as llama.cpp stores them."""
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    out = {}
    for hf, w in weights.items():
        n_head = next((n for proj, n in heads.items() if f".{proj}." in hf), None)
        out[gguf_name(hf)] = llama_cpp_permute(w, n_head) if n_head else w
    return out


def write_gguf(
    path: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any], types: dict[str, int] | None = None
) -> Path:
    """Save `tensors` (float32/float16 as such; names in `types` encoded as that GGML block type)."""
    types = types or {}
    arrays, patches = {}, {}
    for name, w in tensors.items():
        if name in types:
            raw = ENCODERS[types[name]](w)  # [rows, blocks * block_bytes] uint8
            arrays[name] = mx.array(raw.view(np.int8))
            patches[name] = (types[name], w.shape[-1])
        else:
            arrays[name] = mx.array(w)
    mx.save_gguf(str(path), arrays, meta)
    for name, (kind, cols) in patches.items():
        retype(path, name, kind, cols)
    return path


def retype(path: Path, name: str, ggml_type: int, ne0: int | None = None) -> None:
    """Patch tensor `name`'s type (and innermost dimension) in the header, data untouched."""
    data = bytearray(Path(path).read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key, 24) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    if ne0 is not None:
        struct.pack_into("<Q", data, at + 4, ne0)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    Path(path).write_bytes(bytes(data))


def _blocks(w: np.ndarray) -> np.ndarray:
    return w.astype(np.float32).reshape(w.shape[0], -1, 32)  # [rows, blocks, 32]


def encode_q8_0(w: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_0: per 32 weights, d = amax / 127 (f16), q = round(x / d) as int8."""
    x = _blocks(w)
    d = (np.abs(x).max(-1, keepdims=True) / 127).astype(np.float16)
    q = np.round(x / np.where(d == 0, 1, d).astype(np.float32)).astype(np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], -1).reshape(w.shape[0], -1)


def encode_q4_0(w: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_0: d = (the signed value of largest magnitude) / -8, q = x / d + 8 in [0, 15];
    byte j of a block holds q[j] in its low nibble and q[j + 16] in its high one."""
    x = _blocks(w)
    big = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    d = (big / -8).astype(np.float16)
    inv = np.where(d == 0, 0, 1 / np.where(d == 0, 1, d).astype(np.float32))
    q = np.clip(np.trunc(x * inv + 8.5), 0, 15).astype(np.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), packed], -1).reshape(w.shape[0], -1)


def decode_q8_0(raw: np.ndarray, cols: int) -> np.ndarray:
    b = raw.reshape(raw.shape[0], cols // 32, 34)
    d = b[..., :2].copy().view(np.float16).astype(np.float32)
    return (d * b[..., 2:].view(np.int8)).reshape(raw.shape[0], cols)


def decode_q4_0(raw: np.ndarray, cols: int) -> np.ndarray:
    b = raw.reshape(raw.shape[0], cols // 32, 18)
    d = b[..., :2].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([b[..., 2:] & 0x0F, b[..., 2:] >> 4], -1).astype(np.float32)
    return (d * (q - 8)).reshape(raw.shape[0], cols)


ENCODERS = {GGML_Q4_0: encode_q4_0, GGML_Q8_0: encode_q8_0}
DECODERS = {GGML_Q4_0: decode_q4_0, GGML_Q8_0: decode_q8_0}
