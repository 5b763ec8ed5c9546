"""A llama-architecture GGUF written as a model directory that kvlayout and mlx-lm both load.

The directory is the Hugging Face layout (`config.json`, `model.safetensors`
under HF names, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`). Quantized GGML tensors stay quantized: `mx.load`
returns Q4_0, Q4_1 and Q8_0 blocks as MLX affine weight/scales/biases with
32 weights per group, which is exactly what `nn.QuantizedLinear` and
`nn.QuantizedEmbedding` hold, and `config.json` says so in mlx-lm's
`quantization` form (per-module overrides where the bits differ).

Everything is checked on the header (`gguf_file`) before a tensor is read:
the architecture, the hyperparameters, every tensor's name, shape and type.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.errors import ConfigError
from kvlayout.models.gguf_file import GGUFHeader, TensorInfo, meta_scalar, read_header
from kvlayout.models.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config
from kvlayout.models.llama import read_args
from kvlayout.models.loading import save_model, tensors_named

# The GGML types MLX represents exactly, and their bits (None: a float tensor, kept as is).
# Q4_K also loads as 4-bit affine, but its 6-bit sub-scales are rounded to float16 on
# the way (not exact); K-quants and IQ types `mx.load` silently dequantizes to float16.
TYPE_BITS = {"F32": None, "F16": None, "Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GROUP_SIZE = 32  # weights per block in every type above

# GGUF tensor stems -> HF module names.
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write the model in the GGUF at `gguf_path` into `out_dir`; ConfigError (nothing written) on a file we refuse."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    source = str(gguf_path)
    header = read_header(gguf_path)
    cfg = hf_config(header, source)
    expected = expected_tensors(cfg)
    check_tensors(header, expected, source)
    tokenizer = build_tokenizer(header.metadata, source)
    if tokenizer.get_vocab_size(with_added_tokens=True) != cfg["vocab_size"]:
        raise ConfigError(
            f"{source}: tokenizer.ggml.tokens has {tokenizer.get_vocab_size(with_added_tokens=True)} "
            f"entries, token_embd.weight has {cfg['vocab_size']} rows"
        )
    quantization = quantization_config(header, expected)
    if quantization:
        # mlx-lm reads `quantization` (and writes both keys); the same dict under either.
        cfg |= {"quantization": quantization, "quantization_config": quantization}

    try:
        arrays = mx.load(str(gguf_path))
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError on a bad file
        raise ConfigError(f"{source}: cannot read the GGUF tensors ({exc})") from exc
    weights = hf_weights(arrays, header, cfg)

    save_model(out_dir, cfg, weights)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    for name, content in (
        ("tokenizer_config.json", tokenizer_config(header.metadata, source)),
        ("generation_config.json", generation_config(header.metadata, source)),
    ):
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")
    return out_dir


def _f32(x) -> float:
    # GGUF stores these as float32; the shortest decimal that reads back as the same
    # float32 (1e-05, not 9.999999747378752e-06) is what an HF config.json holds.
    return float(str(np.float32(x)))


def hf_config(header: GGUFHeader, source: str) -> dict[str, Any]:
    """The HF `config.json` (without quantization) of the GGUF's llama model.

    It is checked by `llama.read_args` like any config.json (sizes, head
    counts, rope scaling), so its errors name config.json's keys.
    """
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"{source}: general.architecture is {arch!r}; kvlayout converts 'llama' GGUF files only")
    experts = meta_scalar(meta, "llama.expert_count", source, int, 0)
    if experts:
        raise ConfigError(f"{source}: llama.expert_count is {experts}; mixture-of-experts models are not supported")
    n_heads = meta_scalar(meta, "llama.attention.head_count", source, int)
    rope_scaling = None
    scaling = meta_scalar(meta, "llama.rope.scaling.type", source, str, "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": meta_scalar(meta, "llama.rope.scaling.factor", source, float)}
    elif scaling != "none":
        raise ConfigError(f"{source}: llama.rope.scaling.type {scaling!r} is not supported; expected none or linear")
    # llama.vocab_size is optional: the embedding's rows say it too (check_tensors compares them).
    embed = header.tensors.get("token_embd.weight")
    if embed is None:
        raise ConfigError(f"{source}: tensor 'token_embd.weight' is missing; a llama model has it")
    tied = "output.weight" not in header.tensors
    matrix_types = {t.ggml_type for t in header.tensors.values() if len(t.shape) == 2}
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": meta_scalar(meta, "llama.embedding_length", source, int),
        "intermediate_size": meta_scalar(meta, "llama.feed_forward_length", source, int),
        "num_hidden_layers": meta_scalar(meta, "llama.block_count", source, int),
        "num_attention_heads": n_heads,
        "num_key_value_heads": meta_scalar(meta, "llama.attention.head_count_kv", source, int, n_heads),
        "head_dim": meta_scalar(meta, "llama.attention.key_length", source, int, None),  # None: hidden / heads
        "vocab_size": meta_scalar(meta, "llama.vocab_size", source, int, embed.shape[0]),
        "rms_norm_eps": _f32(meta_scalar(meta, "llama.attention.layer_norm_rms_epsilon", source, float)),
        "rope_theta": _f32(meta_scalar(meta, "llama.rope.freq_base", source, float, 10000.0)),
        "max_position_embeddings": meta_scalar(meta, "llama.context_length", source, int, 4096),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        # Quantized blocks dequantize through float16 scales, so only an all-F32 model is float32.
        "torch_dtype": "float32" if matrix_types <= {"F32"} else "float16",
    }
    if rope_scaling:
        cfg["rope_scaling"] = rope_scaling
    generation = generation_config(meta, source)
    cfg |= {k: generation[k] for k in ("bos_token_id", "eos_token_id") if k in generation}
    head_dim = read_args(cfg, source=f"{source}: its config.json").head_dim
    cfg["head_dim"] = head_dim
    for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
        value = meta_scalar(meta, key, source, int, head_dim)
        if value != head_dim:  # a value head of another size, or rope on part of the head
            raise ConfigError(f"{source}: {key} is {value}, the head dimension is {head_dim}; not supported")
    return cfg


def expected_tensors(cfg: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF tensor name -> (HF module, logical shape in HF order) for the model `cfg` describes."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    out = {
        "token_embd.weight": (TOP["token_embd"], (v, h)),
        "output_norm.weight": (TOP["output_norm"], (h,)),
    }
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = (TOP["output"], (v, h))
    shapes = {
        "attn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
        "ffn_norm": (h,), "ffn_gate": (i, h), "ffn_up": (i, h), "ffn_down": (h, i),
    }
    for n in range(cfg["num_hidden_layers"]):
        for stem, shape in shapes.items():
            out[f"blk.{n}.{stem}.weight"] = (f"model.layers.{n}.{BLOCK[stem]}", shape)
    return out


def check_tensors(header: GGUFHeader, expected: dict[str, tuple[str, tuple[int, ...]]], source: str) -> None:
    """Exactly the expected tensors, each of its shape and of a type MLX holds exactly; else one ConfigError."""
    unexpected = sorted(header.tensors.keys() - expected.keys())
    if unexpected:
        raise ConfigError(f"{source}: {tensors_named(unexpected)} is not part of a llama model kvlayout converts")
    missing = sorted(expected.keys() - header.tensors.keys(), key=_block_order)
    if missing:
        raise ConfigError(f"{source}: {tensors_named(missing)} is missing; the metadata implies it")
    for name, (_, shape) in expected.items():
        info: TensorInfo = header.tensors[name]
        if info.shape != shape:
            raise ConfigError(f"{source}: tensor {name!r} has shape {info.shape}, the metadata implies {shape}")
        if info.ggml_type not in TYPE_BITS:
            raise ConfigError(
                f"{source}: tensor {name!r} has type {info.ggml_type}; kvlayout converts "
                f"{', '.join(TYPE_BITS)} (the types MLX holds exactly)"
            )
        if len(shape) == 1 and TYPE_BITS[info.ggml_type]:
            raise ConfigError(f"{source}: tensor {name!r} is a quantized vector ({info.ggml_type}); not supported")


def _block_order(name: str) -> tuple:
    # "blk.2.x" before "blk.10.x", so the first missing tensor named is the first in the model.
    parts = name.split(".")
    return (int(parts[1]), name) if parts[0] == "blk" else (-1, name)


def quantization_config(header: GGUFHeader, expected: dict[str, tuple[str, tuple[int, ...]]]) -> dict[str, Any] | None:
    """mlx-lm's `quantization`: the bits most modules have, overrides for the rest; None when nothing is quantized."""
    bits = {
        module: TYPE_BITS[header.tensors[name].ggml_type]
        for name, (module, shape) in expected.items()
        if len(shape) == 2  # the modules that can be quantized: linears and the embedding
    }
    counts = Counter(b for b in bits.values() if b)
    if not counts:
        return None
    default = counts.most_common(1)[0][0]
    out: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": default}
    for module, b in sorted(bits.items()):
        if b is None:
            out[module] = False  # a float matrix among quantized ones stays a plain Linear
        elif b != default:
            out[module] = {"group_size": GROUP_SIZE, "bits": b}
    return out


def unpermute_rope_rows(a: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's reordering of attn_q / attn_k rows.

    llama.cpp's converter stores each head's rows with the two rotary halves
    interleaved (row pairs (0, D/2), (1, D/2 + 1), ... adjacent), for its
    adjacent-pair rope; HF's rotate-half rope wants the halves apart. Rows only:
    the same reordering applies to a quantized weight's packed rows, scales and
    biases, since quantization groups run along the input dimension.
    """
    rows = a.shape[0]
    return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def hf_weights(arrays: dict[str, mx.array], header: GGUFHeader, cfg: dict[str, Any]) -> dict[str, mx.array]:
    """The GGUF's tensors under HF names, q/k rows in HF's order; quantized ones as weight/scales/biases."""
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    expected = expected_tensors(cfg)
    weights = {}
    for name, (module, _) in expected.items():
        stem = name.removesuffix(".weight")
        parts = ("weight", "scales", "biases") if TYPE_BITS[header.tensors[name].ggml_type] else ("weight",)
        n_heads = heads.get(stem.split(".")[-1])
        for part in parts:
            a = arrays[f"{stem}.{part}"]
            weights[f"{module}.{part}"] = unpermute_rope_rows(a, n_heads) if n_heads else a
    return weights
